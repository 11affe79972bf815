"""Where a model-parallel engine's checkpoint goes: one directory per pipeline stage and tensor
slice, `DIR/pipe_SS-tensor_TT`, and the check that a load finds the layout it saved.

Note [One checkpoint per model slice]
A checkpoint's shards are numbered by the data-parallel rank (Note [Multi-rank checkpoints]).
Every tensor rank and every pipeline stage is data rank 0 of its own data group, so if they all
wrote `DIR/TAG`, the slices would overwrite each other's `rank_00000.shard` and the checkpoint
would keep whichever came last: every rank then loaded that one slice, a different model,
without an error. So an engine that is one slice of the model (pipeline x tensor > 1) saves
into and loads from `DIR/pipe_SS-tensor_TT`, each a complete checkpoint of that slice (its own
`latest`), which `patrickstar-consolidate` joins into the whole model. A load checks that the
saved slices are exactly this run's (pipeline x tensor), naming both layouts, because a slice
of another layout would either miss parameters or, worse, have the same names and other values;
with allow_reshard=True another tensor size is converted (Note [Converting tensor slices at
load] in tensor_conversion.py), another pipeline size is always refused.

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

from ..tensor_slices import join_slices
from .errors import CheckpointError
from .meta import LATEST

__all__ = ["slice_name", "slice_directory", "saved_slices", "load_directories",
           "model_parallel_record", "recorded_partitions", "joined_tensor", "table_partitions"]

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
    pipes, tensors = _sizes(slices)
    return f"parallel.pipeline = {pipes}, parallel.tensor = {tensors}"


def _sizes(slices: list[tuple[int, int]]) -> tuple[int, int]:
    return max(p for p, _ in slices) + 1, max(t for _, t in slices) + 1


def table_partitions(table: list[dict]) -> dict[str, tuple[int, int]]:
    """(dim, stride) of each sliced parameter of a checkpoint's tensor table (meta.json's
    "tensors", EngineState.tensor_table)."""
    return {row["name"]: (row["partition"]["dim"], row["partition"]["stride"])
            for row in table if "partition" in row}


def recorded_partitions(readers) -> dict[str, tuple[int, int]]:
    """(dim, stride) of each sliced parameter of one pipeline stage's tensor slices
    (`readers`, CheckpointReaders in tensor-rank order; Note [Recorded tensor slices]); {} for
    a stage of one slice. Raises when a slice does not record it (saved before it was) or the
    slices disagree."""
    if len(readers) == 1:
        return {}
    partitions = None
    for rank, reader in enumerate(readers):
        record = reader.meta.get("model_parallel")
        if record is None:
            raise CheckpointError(
                f"checkpoint '{reader.directory}' is one of {len(readers)} tensor slices but was "
                "saved before PatrickStar recorded how tensor slices join (its meta.json has "
                "no 'model_parallel'): their parameters are pieces of the full tensors, which "
                "this checkpoint does not say how to join; load it with the layout that saved "
                "it (then tensor_parallel.gather_full_state_dict(model.module, "
                "model.state_dict()) gives the full tensors)")
        if record["tensor"] != len(readers) or record["tensor_rank"] != rank:
            raise CheckpointError(f"checkpoint '{reader.directory}' records tensor slice "
                                  f"{record['tensor_rank']} of {record['tensor']}, but its "
                                  f"directory is slice {rank} of {len(readers)}")
        ours = table_partitions(reader.meta["tensors"])
        if partitions is None:
            partitions = ours
        elif ours != partitions:
            raise CheckpointError(
                f"checkpoint '{reader.directory}' slices other parameters (or along other "
                f"dimensions) than '{readers[0].directory}': "
                f"{sorted(set(ours.items()) ^ set(partitions.items()))[:5]}")
    return partitions


def joined_tensor(readers, name: str, kind: str, partition: tuple[int, int]):
    """`name`'s `kind` of one pipeline stage's tensor slices (`readers` in tensor-rank order),
    joined along its recorded (dim, stride) `partition` into the whole tensor."""
    dim, stride = partition
    return join_slices([reader.tensor(name, kind) for reader in readers], dim, stride)


def load_directories(directory: str, groups, allow_reshard: bool = False
                     ) -> tuple[list[str], bool]:
    """The checkpoint directories this engine loads from and whether their tensor slices are
    converted to this engine's (Note [Converting tensor slices at load] in
    tensor_conversion.py): ([its slice_directory], False) when `directory` holds this run's
    pipeline x tensor layout (or nothing); with `allow_reshard`, the saved tensor slices of this
    engine's pipeline stage, in tensor-rank order, and True when only the tensor size differs.
    Raises, naming both layouts, for another pipeline size, or another tensor size without
    `allow_reshard`."""
    saved = saved_slices(directory)
    pipes = 1 if groups is None else groups.pipe_size
    tensors = 1 if groups is None else groups.tensor_size
    stage = 0 if groups is None else groups.coord.pipe
    ours = f"parallel.pipeline = {pipes}, parallel.tensor = {tensors}"
    whole = os.path.exists(os.path.join(directory, LATEST))  # an unsliced checkpoint's
    if saved and not whole:
        saved_pipes, saved_tensors = _sizes(saved)
        if saved != [(p, t) for p in range(saved_pipes) for t in range(saved_tensors)]:
            raise CheckpointError(f"checkpoint '{directory}' has the slices {saved}, not every "
                                  f"slice of {_layout(saved)}: a slice directory is missing")
        saved_directories = [os.path.join(directory, slice_name(stage, t))
                             for t in range(saved_tensors)]
        # (0, 0) alone: a one-stage PipelineEngine wrote its checkpoint there before slices.py.
        saved_layout = (saved_pipes, saved_tensors)
    elif whole:
        saved_layout, saved_directories = (1, 1), [directory]
    else:  # nothing saved: reported as for any
        return [slice_directory(directory, groups)], False
    if saved_layout == (pipes, tensors):
        if pipes * tensors == 1:
            return saved_directories, False
        return [slice_directory(directory, groups)], False
    saved_text = (f"parallel.pipeline = {saved_layout[0]}, parallel.tensor = "
                  f"{saved_layout[1]}")
    what = ("a checkpoint of the whole model (no pipe_SS-tensor_TT directories)"
            if saved_layout == (1, 1) else f"saved with {saved_text} (slices {saved})")
    if saved_layout[0] != pipes:
        raise CheckpointError(
            f"checkpoint '{directory}' is {what} but this run has {ours}; a checkpoint loads "
            "only under the number of pipeline stages that saved it (Note [One checkpoint "
            "per model slice] in checkpoint/slices.py)")
    if not allow_reshard:
        raise CheckpointError(
            f"checkpoint '{directory}' is {what} but this run has {ours}; pass "
            "allow_reshard=True to convert its tensor slices to this run's (Note [Converting "
            "tensor slices at load] in checkpoint/tensor_conversion.py)")
    return saved_directories, True
