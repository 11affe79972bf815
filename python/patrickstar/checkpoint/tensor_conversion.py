"""A checkpoint of one tensor-parallel size loaded under another: the saved slices of a pipeline
stage read as one checkpoint of this engine's slice.

Note [Converting tensor slices at load]
With allow_reshard=True, `load_checkpoint` loads the tensor slices of another `parallel.tensor`
(the same pipeline stages) into this engine: `ConvertedSlices` opens every saved slice of this
engine's stage and presents them through CheckpointReader's interface, so the engine's own
verification and restore run unchanged. A parameter the checkpoint records as sliced (Note
[Recorded tensor slices] in slices.py) is joined from every saved slice; one this engine slices
(its `partition_dim` / `partition_stride`) is then split to this rank's piece. The same holds
for its master copy and Adam moments, which are elementwise, so a converted run continues as the
saved one would have. Whole parameters, buffers, counters and the tensor table come from saved
slice 0 (every slice holds the same), RNG and client state from the saved slice of this tensor
rank (slice 0 when there is none). 8-bit moments of a joined or split parameter go through fp32:
their scales cover blocks of the saved slice's flattened tensor, which no other slicing keeps, so
each saved slice is dequantized with its own scales, the values joined and split, and the
engine's restore quantizes this rank's piece in its own blocks (as it quantizes an fp32
checkpoint's moments: Note [Blockwise quantization]). Such a moment is therefore within about
half a code step of its saved value, not bit-identical (a block's new absmax moves its codes);
parameters that are neither joined nor split keep their codes and scales. The meta.json seen by
the engine is slice 0's with each tensor's shape as this engine's slice of it, so a model that
differs still fails verification by name.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from .. import moment_state
from ..tensor_slices import join_slices, split_tensor
from .slices import recorded_partitions

__all__ = ["ConvertedSlices"]

_SCALE_KINDS = {moment_state.scale_key(key) for key in moment_state.MOMENT_KEYS}


class ConvertedSlices:
    """The saved tensor slices `readers` (one pipeline stage's, in tensor-rank order) as one
    checkpoint of tensor rank `tensor_rank` of `tensor_size` whose sliced parameters are
    `targets` (name: (dim, stride)); closes the readers."""

    def __init__(self, readers: list, targets: dict[str, tuple[int, int]], tensor_size: int,
                 tensor_rank: int):
        self.readers = readers
        first = readers[0]
        self.tag = first.tag
        self.directory = first.directory
        self.saved = recorded_partitions(readers)
        self.targets = targets
        self.size, self.rank = tensor_size, tensor_rank
        self.meta = copy.deepcopy(first.meta)
        for table in self.meta["tensors"]:
            table["shape"] = list(self._shape(table["name"], table["shape"]))
        extra_index = tensor_rank if tensor_rank < len(readers) else 0
        self._extra_reader = readers[extra_index]

    def _shape(self, name: str, shape) -> tuple[int, ...]:
        shape = list(shape)
        if name in self.saved:
            shape[self.saved[name][0]] *= len(self.readers)
        if name in self.targets:
            dim = self.targets[name][0]
            if shape[dim] % self.size:
                return tuple(shape)  # verification names the shapes
            shape[dim] //= self.size
        return tuple(shape)

    def _converted(self, name: str) -> bool:
        return name in self.saved or name in self.targets

    def _dequantized(self, name: str, kind: str) -> bool:
        """Whether `kind` of `name` is an 8-bit moment that this conversion reads as fp32."""
        return (kind in moment_state.MOMENT_KEYS and self._converted(name)
                and self.readers[0].has(name, moment_state.scale_key(kind)))

    def has(self, name: str, kind: str) -> bool:
        if kind in _SCALE_KINDS and self._converted(name):
            return False  # its moment is read as fp32
        return self.readers[0].has(name, kind)

    def entry(self, name: str, kind: str):
        entry = self.readers[0].entry(name, kind)
        if self._dequantized(name, kind):
            return dataclasses.replace(entry, dtype="float32")
        return entry

    def _part(self, reader, name: str, kind: str) -> torch.Tensor:
        """`kind` of `name` in one saved slice, 8-bit moments as their fp32 values."""
        if self._dequantized(name, kind):
            return moment_state.dequantize_moment(
                kind, reader.tensor(name, kind),
                reader.tensor(name, moment_state.scale_key(kind)))
        return reader.tensor(name, kind)

    def tensor(self, name: str, kind: str, rank: int | None = None) -> torch.Tensor:
        if kind == "buffer" or not self._converted(name):
            return self.readers[0].tensor(name, kind, rank)
        if name in self.saved:
            dim, stride = self.saved[name]
            full = join_slices([self._part(reader, name, kind) for reader in self.readers],
                               dim, stride)
        else:
            full = self._part(self.readers[0], name, kind)
        if name in self.targets:
            dim, stride = self.targets[name]
            full = split_tensor(full, dim, self.size, self.rank, stride)
        return full.contiguous()

    def has_extra(self, rank: int) -> bool:
        return self._extra_reader.has_extra(rank)

    def extra(self, rank: int) -> dict:
        return self._extra_reader.extra(rank)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
