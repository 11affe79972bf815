"""Checkpoints: `model.save_checkpoint(dir, tag)` / `model.load_checkpoint(dir, tag)`.

On disk (one directory per tag, DeepSpeed's layout of a `latest` file beside tag directories):

    DIR/latest                        the tag of the newest complete checkpoint (written last)
    DIR/TAG/meta.json                 format, config, precision, chunk layout, tensor table,
                                      engine counters, the shards with their sizes and sha256
    DIR/TAG/rank_00000.shard          rank 0's tensors (see Note [Shard format])
    DIR/TAG/rank_00000_extra.pt       rank 0's RNG states, client_state, lr scheduler state

Note [Atomic checkpoints]
A checkpoint is written into a hidden temporary directory `DIR/.TAG.partial-<pid>-<n>`; every
file is fsync'd, then the directory, then it is renamed to `DIR/TAG` (exchanged atomically with
an existing `DIR/TAG` by renameat2(RENAME_EXCHANGE), then the old one removed), `DIR` is
fsync'd, and only then is `latest` replaced (temporary file, fsync, rename, fsync of `DIR`).
A crash at any point therefore leaves `latest` naming a complete, verified checkpoint: either
the previous one or the new one. Partial directories of dead writers are removed by the next
save. Every shard ends with a sha256 of everything before it, and meta.json records each file's
size and sha256 (and its own checksum), so a truncated or corrupted file is found before any
state changes and reported by name (`CheckpointError`).

Note [Shard format]
    b"PSSHARD1" | u64 header length | JSON header | zero padding to 4096
    tensors at the header's byte offsets (each 64-byte aligned, raw little-endian bytes)
    b"PSSHEND1" | sha256 (32 bytes) of every byte before this trailer
The header lists each entry's `name` (parameter name), `kind` (param: compute dtype; master:
fp32 master copy in mixed precision; exp_avg / exp_avg_sq: Adam state; buffer: module buffers),
dtype, shape, offset and nbytes. Tensors never span chunks, so a shard holds whole tensors and a
reader finds any tensor by (name, kind) in whichever shard has it: that is what lets a checkpoint
written by N ranks load on M (Note [Resharding]). Files are read one tensor at a time (pread),
so loading and consolidation need memory for about one tensor (at most one chunk).

Note [Resharding]
With data parallelism rank r owns chunk r of each communication group and writes only the
tensors of the chunks it owns (optimizer state lives only there). meta.json records the layout
(world size, chunk size, every chunk's tensors with offsets and owner) and every shard's tensor
table, so `CheckpointReader` merges the tables of all shards into one index by (name, kind);
a reader with another world size or chunk size asks for the tensors its own layout gives it
(the engine's `_dp.owns`; `owned_tensor_names()` computes the same set from a checkpoint's
meta.json alone, with the chunk manager's own multi-rank layout). Loading a checkpoint whose
world size or layout differs from the model's is refused unless `allow_reshard=True`, so a
silent change of chunk size is never mistaken for the same run. A rank that loads its own
layout opens (and verifies) only its own shard; a resharding load opens every shard.

Note [Multi-rank checkpoints]
Every rank calls save_checkpoint / load_checkpoint at the same point. A save runs in three
phases, each ended by one all_gather_object over the data group (`_agree`) that
carries every rank's outcome, so an error on one rank (a full disk, pending gradients) is
raised on every rank, naming the rank and its error, and no rank waits on a peer that gave up:
  1. rank 0 removes dead writers' partial directories and creates `DIR/.TAG.partial-<pid>-<n>`
     (its pid); the gather carries that name to every rank (the broadcast);
  2. each rank writes `rank_<r>.shard` (its owned params, masters, Adam state, and its own
     buffers: BatchNorm statistics differ between ranks) and `rank_<r>_extra.pt` (its RNG
     states, client_state, lr scheduler) into it and fsyncs both; the gather carries each
     file's size and sha256 and the Adam step counts of the parameters the rank owns, and is
     the barrier before meta.json;
  3. rank 0 checks that every rank's files are there with the sizes they reported (the
     directory must be on a filesystem all ranks share), writes meta.json, renames and updates
     `latest` as for one rank (Note [Atomic checkpoints]); the last gather keeps every rank in
     save_checkpoint until the checkpoint is complete or has failed everywhere.
A failure leaves `latest` and `DIR/TAG` as they were; rank 0 removes the partial directory
when it survives, the next save when it died. A rank killed mid-save makes the others' next
gather fail at once (gloo sees the closed connection) or after the process group's timeout.
A load agrees on the tag (rank 0 reads `latest`), then every rank verifies what it will read
(shards, extra file, optimizer state of every tensor it owns) and the ranks agree before any
rank changes its engine; a second agreement reports a failure while restoring on every rank.
Each rank restores its own buffers, RNG states, client_state and lr scheduler from rank r's
files; a rank with no counterpart in the checkpoint (loading N on M > N ranks) takes rank 0's.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import io
import itertools
import json
import os
import random
import re
import shutil
import struct
import warnings
from typing import Iterable

import torch

from . import _C

__all__ = ["CheckpointError", "CheckpointReader", "save_checkpoint", "load_checkpoint",
           "resolve_tag", "owned_tensor_names", "FORMAT", "VERSION"]

FORMAT = "patrickstar-checkpoint"
VERSION = 1
LATEST = "latest"
META = "meta.json"
_MAGIC = b"PSSHARD1"
_TRAILER = b"PSSHEND1"
_TRAILER_BYTES = len(_TRAILER) + 32
_ALIGN = 64
_READ_BLOCK = 8 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_PARTIAL = re.compile(r"^\.(?P<tag>.+)\.partial-(?P<pid>\d+)-(?P<n>\d+)$")
_counter = itertools.count()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, or written for another
    model, layout or precision. The message names the file or the difference."""


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.shard"


def extra_name(rank: int) -> str:
    return f"rank_{rank:05d}_extra.pt"


# ---- Low-level durable file operations ---------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of '{a}' and '{b}': {os.strerror(code)}")


def _crash_point(name: str) -> None:
    """Test hook (Note [Atomic checkpoints]): PATRICKSTAR_CHECKPOINT_CRASH_AT=name kills the
    writer with SIGKILL at that point, as a power loss or OOM kill would."""
    if os.environ.get("PATRICKSTAR_CHECKPOINT_CRASH_AT") == name:
        os.kill(os.getpid(), 9)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(save_dir: str) -> list[str]:
    """Removes partial checkpoint directories of writers that no longer run."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(save_dir):
            match = _PARTIAL.match(entry)
            if match and int(match["pid"]) != os.getpid() and not _pid_alive(int(match["pid"])):
                shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
                removed.append(entry)
    return removed


def _write_text_atomically(path: str, text: str) -> None:
    temp = f"{path}.tmp-{os.getpid()}-{next(_counter)}"
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    _fsync_dir(os.path.dirname(path) or ".")


# ---- Shards --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Entry:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype,
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}

    @staticmethod
    def from_json(raw: dict) -> "Entry":
        return Entry(raw["name"], raw["kind"], raw["dtype"], tuple(raw["shape"]),
                     int(raw["offset"]), int(raw["nbytes"]))


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES[dtype]).element_size()


class _HashingWriter:
    def __init__(self, handle):
        self.handle = handle
        self.hash = hashlib.sha256()
        self.position = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.handle.write(view)
        self.position += len(view)

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
            entry.nbytes = _element_size(entry.dtype) * _numel(entry.shape)
            position += entry.nbytes
        body["tensors"] = [e.to_json() for e in entries]
        encoded = json.dumps(body, sort_keys=True).encode()
        start = -(-(16 + len(encoded)) // 4096) * 4096
        if start <= offset_guess:
            break
        offset_guess = start
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        writer.write(_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
        for index, entry in enumerate(entries):
            writer.pad_to(entry.offset)
            tensor = read(entry)
            if tuple(tensor.shape) != entry.shape or _DTYPE_NAMES[tensor.dtype] != entry.dtype:
                raise AssertionError(f"{entry.name}/{entry.kind}: got {tuple(tensor.shape)} "
                                     f"{tensor.dtype}, expected {entry.shape} {entry.dtype}")
            writer.write(_tensor_bytes(tensor))
            if index == len(entries) // 2:
                handle.flush()
                _crash_point("shard_half_written")
        digest = writer.hash.digest()
        handle.write(_TRAILER + digest)
        handle.flush()
        os.fsync(handle.fileno())
        size = writer.position + _TRAILER_BYTES
    return size, digest.hex()


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach().contiguous().cpu()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _file_sha256(path: str, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        remaining = length
        while remaining > 0:
            block = handle.read(min(_READ_BLOCK, remaining))
            if not block:
                break
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


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
        if size < 16 + _TRAILER_BYTES:
            raise CheckpointError(f"checkpoint shard '{path}' is truncated ({size} bytes)")
        with open(path, "rb") as handle:
            head = handle.read(16)
            handle.seek(size - _TRAILER_BYTES)
            trailer = handle.read(_TRAILER_BYTES)
            if head[:8] != _MAGIC:
                raise CheckpointError(f"'{path}' is not a PatrickStar checkpoint shard")
            (header_bytes,) = struct.unpack("<Q", head[8:16])
            if trailer[:8] != _TRAILER or 16 + header_bytes > size - _TRAILER_BYTES:
                raise CheckpointError(f"checkpoint shard '{path}' is truncated (no trailer)")
            recorded = trailer[8:].hex()
            if verify:
                actual = _file_sha256(path, size - _TRAILER_BYTES)
                if actual != recorded:
                    raise CheckpointError(f"checkpoint shard '{path}' is corrupted: sha256 "
                                          f"{actual} but the shard records {recorded}")
            if expected_sha256 is not None and recorded != expected_sha256:
                raise CheckpointError(f"checkpoint shard '{path}' has sha256 {recorded} but "
                                      f"meta.json records {expected_sha256}: it belongs to "
                                      f"another checkpoint")
            handle.seek(16)
            try:
                self.header = json.loads(handle.read(header_bytes))
            except ValueError as error:
                raise CheckpointError(f"checkpoint shard '{path}': bad header ({error})") from None
        self.entries = {(e["name"], e["kind"]): Entry.from_json(e) for e in self.header["tensors"]}
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def tensor(self, entry: Entry) -> torch.Tensor:
        """A fresh CPU tensor with the entry's bytes (read with pread: no mapping of the shard
        stays resident, so memory holds one tensor at a time)."""
        dtype = _DTYPES[entry.dtype]
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


# ---- Meta --------------------------------------------------------------------------------------

def _meta_checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_meta(tag_dir: str) -> dict:
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
    if _meta_checksum(raw["body"]) != raw.get("sha256"):
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: its checksum does not "
                              f"match its contents")
    return raw["body"]


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


class CheckpointReader:
    """All shards of one checkpoint, verified, merged into one index by (name, kind)."""

    def __init__(self, load_dir: str, tag: str | None = None, verify: bool = True,
                 ranks: Iterable[int] | None = None):
        resolved = resolve_tag(load_dir, tag)
        if resolved is None:
            raise CheckpointError(f"no '{LATEST}' file in '{load_dir}' and no tag given")
        self.tag = resolved
        self.directory = os.path.join(load_dir, resolved)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory '{self.directory}' does not exist")
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
                _verify_whole_file(path, record["bytes"], record["sha256"])
                with open(path, "rb") as handle:
                    return torch.load(handle, weights_only=False)
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


def _verify_whole_file(path: str, size: int, sha256: str) -> None:
    try:
        actual_size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing") from None
    if actual_size != size:
        raise CheckpointError(f"checkpoint file '{path}' is {actual_size} bytes but meta.json "
                              f"records {size}: truncated or replaced")
    actual = _file_sha256(path, size)
    if actual != sha256:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: sha256 {actual}, "
                              f"meta.json records {sha256}")


# ---- What the engine contributes -----------------------------------------------------------------

_S = _C.TensorState


class _EngineState:
    """The engine internals a checkpoint reads and writes, in one place (engine.py changes
    should only need this class updated)."""

    def __init__(self, engine):
        self.engine = engine
        self.chunks = engine.chunks
        self.names = list(engine._names)
        self.shapes = [tuple(s) for s in engine._shapes]
        self.ids = engine._ids
        self.mixed = engine.mixed
        self.precision = engine.precision
        self.compute_dtype = _DTYPE_NAMES[engine.compute_dtype]
        self.dp = engine._dp
        self.rank, self.world_size = self.dp.rank, self.dp.world_size

    def kinds(self, index: int, optimizer_state: bool = True) -> list[str]:
        """The saved kinds of parameter `index` whose chunks this rank owns (all of them for a
        world of one; Note [Multi-rank checkpoints])."""
        ids = self.ids[index]
        kinds = ["param"]
        if ids.master is not None:
            kinds.append("master")
        if optimizer_state and ids.momentum is not None:
            kinds += ["exp_avg", "exp_avg_sq"]
        return [k for k in kinds if self.dp.owns(self.chunks.manager, self.tensor_id(index, k))]

    def entries(self) -> list[Entry]:
        entries = []
        for index, name in enumerate(self.names):
            shape = self.shapes[index]
            dtypes = {"param": self.compute_dtype}
            for kind in self.kinds(index):
                entries.append(Entry(name, kind, dtypes.get(kind, "float32"), shape))
        for name, buffer in self.buffers().items():
            entries.append(Entry(name, "buffer", _DTYPE_NAMES[buffer.dtype], tuple(buffer.shape)))
        return entries

    def owned_step_counts(self) -> dict[str, int]:
        """Adam's step count of each trainable parameter whose state this rank owns (the other
        ranks never step it, so their counts stay 0)."""
        engine = self.engine
        return {name: engine._step_count[index] for index, name in enumerate(self.names)
                if self.ids[index].momentum is not None and "exp_avg" in self.kinds(index)}

    def tensor_id(self, index: int, kind: str):
        ids = self.ids[index]
        return {"param": ids.compute, "master": ids.master, "exp_avg": ids.momentum,
                "exp_avg_sq": ids.variance}[kind]

    @contextlib.contextmanager
    def view(self, index: int, kind: str):
        tensor_id = self.tensor_id(index, kind)
        view = self.chunks.access(tensor_id, "host")
        try:
            yield view.view(self.shapes[index])
        finally:
            self.chunks.release(tensor_id, _S.HOLD)

    def buffers(self) -> dict[str, torch.Tensor]:
        engine = self.engine
        result = {}
        for name, value in engine.module.state_dict(keep_vars=True).items():
            if id(value) not in engine._param_index:
                result[name] = value.detach()
        return result

    def state_dict_keys(self) -> list[list]:
        """[key, "param", index] or [key, "buffer", key] for each key of module.state_dict()."""
        engine = self.engine
        keys = []
        for key, value in engine.module.state_dict(keep_vars=True).items():
            index = engine._param_index.get(id(value))
            keys.append([key, "param", index] if index is not None else [key, "buffer", key])
        return keys

    def tensor_table(self) -> list[dict]:
        requires = [p.requires_grad for p in self.engine._params]
        return [{"name": n, "shape": list(s), "requires_grad": r}
                for n, s, r in zip(self.names, self.shapes, requires)]

    def layout(self) -> dict:
        layout = json.loads(self.chunks.layout_json())
        layout["chunk_elements"] = self.engine.layout["chunk_elements"]
        return layout

    def counters(self) -> dict:
        engine = self.engine
        optimizer = engine.optimizer
        groups = []
        for group in optimizer.param_groups:
            saved = {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in group.items() if k != "params"}
            saved["params"] = [self.names[engine._param_index[id(p)]] for p in group["params"]]
            groups.append(saved)
        return {"iteration": engine._iteration, "micro_step": engine._micro_step,
                "step_counts": dict(zip(self.names, engine._step_count)),
                "skipped_steps": optimizer.skipped_steps,
                "loss_scaler": engine.loss_scaler.state_dict(), "param_groups": groups}

    def pending_gradients(self) -> bool:
        return any(self.engine._has_grad)


# ---- Save ----------------------------------------------------------------------------------------

def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy
        states["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy
        numpy.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _config_json(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or tag.startswith(".") or "\n" in tag:
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty file name that does not "
                         f"start with '.' and has no '/'")
    return tag


def _agree(state: _EngineState, what: str, error: BaseException | None, payload=None) -> list:
    """Shares every rank's outcome of a phase (Note [Multi-rank checkpoints]): returns every
    rank's `payload` when all succeeded, and raises on every rank when any failed, naming each
    failed rank and its error. A world of one re-raises its own error unchanged. A collective
    that fails (a peer died or stalled past the process group's timeout) is an error too."""
    if state.world_size == 1:
        if error is not None:
            raise error
        return [payload]
    message = None if error is None else f"{type(error).__name__}: {error}"
    try:
        gathered = state.dp.all_gather_object((message, payload))
    except Exception as failure:
        raise CheckpointError(
            f"{what}: rank {state.rank} of {state.world_size} could not exchange its outcome "
            f"with the other ranks (a rank died, or stalled past the collective timeout): "
            f"{type(failure).__name__}: {failure}"
            + ("" if message is None else f"; this rank had failed too: {message}")) from failure
    failed = [(rank, text) for rank, (text, _) in enumerate(gathered) if text is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} of {state.world_size} ranks: "
                              + "; ".join(f"rank {rank}: {text}" for rank, text in failed)
                              ) from error
    return [item for _, item in gathered]


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    lr_scheduler=None) -> bool:
    """Writes a checkpoint of `engine` (Note [Atomic checkpoints], Note [Multi-rank
    checkpoints]); returns True on every rank once the checkpoint is complete."""
    state = _EngineState(engine)
    rank, world_size = state.rank, state.world_size
    save_dir = os.fspath(save_dir)
    tag = _check_tag(f"global_step{engine._iteration}" if tag is None else tag)
    scheduler = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler",
                                                                       None)
    what = f"save_checkpoint('{os.path.join(save_dir, tag)}')"
    partial = None
    try:
        # Phase 1: rank 0 creates the one partial directory every rank writes into.
        error = None
        try:
            if state.pending_gradients():
                raise RuntimeError("save_checkpoint: gradients of an unfinished accumulation "
                                   "are pending and would not be saved; call it after "
                                   "optimizer.step()")
            if rank == 0:
                os.makedirs(save_dir, exist_ok=True)
                remove_stale_partials(save_dir)
                candidate = os.path.join(save_dir,
                                         f".{tag}.partial-{os.getpid()}-{next(_counter)}")
                os.mkdir(candidate)
                partial = candidate
        except Exception as failure:  # shared with every rank by _agree
            error = failure
        named = _agree(state, what, error, (tag, partial))
        tags = sorted({t for t, _ in named})
        if len(tags) != 1:
            raise CheckpointError(f"{what}: the ranks asked for different tags {tags}")
        shared_partial = named[0][1]

        # Phase 2: every rank writes and fsyncs its own shard and extra file.
        error = record = None
        try:
            entries = state.entries()
            buffers = state.buffers()
            header = {"rank": rank, "world_size": world_size}
            size, digest = write_shard(os.path.join(shared_partial, shard_name(rank)), header,
                                       entries, _make_reader(state, buffers))
            extra = {"rng": _rng_states(), "client_state": client_state or {},
                     "lr_scheduler": None if scheduler is None else scheduler.state_dict()}
            buffer = io.BytesIO()
            torch.save(extra, buffer)
            with open(os.path.join(shared_partial, extra_name(rank)), "wb") as handle:
                handle.write(buffer.getbuffer())
                handle.flush()
                os.fsync(handle.fileno())
            record = {
                "shard": {"rank": rank, "file": shard_name(rank), "bytes": size,
                          "sha256": digest},
                "extra": {"rank": rank, "file": extra_name(rank),
                          "bytes": buffer.getbuffer().nbytes,
                          "sha256": hashlib.sha256(buffer.getbuffer()).hexdigest()},
                "step_counts": state.owned_step_counts(),
            }
        except Exception as failure:
            error = failure
        records = _agree(state, what, error, record)  # also the barrier before meta.json

        # Phase 3: rank 0 writes meta.json, renames, and updates `latest` last.
        error = None
        if rank == 0:
            try:
                _publish(state, engine, save_dir, tag, shared_partial, records, scheduler,
                         save_latest)
            except Exception as failure:
                error = failure
        _agree(state, what, error)  # no rank returns before the checkpoint is complete
    finally:
        # Rank 0 created it; after an exchange it holds the previous contents of `tag`.
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
    return True


def _publish(state: _EngineState, engine, save_dir: str, tag: str, partial: str,
             records: list[dict], scheduler, save_latest: bool) -> None:
    """Rank 0's part of a save once every rank's files are durable (Note [Atomic checkpoints])."""
    for record in records:
        for item in (record["shard"], record["extra"]):
            path = os.path.join(partial, item["file"])
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                size = None
            if size != item["bytes"]:
                raise CheckpointError(
                    f"rank {item['rank']} wrote '{item['file']}' ({item['bytes']} bytes) but "
                    f"rank 0 finds {'no such file' if size is None else f'{size} bytes'} in "
                    f"'{partial}': the checkpoint directory must be on a filesystem that every "
                    f"rank shares")
    counters = state.counters()
    step_counts = {name: 0 for name in state.names}
    for record in records:
        step_counts.update(record["step_counts"])
    counters["step_counts"] = step_counts
    body = {
        "tag": tag, "world_size": state.world_size, "precision": state.precision,
        "compute_dtype": state.compute_dtype, "config": _config_json(engine.config),
        "layout": state.layout(), "tensors": state.tensor_table(),
        "state_dict_keys": state.state_dict_keys(), "engine": counters,
        "has_lr_scheduler": scheduler is not None,
        "shards": [record["shard"] for record in records],
        "extras": [record["extra"] for record in records],
        "torch_version": torch.__version__,
    }
    _crash_point("before_meta")
    _write_text_atomically(os.path.join(partial, META), json.dumps(
        {"format": FORMAT, "version": VERSION, "sha256": _meta_checksum(body),
         "body": body}, indent=1, sort_keys=True))
    _fsync_dir(partial)
    _crash_point("before_rename")
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):
        if not _exchange(partial, final):
            # No atomic exchange on this filesystem: a crash between these two renames
            # loses `tag` (but never `latest`'s target unless `latest` names `tag`).
            shutil.rmtree(final)
            os.rename(partial, final)
    else:
        os.rename(partial, final)
    _fsync_dir(save_dir)
    _crash_point("before_latest")
    if save_latest:
        _write_text_atomically(os.path.join(save_dir, LATEST), tag + "\n")
    _crash_point("after_latest")


def _make_reader(state: _EngineState, buffers: dict):
    index_of = {name: i for i, name in enumerate(state.names)}

    def read(entry: Entry) -> torch.Tensor:
        if entry.kind == "buffer":
            return buffers[entry.name]
        with state.view(index_of[entry.name], entry.kind) as view:
            return view.clone()
    return read


# ---- Load ----------------------------------------------------------------------------------------

def _differences(meta: dict, state: _EngineState, allow_reshard: bool) -> list[str]:
    problems = []
    saved = {t["name"]: tuple(t["shape"]) for t in meta["tensors"]}
    ours = dict(zip(state.names, state.shapes))
    missing = [n for n in ours if n not in saved]
    extra = [n for n in saved if n not in ours]
    if missing or extra:
        problems.append(f"other model: parameters missing from the checkpoint {missing[:5]}"
                        f"{'...' if len(missing) > 5 else ''}, parameters only in the checkpoint "
                        f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    for name, shape in ours.items():
        if name in saved and saved[name] != shape:
            problems.append(f"other model: '{name}' has shape {list(saved[name])} in the "
                            f"checkpoint but {list(shape)} in the model")
            break
    if meta["precision"] != state.precision:
        problems.append(f"other dtype: the checkpoint was written in {meta['precision']} "
                        f"({meta['compute_dtype']} compute params), the model runs in "
                        f"{state.precision} ({state.compute_dtype})")
    if not allow_reshard and not problems:
        layout = state.layout()
        saved_layout = meta["layout"]
        if saved_layout["world_size"] != layout["world_size"]:
            problems.append(f"other layout: written by {saved_layout['world_size']} rank(s), "
                            f"loading on {layout['world_size']} (pass allow_reshard=True)")
        elif saved_layout["hash"] != layout["hash"]:
            problems.append(f"other layout: chunk layout hash {saved_layout['hash']} "
                            f"({saved_layout['chunk_elements']} elements per chunk) in the "
                            f"checkpoint, {layout['hash']} ({layout['chunk_elements']} elements) "
                            f"in the model (pass allow_reshard=True to load by tensor name)")
    return problems


def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    lr_scheduler=None, load_rng_states: bool = True,
                    allow_reshard: bool = False):
    """Restores a checkpoint into `engine`; returns (path, client_state), or (None, None) when
    `load_dir` has no `latest` file and no tag was given (as DeepSpeed does). With data
    parallelism every rank calls it (Note [Multi-rank checkpoints])."""
    load_dir = os.fspath(load_dir)
    state = _EngineState(engine)
    what = f"load_checkpoint('{load_dir}')"
    # Rank 0 reads `latest`, so every rank loads the same tag even if it changes meanwhile.
    error = resolved = None
    if state.rank == 0:
        try:
            resolved = resolve_tag(load_dir, tag)
        except Exception as failure:
            error = failure
    resolved = _agree(state, what, error, resolved)[0]
    if resolved is None:
        warnings.warn(f"load_checkpoint: no '{LATEST}' file in '{load_dir}'; nothing loaded "
                      f"(pass tag= to load a specific checkpoint)", UserWarning, stacklevel=3)
        return None, None
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = load_rng_states = False
    scheduler = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler",
                                                                       None)
    what = f"load_checkpoint('{os.path.join(load_dir, resolved)}')"
    with contextlib.ExitStack() as stack:
        # Verify everything on every rank before any rank changes anything.
        error = reader = extra = None
        try:
            reader = stack.enter_context(_open_reader(state, load_dir, resolved,
                                                      allow_reshard))
            extra = _verify_loadable(state, reader, scheduler, load_optimizer_states,
                                     load_lr_scheduler_states, allow_reshard)
        except Exception as failure:
            error = failure
        _agree(state, what, error)
        error = None
        try:
            _restore(state, reader, extra, scheduler, load_optimizer_states,
                     load_lr_scheduler_states, load_rng_states)
        except Exception as failure:
            error = failure
        _agree(state, what, error)
        return reader.directory, extra.get("client_state", {})


def _open_reader(state: _EngineState, load_dir: str, tag: str,
                 allow_reshard: bool) -> CheckpointReader:
    """Every shard, or only this rank's own when the checkpoint has this model's layout and
    world size (its shard then holds exactly the tensors this rank owns)."""
    ranks = None
    directory = os.path.join(load_dir, tag)
    if state.world_size > 1 and os.path.isdir(directory):
        layout = read_meta(directory)["layout"]
        if layout.get("world_size") == state.world_size and \
                layout.get("hash") == state.layout()["hash"]:
            ranks = [state.rank]
    return CheckpointReader(load_dir, tag, ranks=ranks)


def _source_kind(reader: CheckpointReader, name: str, kind: str) -> str:
    if kind == "master" and not reader.has(name, "master"):
        return "param"  # a frozen parameter or an fp32 checkpoint
    return kind


def _verify_loadable(state: _EngineState, reader: CheckpointReader, scheduler,
                     load_optimizer_states: bool, load_lr_scheduler_states: bool,
                     allow_reshard: bool) -> dict:
    """Checks that this rank finds everything it will load; returns its extra state."""
    meta = reader.meta
    problems = _differences(meta, state, allow_reshard)
    if problems:
        raise CheckpointError(f"checkpoint '{reader.directory}' does not fit this model: "
                              + "; ".join(problems))
    counters = meta["engine"]
    optimizer = state.engine.optimizer
    if load_optimizer_states and len(counters["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint '{reader.directory}' has {len(counters['param_groups'])} "
            f"optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    for index, name in enumerate(state.names):
        for kind in state.kinds(index, load_optimizer_states):
            if not reader.has(name, _source_kind(reader, name, kind)):
                raise CheckpointError(
                    f"checkpoint '{reader.directory}' has no "
                    f"{'optimizer state' if kind.startswith('exp_avg') else kind} for "
                    f"{'trainable ' if kind.startswith('exp_avg') else ''}parameter '{name}'")
    # A rank of a larger world than the checkpoint's takes rank 0's extra state.
    rank = state.rank if reader.has_extra(state.rank) else 0
    extra = reader.extra(rank)  # verified like the shards; client_state is always returned
    if load_lr_scheduler_states and scheduler is not None and extra.get("lr_scheduler") is None:
        raise CheckpointError(f"checkpoint '{reader.directory}' has no lr scheduler state, "
                              f"but an lr_scheduler was given")
    return extra


def _restore(state: _EngineState, reader: CheckpointReader, extra: dict, scheduler,
             load_optimizer_states: bool, load_lr_scheduler_states: bool,
             load_rng_states: bool) -> None:
    engine = state.engine
    engine.zero_grad()
    engine._guard.after_step()  # a fresh step begins (Note [Training call order])
    buffers = state.buffers()
    with torch.no_grad():
        for index, name in enumerate(state.names):
            for kind in state.kinds(index, load_optimizer_states):
                source = reader.tensor(name, _source_kind(reader, name, kind))
                with state.view(index, kind) as view:
                    view.copy_(source)
                del source
        for name, buffer in buffers.items():
            if reader.has(name, "buffer"):
                buffer.copy_(reader.tensor(name, "buffer", rank=state.rank))
    # Gathered copies of other ranks' parameters predate the load.
    state.dp.after_step()
    if load_optimizer_states:
        counters = reader.meta["engine"]
        optimizer = engine.optimizer
        counts = counters["step_counts"]
        engine._step_count = [int(counts.get(name, 0)) if "exp_avg" in state.kinds(index) else 0
                              for index, name in enumerate(state.names)]
        for saved, group in zip(counters["param_groups"], optimizer.param_groups):
            group.update({k: (tuple(v) if k == "betas" else v)
                          for k, v in saved.items() if k != "params"})
        engine.loss_scaler.load_state_dict(counters["loss_scaler"])
        optimizer.skipped_steps = counters["skipped_steps"]
        engine._iteration = counters["iteration"]
        engine._micro_step = counters["micro_step"]
    if load_lr_scheduler_states and scheduler is not None:
        scheduler.load_state_dict(extra["lr_scheduler"])
    if load_rng_states:
        _set_rng_states(extra["rng"])


# ---- Layout of other world sizes ---------------------------------------------------------------

def owned_tensor_names(meta: dict, world_size: int, rank: int) -> set[tuple[str, str]]:
    """The (name, kind) entries that rank `rank` of `world_size` owns under the chunk manager's
    own multi-rank layout of this checkpoint's tensors (Note [Resharding]): the same chunk size,
    tensors registered in the same order, chunk lists padded to a multiple of `world_size`."""
    kind_of = {"param": _C.ChunkKind.COMPUTE_PARAM, "master": _C.ChunkKind.MASTER_PARAM,
               "exp_avg": _C.ChunkKind.MOMENTUM, "exp_avg_sq": _C.ChunkKind.VARIANCE}
    layout = meta["layout"]
    manager = _C.ChunkManager(tiers=[_C.HostTier(budget=1 << 20, name="host")],
                              copy_engine=_C.CopyEngine(host_threads=1), world_size=world_size,
                              rank=rank)
    kind_by_chunk = {"compute_param": "param", "master_param": "master",
                     "momentum": "exp_avg", "variance": "exp_avg_sq"}
    # Registered in the saved registration order (tensor ids); gradient chunks are not saved
    # and each kind packs into its own list, so leaving them out changes no other list.
    registered = []
    for chunk in layout["chunks"]:
        kind = kind_by_chunk.get(chunk["kind"])
        if kind is None:
            continue
        for tensor in chunk["tensors"]:
            registered.append((tensor["id"], tensor["name"].split("#")[0], kind, chunk["dtype"],
                               tensor["shape"]))
    for _, base, kind, dtype, shape in sorted(registered):
        manager.register_tensor(f"{base}#{kind}", shape, kind_of[kind], dtype)
    manager.build_chunk_lists(layout["chunk_elements"])
    owned = set()
    for chunk in json.loads(manager.layout_json())["chunks"]:
        if chunk["owner_rank"] != rank:
            continue
        for tensor in chunk["tensors"]:
            base, kind = tensor["name"].rsplit("#", 1)
            owned.add((base, kind))
    return owned
