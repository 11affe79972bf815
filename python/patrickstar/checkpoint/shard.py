"""The shard file format (Note [Shard format] in checkpoint/__init__.py): writing one shard
tensor by tensor, and reading a verified shard one tensor at a time."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import struct

import torch

from .. import dtypes
from .atomic_files import crash_point, file_sha256, open_for_writing, write_error
from .errors import CheckpointError

__all__ = ["Entry", "Shard", "write_shard", "shard_name", "extra_name", "tensor_bytes",
           "HEADER_BYTES", "TRAILER_BYTES"]

_MAGIC = b"PSSHARD1"
_TRAILER = b"PSSHEND1"
HEADER_BYTES = 16  # magic and the u64 header length
TRAILER_BYTES = len(_TRAILER) + 32
_ALIGN = 64


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.shard"


def extra_name(rank: int) -> str:
    return f"rank_{rank:05d}_extra.pt"


@dataclasses.dataclass
class Entry:
    """One tensor of a shard: (name, kind) identifies it across all shards of a checkpoint."""
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0

    @property
    def numel(self) -> int:
        return math.prod(int(size) for size in self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype,
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}

    @staticmethod
    def from_json(raw: dict) -> "Entry":
        return Entry(raw["name"], raw["kind"], raw["dtype"], tuple(raw["shape"]),
                     int(raw["offset"]), int(raw["nbytes"]))


class _HashingWriter:
    def __init__(self, handle, path: str, total: int):
        self.handle = handle
        self.path = path
        self.total = total
        self.hash = hashlib.sha256()
        self.position = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        with self.naming_errors():
            self.handle.write(view)
        self.position += len(view)

    @contextlib.contextmanager
    def naming_errors(self):
        """A failed write, flush or fsync (a full disk: "[Errno 28] No space left on device",
        which names no file) becomes an OSError naming the shard and its byte counts. Only the
        file's own IO: an error reading the engine's state keeps its own message."""
        try:
            yield
        except OSError as error:
            raise write_error(error, self.path, self.position, self.total) from error

    def pad_to(self, offset: int) -> None:
        if offset < self.position:
            raise AssertionError("shard entries out of order")
        self.write(bytes(offset - self.position))


def write_shard(path: str, header: dict, entries: list[Entry], read) -> tuple[int, str]:
    """Writes a shard streaming tensor by tensor: `read(entry)` returns the tensor's CPU bytes
    (a contiguous tensor); returns (file size, sha256 of the payload before the trailer)."""
    body = dict(header)
    body["tensors"] = [e.to_json() for e in entries]
    # Offsets depend on the header length, which depends on the offsets' digits: iterate.
    offset_guess = 4096
    while True:
        position = offset_guess
        for entry in entries:
            position = -(-position // _ALIGN) * _ALIGN
            entry.offset = position
            entry.nbytes = dtypes.element_size(entry.dtype) * entry.numel
            position += entry.nbytes
        body["tensors"] = [e.to_json() for e in entries]
        encoded = json.dumps(body, sort_keys=True).encode()
        start = -(-(HEADER_BYTES + len(encoded)) // 4096) * 4096
        if start <= offset_guess:
            break
        offset_guess = start
    total = position + TRAILER_BYTES
    with open_for_writing(path) as handle:
        writer = _HashingWriter(handle, path, total)
        writer.write(_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
        for index, entry in enumerate(entries):
            writer.pad_to(entry.offset)
            tensor = read(entry)
            if tuple(tensor.shape) != entry.shape or dtypes.NAME_OF[tensor.dtype] != entry.dtype:
                raise AssertionError(f"{entry.name}/{entry.kind}: got {tuple(tensor.shape)} "
                                     f"{tensor.dtype}, expected {entry.shape} {entry.dtype}")
            writer.write(tensor_bytes(tensor))
            if index == len(entries) // 2:
                with writer.naming_errors():
                    handle.flush()
                crash_point("shard_half_written")
        digest = writer.hash.digest()
        with writer.naming_errors():
            handle.write(_TRAILER + digest)
            handle.flush()
            os.fsync(handle.fileno())
        size = writer.position + TRAILER_BYTES
    return size, digest.hex()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of `tensor` on the CPU, contiguous (empty for an empty tensor)."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class Shard:
    """A verified shard; `tensor(entry)` reads one entry."""

    def __init__(self, path: str, expected_size: int | None = None,
                 expected_sha256: str | None = None, verify: bool = True):
        self.path = path
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint shard '{path}' is missing") from None
        if expected_size is not None and size != expected_size:
            raise CheckpointError(f"checkpoint shard '{path}' is {size} bytes but meta.json "
                                  f"records {expected_size}: the file is truncated or was "
                                  f"replaced")
        if size < HEADER_BYTES + TRAILER_BYTES:
            raise CheckpointError(f"checkpoint shard '{path}' is truncated ({size} bytes)")
        with open(path, "rb") as handle:
            head = handle.read(HEADER_BYTES)
            handle.seek(size - TRAILER_BYTES)
            trailer = handle.read(TRAILER_BYTES)
            if head[:8] != _MAGIC:
                raise CheckpointError(f"'{path}' is not a PatrickStar checkpoint shard")
            (header_bytes,) = struct.unpack("<Q", head[8:16])
            if trailer[:8] != _TRAILER or HEADER_BYTES + header_bytes > size - TRAILER_BYTES:
                raise CheckpointError(f"checkpoint shard '{path}' is truncated (no trailer)")
            recorded = trailer[8:].hex()
            if verify:
                actual = file_sha256(path, size - TRAILER_BYTES)
                if actual != recorded:
                    raise CheckpointError(f"checkpoint shard '{path}' is corrupted: sha256 "
                                          f"{actual} but the shard records {recorded}")
            if expected_sha256 is not None and recorded != expected_sha256:
                raise CheckpointError(f"checkpoint shard '{path}' has sha256 {recorded} but "
                                      f"meta.json records {expected_sha256}: it belongs to "
                                      f"another checkpoint")
            handle.seek(HEADER_BYTES)
            try:
                self.header = json.loads(handle.read(header_bytes))
            except ValueError as error:
                raise CheckpointError(f"checkpoint shard '{path}': bad header ({error})") from None
        self.entries = {(e["name"], e["kind"]): Entry.from_json(e) for e in self.header["tensors"]}
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def tensor(self, entry: Entry) -> torch.Tensor:
        """A fresh CPU tensor with the entry's bytes (read with pread: no mapping of the shard
        stays resident, so memory holds one tensor at a time)."""
        dtype = dtypes.BY_NAME[entry.dtype]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        data = bytearray(entry.nbytes)
        view, done = memoryview(data), 0
        while done < entry.nbytes:
            count = os.preadv(self._fd, [view[done:]], entry.offset + done)
            if count <= 0:
                raise CheckpointError(f"checkpoint shard '{self.path}': short read of "
                                      f"{entry.name} ({entry.kind})")
            done += count
        return torch.frombuffer(data, dtype=dtype).view(entry.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
