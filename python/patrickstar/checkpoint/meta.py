"""A checkpoint directory's index: `meta.json` (format, version, checksum of its body) and the
`latest` file naming the newest complete tag (Note [Atomic checkpoints])."""
from __future__ import annotations

import hashlib
import json
import os

from .atomic_files import write_text_atomically
from .errors import CheckpointError

__all__ = ["FORMAT", "VERSION", "LATEST", "META", "meta_checksum", "read_meta", "write_meta",
           "resolve_tag", "write_latest", "check_tag"]

FORMAT = "patrickstar-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"


def meta_checksum(body: dict) -> str:
    """The sha256 meta.json records of its own body."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_meta(tag_dir: str, body: dict) -> None:
    write_text_atomically(os.path.join(tag_dir, META), json.dumps(
        {"format": FORMAT, "version": VERSION, "sha256": meta_checksum(body), "body": body},
        indent=1, sort_keys=True))


def read_meta(tag_dir: str) -> dict:
    """The verified body of `tag_dir/meta.json`."""
    path = os.path.join(tag_dir, META)
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{tag_dir}' has no {META} (not a PatrickStar "
                              f"checkpoint, or an incomplete one)") from None
    except ValueError as error:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: {error}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or "body" not in raw:
        raise CheckpointError(f"'{path}' is not a {FORMAT} file")
    if raw.get("version") != VERSION:
        raise CheckpointError(f"'{path}' has format version {raw.get('version')}; this "
                              f"PatrickStar reads version {VERSION}")
    if meta_checksum(raw["body"]) != raw.get("sha256"):
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: its checksum does not "
                              f"match its contents")
    return raw["body"]


def check_tag(tag) -> str:
    """`tag` as a directory name inside the checkpoint directory, refused (ValueError naming
    it) unless it is a plain, visible file name: no separator, no '..', not `latest` (the
    resume pointer's own name), no surrounding whitespace (it would save under one name and
    resume under another), no control characters."""
    tag = str(tag)
    problem = None
    if not tag:
        problem = "is empty"
    elif tag == LATEST:
        problem = f"is the name of the resume pointer file '{LATEST}'"
    elif tag != tag.strip():
        problem = "has surrounding whitespace"
    elif "/" in tag or "\\" in tag or os.sep in tag:
        problem = "contains a path separator (tags name a directory inside the checkpoint " \
                  "directory)"
    elif tag.startswith("."):
        problem = "starts with '.' (hidden names and '..' are reserved)"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in tag):
        problem = "contains a control character"
    if problem is not None:
        raise ValueError(f"checkpoint tag {tag!r} {problem}; use a plain name such as "
                         f"'global_step100'")
    return tag


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: `tag`, or the contents of `load_dir/latest` (None if there is none);
    either way a name inside `load_dir` (check_tag)."""
    if tag is not None:
        return check_tag(tag)
    path = os.path.join(load_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    text = text[:-1] if text.endswith("\n") else text  # as written before (and by hand)
    if not text:
        raise CheckpointError(f"'{path}' is empty")
    try:
        return check_tag(text)
    except ValueError as error:
        raise CheckpointError(f"'{path}' names {text!r}, which is not a checkpoint inside "
                              f"'{load_dir}': {error}") from None


def write_latest(save_dir: str, tag: str) -> None:
    # The tag alone, as DeepSpeed writes it: scripts read it with open(...).read().
    write_text_atomically(os.path.join(save_dir, LATEST), tag)
