"""Reading a checkpoint: every shard verified and merged into one index by (name, kind)
(Note [Resharding] in checkpoint/__init__.py), and the per-rank extra files."""
from __future__ import annotations

import os
from typing import Iterable

import torch

from .atomic_files import file_sha256
from .errors import CheckpointError
from .extra_state import decode_extra
from .meta import LATEST, META, read_meta, resolve_tag
from .shard import Entry, Shard

__all__ = ["CheckpointReader", "verify_whole_file"]


class CheckpointReader:
    """All shards of one checkpoint, verified, merged into one index by (name, kind)."""

    def __init__(self, load_dir: str, tag: str | None = None, verify: bool = True,
                 ranks: Iterable[int] | None = None):
        if not os.path.isdir(load_dir):
            raise CheckpointError(f"checkpoint directory '{load_dir}' "
                                  + ("is not a directory" if os.path.exists(load_dir)
                                     else "does not exist"))
        resolved = resolve_tag(load_dir, tag)
        if resolved is None:
            hint = ""
            if os.path.isfile(os.path.join(load_dir, META)):
                parent, name = os.path.split(os.path.normpath(load_dir))
                hint = (f"; '{load_dir}' holds {META}, so it is one tag of a checkpoint: give "
                        f"its parent '{parent or '.'}' and tag '{name}'")
            raise CheckpointError(f"no '{LATEST}' file in '{load_dir}' and no tag given{hint}")
        self.tag = resolved
        self.directory = os.path.join(load_dir, resolved)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory '{self.directory}' "
                                  + ("is a file, not a tag's directory"
                                     if os.path.exists(self.directory) else "does not exist"))
        self.meta = read_meta(self.directory)
        wanted = None if ranks is None else set(ranks)
        self.shards: list[Shard] = []
        # Every rank writes its own buffers (Note [Multi-rank checkpoints]): the merged index
        # keeps the lowest rank's copy of a key, `by_rank` each shard's own.
        self.index: dict[tuple[str, str], tuple[Shard, Entry]] = {}
        self.by_rank: dict[int, dict[tuple[str, str], tuple[Shard, Entry]]] = {}
        try:
            for record in sorted(self.meta["shards"], key=lambda r: r["rank"]):
                if wanted is not None and record["rank"] not in wanted:
                    continue
                shard = Shard(os.path.join(self.directory, record["file"]), record["bytes"],
                              record["sha256"], verify=verify)
                self.shards.append(shard)
                own = self.by_rank.setdefault(record["rank"], {})
                for key, entry in shard.entries.items():
                    own[key] = (shard, entry)
                    self.index.setdefault(key, (shard, entry))
        except BaseException:
            self.close()
            raise

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.index

    def entry(self, name: str, kind: str) -> Entry:
        return self.index[(name, kind)][1]

    def tensor(self, name: str, kind: str, rank: int | None = None) -> torch.Tensor:
        """The tensor from any shard, or from rank `rank`'s shard where that one has it."""
        found = self.by_rank.get(rank, {}).get((name, kind)) or self.index.get((name, kind))
        if found is None:
            raise CheckpointError(f"checkpoint '{self.directory}' has no {kind} tensor for "
                                  f"'{name}'")
        shard, entry = found
        return shard.tensor(entry)

    def has_extra(self, rank: int) -> bool:
        return any(record["rank"] == rank for record in self.meta["extras"])

    def extra(self, rank: int) -> dict:
        for record in self.meta["extras"]:
            if record["rank"] == rank:
                path = os.path.join(self.directory, record["file"])
                verify_whole_file(path, record["bytes"], record["sha256"])
                return decode_extra(path)
        raise CheckpointError(f"checkpoint '{self.directory}' has no extra state of rank {rank}")

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
        self.shards.clear()
        self.index.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def verify_whole_file(path: str, size: int, sha256: str) -> None:
    """Raises CheckpointError unless `path` has the size and sha256 meta.json records."""
    try:
        actual_size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    if actual_size != size:
        raise CheckpointError(f"checkpoint file '{path}' is {actual_size} bytes but meta.json "
                              f"records {size}: truncated or replaced")
    actual = file_sha256(path, size)
    if actual != sha256:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: sha256 {actual}, "
                              f"meta.json records {sha256}")
