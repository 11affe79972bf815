"""Where a model-parallel engine's checkpoint goes: one directory per pipeline stage and tensor
slice, `DIR/pipe_SS-tensor_TT`, and the check that a load finds the layout it saved.

Note [One checkpoint per model slice]
A checkpoint's shards are numbered by the data-parallel rank (Note [Multi-rank checkpoints]).
Every tensor rank and every pipeline stage is data rank 0 of its own data group, so if they all
wrote `DIR/TAG`, the slices would overwrite each other's `rank_00000.shard` and the checkpoint
would keep whichever came last: every rank then loaded that one slice, a different model,
without an error. So an engine that is one slice of the model (pipeline x tensor > 1) saves
into and loads from `DIR/pipe_SS-tensor_TT`, each a complete checkpoint of that slice (its own
`latest`), which `patrickstar-consolidate` also reads one at a time. A load checks that the
saved slices are exactly this run's (pipeline x tensor), naming both layouts, because a slice
of another layout would either miss parameters or, worse, have the same names and other values.

Note [Recorded tensor slices]
A tensor slice's parameters are pieces of the full tensors, and how the pieces join (the
dimension, column- or row-parallel, and the stride of a fused weight, Note [Strided slices] in
tensor_parallel.py) is known only to the model's layers. So meta.json records it: the tensor
table gives a sliced parameter `"partition": {"dim", "stride"}` (a parameter without it is whole
and the same on every tensor rank: a row-parallel bias, a norm, a buffer), and the body's
`model_parallel` gives the slice's place, `{"pipeline", "stage", "tensor", "tensor_rank"}`
(sizes and this slice's coordinates; 1, 0, 1, 0 for an unsliced engine). With these,
`patrickstar-consolidate` joins the slices into the full tensors. A checkpoint written before
they were recorded has no `model_parallel`: its pipeline stages still consolidate (they hold
whole tensors), its tensor slices are refused, since nothing says how they join.
"""
from __future__ import annotations

import os
import re

from .errors import CheckpointError
from .meta import LATEST

__all__ = ["slice_name", "slice_directory", "saved_slices", "load_directory",
           "model_parallel_record"]

_SLICE = re.compile(r"pipe_(\d+)-tensor_(\d+)")


def slice_name(pipe: int, tensor: int) -> str:
    """The directory name of one slice's checkpoint (what _SLICE matches)."""
    return f"pipe_{pipe:02d}-tensor_{tensor:02d}"


def slice_directory(directory: str, groups) -> str:
    """`directory` itself for an unsliced engine (`groups` None or pipeline x tensor == 1),
    else its `pipe_SS-tensor_TT` subdirectory (Note [One checkpoint per model slice])."""
    if groups is None or groups.pipe_size * groups.tensor_size == 1:
        return directory
    coord = groups.coord
    return os.path.join(directory, slice_name(coord.pipe, coord.tensor))


def model_parallel_record(groups) -> dict:
    """meta.json's `model_parallel` (Note [Recorded tensor slices])."""
    if groups is None:
        return {"pipeline": 1, "stage": 0, "tensor": 1, "tensor_rank": 0}
    return {"pipeline": groups.pipe_size, "stage": groups.coord.pipe,
            "tensor": groups.tensor_size, "tensor_rank": groups.coord.tensor}


def saved_slices(directory: str) -> list[tuple[int, int]]:
    """The (pipe, tensor) slices saved under `directory`, sorted; [] when none."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _SLICE.fullmatch(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append((int(match.group(1)), int(match.group(2))))
    return sorted(found)


def _layout(slices: list[tuple[int, int]]) -> str:
    pipes = max(p for p, _ in slices) + 1
    tensors = max(t for _, t in slices) + 1
    return f"parallel.pipeline = {pipes}, parallel.tensor = {tensors}"


def load_directory(directory: str, groups) -> str:
    """The directory this engine loads from: its slice's (slice_directory). Raises when
    `directory` holds slices of another pipeline x tensor layout than `groups`' (or slices while
    this engine is unsliced, or none while it is sliced but `directory` is an unsliced
    checkpoint)."""
    saved = saved_slices(directory)
    pipes = 1 if groups is None else groups.pipe_size
    tensors = 1 if groups is None else groups.tensor_size
    whole = os.path.exists(os.path.join(directory, LATEST))  # an unsliced checkpoint's
    if pipes * tensors == 1:
        if saved == [(0, 0)] and not whole:
            # A one-stage PipelineEngine wrote its checkpoint there before slices.py.
            return os.path.join(directory, slice_name(0, 0))
        if saved and not whole:
            raise CheckpointError(
                f"checkpoint '{directory}' holds one checkpoint per model slice "
                f"({', '.join(slice_name(p, t) for p, t in saved)}: saved with "
                f"{_layout(saved)}) but this run has no pipeline stages or tensor slices; load "
                "it with the layout that saved it (Note [One checkpoint per model slice] in "
                "checkpoint/slices.py)")
        return directory
    expected = [(p, t) for p in range(pipes) for t in range(tensors)]
    if not saved:
        if whole:
            raise CheckpointError(
                f"checkpoint '{directory}' is a checkpoint of the whole model (no pipe_SS-"
                f"tensor_TT directories) but this run has parallel.pipeline = {pipes}, "
                f"parallel.tensor = {tensors}; load it with the layout that saved it")
        return slice_directory(directory, groups)  # nothing saved: reported as for any
    if saved != expected:
        raise CheckpointError(
            f"checkpoint '{directory}' was saved with {_layout(saved)} (slices {saved}) but "
            f"this run has parallel.pipeline = {pipes}, parallel.tensor = {tensors}; a "
            "checkpoint of model slices loads only under the layout that saved it")
    return slice_directory(directory, groups)
