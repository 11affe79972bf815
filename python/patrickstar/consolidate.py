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
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import zipfile

import torch

from . import dtypes
from .checkpoint import LATEST, CheckpointError, CheckpointReader
from .checkpoint.slices import saved_slices, slice_name

__all__ = ["consolidate", "main"]


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
    (key, reader, name, kind) in state_dict order."""
    sources = list(dict.fromkeys((reader, name, kind) for _, reader, name, kind in plan))
    offsets = _record_offsets(path)
    if len(offsets) != len(sources):
        raise AssertionError(f"{path}: {len(offsets)} storages for {len(sources)} tensors")
    for (reader, name, kind), (_, size) in zip(sources, offsets):
        entry = reader.entry(name, kind)
        itemsize = dtype.itemsize if kind != "buffer" else dtypes.element_size(entry.dtype)
        if size != itemsize * entry.numel:
            raise AssertionError(f"{path}: storage of {name} has {size} bytes")
    total = 0
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for (reader, name, kind), (offset, size) in zip(sources, offsets):
            tensor = reader.tensor(name, kind)
            if kind != "buffer":
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


def _stage_directories(directory: str, tag: str | None) -> list[str]:
    """The per-stage checkpoints of a pipeline's save_checkpoint (Note [One checkpoint per
    model slice] in checkpoint/slices.py), in stage order; [directory] for any other."""
    slices = saved_slices(directory)
    if not slices or os.path.exists(os.path.join(directory, LATEST)) or (
            tag is not None and os.path.isdir(os.path.join(directory, tag))):
        return [directory]
    sliced = sorted({t for _, t in slices} - {0})
    if sliced:
        raise ValueError(f"checkpoint '{directory}' holds tensor slices (pipe_SS-tensor_TT with "
                         f"tensor {sliced}): their parameters are pieces of the full tensors, "
                         "which a checkpoint does not say how to join; load it with the "
                         "layout that saved it and write tensor_parallel.gather_full_state_dict("
                         "model.module, model.state_dict()) on tensor rank 0 instead")
    stages = [p for p, _ in slices]
    if stages != list(range(len(stages))):
        raise ValueError(f"checkpoint '{directory}' has the pipeline stages {stages}, not "
                         f"0..{len(stages) - 1}: a stage's directory is missing")
    return [os.path.join(directory, slice_name(p, 0)) for p in stages]


def consolidate(checkpoint_dir, output, dtype: str = "fp32", tag: str | None = None,
                verify: bool = True) -> dict:
    """Writes `output` (atomically: a temporary name, fsync, rename); returns a summary.
    The directory of a pipeline's save_checkpoint (one pipe_SS-tensor_00 checkpoint per stage)
    gives the whole model, the keys of `PipelineModule.sequential()`: a tied weight that
    several stages hold comes from the lowest of them (the stages keep their copies equal)."""
    if dtype not in dtypes.PRECISIONS:
        raise ValueError(f"dtype must be one of {sorted(dtypes.PRECISIONS)}, got {dtype!r}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    output = os.fspath(output)
    _check_output(output)
    temp = f"{output}.tmp-{os.getpid()}"
    directories = _stage_directories(os.fspath(checkpoint_dir), tag)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(CheckpointReader(d, tag, verify=verify))
                   for d in directories]
        tags = {reader.tag for reader in readers}
        if len(tags) > 1:
            raise CheckpointError(f"the pipeline stages of '{checkpoint_dir}' have different "
                                  f"latest tags ({sorted(tags)}); give --tag")
        plan = []  # (key, reader, name, kind) in state_dict order
        seen = set()
        for reader in readers:
            names = [t["name"] for t in reader.meta["tensors"]]
            for key, what, ref in reader.meta["state_dict_keys"]:
                if key in seen:  # a tied weight of an earlier stage
                    continue
                seen.add(key)
                if what == "param":
                    name = names[ref]
                    plan.append((key, reader, name, _source_kind(reader, name, dtype)))
                else:
                    plan.append((key, reader, ref, "buffer"))
        # Fake tensors carry shape and dtype but no memory; tied keys share one fake tensor.
        with FakeTensorMode():
            fakes, by_source = {}, {}
            for key, reader, name, kind in plan:
                if (reader, name, kind) not in by_source:
                    entry = reader.entry(name, kind)
                    out_dtype = (dtypes.PRECISIONS[dtype] if kind != "buffer"
                                 else dtypes.dtype_of(entry.dtype))
                    by_source[(reader, name, kind)] = torch.empty(entry.shape, dtype=out_dtype)
                fakes[key] = by_source[(reader, name, kind)]
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
        return {"tag": readers[0].tag, "tensors": len(plan), "bytes": nbytes, "dtype": dtype,
                "output": output, "stages": len(readers)}


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
