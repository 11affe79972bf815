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
    """`tag` as a directory name, refused when it is not a plain, visible file name."""
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or tag.startswith(".") or "\n" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty file name that does not "
                         f"start with '.' and has no '/'")
    return tag


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: `tag`, or the contents of `load_dir/latest` (None if there is none)."""
    if tag is not None:
        return str(tag)
    path = os.path.join(load_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except FileNotFoundError:
        return None
    if not text:
        raise CheckpointError(f"'{path}' is empty")
    return text


def write_latest(save_dir: str, tag: str) -> None:
    write_text_atomically(os.path.join(save_dir, LATEST), tag + "\n")
