"""`patrickstar-consolidate DIR OUT`: a PatrickStar checkpoint as a plain PyTorch state_dict.

Like DeepSpeed's zero_to_fp32.py, but streaming: the output is created by `torch.save` with
`torch.serialization.skip_data` over fake tensors (every storage's place in the file is fixed,
no bytes written), then each storage record is filled with pwrite, tensor by tensor, from the
shards (read with pread), so the process never holds more than one tensor (at most a chunk) of
converted data, whatever the model's size. The result is an ordinary `torch.save` file:
`model.load_state_dict(torch.load(OUT))` on the plain model (keys are `module.state_dict()`'s,
tied weights appear under each of their names and share storage).

Values: the fp32 master weights (fp32 compute weights of an fp32 run) converted to `--dtype`;
when `--dtype` is the run's own 16-bit compute dtype, the exact 16-bit weights the run computed
with. Buffers keep their saved dtype. A checkpoint of N data-parallel ranks reads every rank's
shard (each holds the tensors of the chunks that rank owned); buffers, which every rank saves
for itself, come from rank 0, as DDP broadcasts rank 0's.

The directory of a model-parallel save (one pipe_SS-tensor_TT checkpoint per pipeline stage and
tensor slice, Note [One checkpoint per model slice] in checkpoint/slices.py) gives the whole,
unsliced model: each stage's keys, a sliced parameter joined from its tensor slices as its
meta.json records (Note [Recorded tensor slices]), whole parameters and buffers from tensor
slice 0. A joined tensor is held whole while it is written (with its slices: about twice the
largest sliced tensor).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import zipfile

import torch

from . import dtypes
from .checkpoint import LATEST, CheckpointError, CheckpointReader
from .checkpoint.slices import joined_tensor, recorded_partitions, saved_slices, slice_name

__all__ = ["consolidate", "main"]


@dataclasses.dataclass(frozen=True)
class _Source:
    """One tensor of the output: `name`'s `kind` from `readers[0]`, or, with a `partition`,
    joined from the same tensor of every tensor slice (`readers` in tensor-rank order)."""
    readers: tuple
    name: str
    kind: str
    partition: tuple[int, int] | None = None  # (dim, stride)
    # A "buffer" record holding a parameter without elements: converted to --dtype (Note
    # [Saved parameters without elements] in checkpoint/engine_state.py).
    empty_param: bool = False

    def keeps_saved_dtype(self) -> bool:
        return self.kind == "buffer" and not self.empty_param

    def shape(self) -> tuple[int, ...]:
        shape = list(self.readers[0].entry(self.name, self.kind).shape)
        if self.partition is not None:
            shape[self.partition[0]] *= len(self.readers)
        return tuple(shape)

    def saved_dtype(self) -> str:
        return self.readers[0].entry(self.name, self.kind).dtype

    def tensor(self) -> torch.Tensor:
        if self.partition is None:
            return self.readers[0].tensor(self.name, self.kind)
        return joined_tensor(self.readers, self.name, self.kind, self.partition)


def _source_kind(reader: CheckpointReader, name: str, dtype: str) -> str:
    if dtypes.precision_name(reader.meta["precision"]) == dtypes.precision_name(dtype) or \
            not reader.has(name, "master"):
        return "param"
    return "master"


def _record_offsets(path: str) -> list[tuple[int, int]]:
    """(data offset, size) of each storage record of a torch.save file, by storage key."""
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    prefix = next(name for name in infos if name.endswith("/data.pkl"))[:-len("data.pkl")]
    reader = torch._C.PyTorchFileReader(path)
    offsets = []
    while f"{prefix}data/{len(offsets)}" in infos:
        record = f"data/{len(offsets)}"
        offsets.append((reader.get_record_offset(record), infos[prefix + record].file_size))
    return offsets


def _fill(path: str, plan, dtype: torch.dtype) -> int:
    """Writes each tensor's bytes at its storage record (Note in the module docstring): torch
    numbers storages in the order the pickler meets them, i.e. state_dict order, tied keys once.
    Each record's size is checked against the tensor before anything is written. `plan` is
    (key, _Source) in state_dict order."""
    sources = list(dict.fromkeys(source for _, source in plan))
    offsets = _record_offsets(path)
    if len(offsets) != len(sources):
        raise AssertionError(f"{path}: {len(offsets)} storages for {len(sources)} tensors")
    for source, (_, size) in zip(sources, offsets):
        itemsize = (dtype.itemsize if not source.keeps_saved_dtype()
                    else dtypes.element_size(source.saved_dtype()))
        if size != itemsize * math.prod(source.shape()):
            raise AssertionError(f"{path}: storage of {source.name} has {size} bytes")
    total = 0
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for source, (offset, size) in zip(sources, offsets):
            tensor = source.tensor()
            if not source.keeps_saved_dtype():
                tensor = tensor.to(dtype)
            data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
            written = 0
            while written < size:
                written += os.pwrite(fd, data[written:], offset + written)
            total += size
            del tensor, data
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def _check_output(output: str) -> None:
    """Fails before any shard is read: the rename at the end would fail only after the work."""
    if os.path.isdir(output):
        raise IsADirectoryError(f"output '{output}' is a directory; give the path of the file "
                                f"to write, e.g. '{os.path.join(output, 'model.pt')}'")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output directory '{parent}' does not exist (create it first)")


def _slice_directories(directory: str, tag: str | None) -> list[list[str]]:
    """The per-slice checkpoints of a model-parallel save (Note [One checkpoint per model
    slice] in checkpoint/slices.py), one row per pipeline stage, each row in tensor-rank order;
    [[directory]] for any other."""
    slices = saved_slices(directory)
    if not slices or os.path.exists(os.path.join(directory, LATEST)) or (
            tag is not None and os.path.isdir(os.path.join(directory, tag))):
        return [[directory]]
    pipes = max(p for p, _ in slices) + 1
    tensors = max(t for _, t in slices) + 1
    expected = [(p, t) for p in range(pipes) for t in range(tensors)]
    if slices != expected:
        missing = [slice_name(p, t) for p, t in expected if (p, t) not in slices]
        raise ValueError(f"checkpoint '{directory}' lacks the slice directories {missing} of "
                         f"its {pipes} pipeline stage(s) x {tensors} tensor slice(s)")
    return [[os.path.join(directory, slice_name(p, t)) for t in range(tensors)]
            for p in range(pipes)]


def consolidate(checkpoint_dir, output, dtype: str = "fp32", tag: str | None = None,
                verify: bool = True) -> dict:
    """Writes `output` (atomically: a temporary name, fsync, rename); returns a summary.
    The directory of a model-parallel save (one pipe_SS-tensor_TT checkpoint per stage and
    tensor slice) gives the whole, unsliced model; of a pipeline, the keys of
    `PipelineModule.sequential()`: a tied weight that several stages hold comes from the lowest
    of them (the stages keep their copies equal)."""
    if dtype not in dtypes.PRECISIONS:
        raise ValueError(f"dtype must be one of {sorted(dtypes.PRECISIONS)}, got {dtype!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    output = os.fspath(output)
    _check_output(output)
    temp = f"{output}.tmp-{os.getpid()}"
    directories = _slice_directories(os.fspath(checkpoint_dir), tag)
    with contextlib.ExitStack() as stack:
        rows = [[stack.enter_context(CheckpointReader(d, tag, verify=verify)) for d in row]
                for row in directories]
        tags = {reader.tag for row in rows for reader in row}
        if len(tags) > 1:
            raise CheckpointError(f"the slices of '{checkpoint_dir}' have different latest "
                                  f"tags ({sorted(tags)}); give --tag")
        plan = []  # (key, _Source) in state_dict order
        seen = set()
        for row in rows:
            reader = row[0]
            partitions = recorded_partitions(row)
            names = [t["name"] for t in reader.meta["tensors"]]
            # Note [Frozen parameters left out] in checkpoint/engine_state.py
            left_out = set(reader.meta.get("excluded_frozen", ()))
            for key, what, ref in reader.meta["state_dict_keys"]:
                if key in seen or (what == "param" and names[ref] in left_out):
                    continue  # a tied weight of an earlier stage, or left out
                seen.add(key)
                if what != "param":
                    plan.append((key, _Source((reader,), ref, "buffer",
                                              empty_param=what == "empty_param")))
                    continue
                name = names[ref]
                kind = _source_kind(reader, name, dtype)
                partition = partitions.get(name)
                plan.append((key, _Source(tuple(row) if partition else (reader,), name, kind,
                                          partition)))
        # Fake tensors carry shape and dtype but no memory; tied keys share one fake tensor.
        with FakeTensorMode():
            fakes, by_source = {}, {}
            for key, source in plan:
                if source not in by_source:
                    out_dtype = (dtypes.PRECISIONS[dtype] if not source.keeps_saved_dtype()
                                 else dtypes.dtype_of(source.saved_dtype()))
                    by_source[source] = torch.empty(source.shape(), dtype=out_dtype)
                fakes[key] = by_source[source]
        try:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(fakes, temp)
            del fakes, by_source
            nbytes = _fill(temp, plan, dtypes.PRECISIONS[dtype])
            os.replace(temp, output)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        return {"tag": rows[0][0].tag, "tensors": len(plan), "bytes": nbytes, "dtype": dtype,
                "output": output, "stages": len(rows), "tensor_slices": len(rows[0])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="patrickstar-consolidate",
        description="Write a PatrickStar checkpoint as a plain PyTorch state_dict file "
                    "(streaming: memory stays near one tensor).")
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint()")
    parser.add_argument("output", help="the state_dict file to write (torch.save format)")
    parser.add_argument("--dtype", choices=sorted(dtypes.PRECISIONS), default="fp32",
                        help="dtype of the weights (default fp32, from the master copy)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: DIR/latest)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the sha256 check of the shards")
    args = parser.parse_args(argv)
    try:
        summary = consolidate(args.checkpoint_dir, args.output, args.dtype, args.tag,
                              verify=not args.no_verify)
    except (CheckpointError, OSError, ValueError) as error:
        print(f"patrickstar-consolidate: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {summary['output']}: {summary['tensors']} entries, "
          f"{summary['bytes'] / 2**20:.1f} MiB ({summary['dtype']}) from tag {summary['tag']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
