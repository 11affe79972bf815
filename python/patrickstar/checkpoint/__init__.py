"""Checkpoints: `model.save_checkpoint(dir, tag)` / `model.load_checkpoint(dir, tag)`.

One concept per module:
    atomic_files.py   durable, atomic filesystem operations (Note [Atomic checkpoints])
    shard.py          the shard file format, writing and reading one (Note [Shard format])
    meta.py           meta.json and `latest`
    reader.py         CheckpointReader: every shard of a checkpoint merged by (name, kind)
    engine_state.py   what an engine saves and restores, through its public objects
    resharding.py     the tensors a rank of another world size owns (Note [Resharding])
    extra_state.py    the per-rank extra file, read without pickle (Note [Checkpoints are
                      data])
    protocol.py       save_checkpoint / load_checkpoint on every rank (Note [Multi-rank
                      checkpoints])
    slices.py         one checkpoint per pipeline stage and tensor slice, and what it records
                      of the slicing (Note [One checkpoint per model slice], Note [Recorded
                      tensor slices])
    tensor_conversion.py  another tensor-parallel size's slices read as this engine's (Note
                      [Converting tensor slices at load])

On disk (one directory per tag, DeepSpeed's layout of a `latest` file beside tag directories):

    DIR/latest                        the tag of the newest complete checkpoint (written last)
    DIR/TAG/meta.json                 format, config, precision, chunk layout, tensor table,
                                      engine counters, the shards with their sizes and sha256
    DIR/TAG/rank_00000.shard          rank 0's tensors (see Note [Shard format])
    DIR/TAG/rank_00000_extra.pt       rank 0's RNG states, client_state, lr scheduler state

Note [Atomic checkpoints]
A checkpoint is written into a hidden temporary directory `DIR/.TAG.partial-<pid>-<token>`; every
file is fsync'd, then the directory, then it is renamed to `DIR/TAG` (exchanged atomically with
an existing `DIR/TAG` by renameat2(RENAME_EXCHANGE), then the old one removed), `DIR` is
fsync'd, and only then is `latest` replaced (temporary file, fsync, rename, fsync of `DIR`).
A crash at any point therefore leaves `latest` naming a complete, verified checkpoint: either
the previous one or the new one. Partial directories no live writer holds locked are removed
by the next save (Note [Partial directory ownership] in atomic_files.py). Every shard ends with a sha256 of everything before it, and meta.json records each file's
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
(the engine's `dp.owns`; `owned_tensor_names()` computes the same set from a checkpoint's
meta.json alone, with the chunk manager's own multi-rank layout). Loading a checkpoint whose
world size or layout differs from the model's is refused unless `allow_reshard=True`, so a
silent change of chunk size is never mistaken for the same run. A rank that loads its own
layout opens (and verifies) only its own shard; a resharding load opens every shard.

Note [Multi-rank checkpoints]
Every rank calls save_checkpoint / load_checkpoint at the same point. A save runs in three
phases, each ended by one all_gather_object over the data group (`_agree`) that
carries every rank's outcome, so an error on one rank (a full disk, pending gradients) is
raised on every rank, naming the rank and its error, and no rank waits on a peer that gave up:
  1. rank 0 removes dead writers' partial directories and creates `DIR/.TAG.partial-<pid>-<token>`
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

from . import shard
from .. import _upstream
from .atomic_files import remove_stale_partials
from .engine_state import SAVED_KINDS, EngineState
from .errors import CheckpointError
from .meta import FORMAT, LATEST, META, VERSION, meta_checksum, read_meta, resolve_tag
from .protocol import load_checkpoint, save_checkpoint
from .reader import CheckpointReader
from .resharding import owned_tensor_names
from .shard import Entry, Shard, extra_name, shard_name, write_shard

__all__ = ["CheckpointError", "CheckpointReader", "EngineState", "Entry", "FORMAT", "LATEST",
           "META", "SAVED_KINDS", "Shard", "VERSION", "extra_name", "load_checkpoint",
           "meta_checksum", "owned_tensor_names", "read_meta", "remove_stale_partials",
           "resolve_tag", "save_checkpoint", "shard", "shard_name", "write_shard"]


def __getattr__(name: str):
    # Upstream's patrickstar.checkpoint held activation checkpointing (checkpoint,
    # checkpoint_sequential): those names say what to use instead (_upstream.py).
    return _upstream.missing_name(__name__, name)
