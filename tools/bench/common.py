"""Shared pieces of the benchmark drivers: machine description, JSON output, and starting the
ranks of a multi-process benchmark."""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys

import torch
from torch import nn


def machine_description() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)), "kernel": platform.release()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    with open("/proc/meminfo") as handle:
        info["memory_gib"] = round(int(handle.readline().split()[1]) / 2**20, 1)
    return info


def at_least(minimum: int):
    """An argparse type: an int >= minimum, refused naming the value (a negative size failed
    deep in torch or the runtime, zero repeats divided by zero)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value
    return parse


def quick_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   argv: list[str] | None = None, **values) -> None:
    """--quick's values for the options in `values` that the command line did not give: an
    explicit `--steps 7 --quick` keeps 7 (--quick used to replace it silently)."""
    unset = object()
    saved = {name: parser.get_default(name) for name in values}
    parser.set_defaults(**{name: unset for name in values})
    try:
        given = parser.parse_args(argv)
    finally:
        parser.set_defaults(**saved)
    for name, value in values.items():
        if getattr(given, name) is unset:
            setattr(args, name, value)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    print(f"wrote {path}")


def rank_parser(description: str, out: str, part: str = "ours") -> argparse.ArgumentParser:
    """A multi-process benchmark's parser: `--out`, and the hidden arguments launch_ranks gives
    its rank processes (`--rank-process`, `--part`, `--result-file`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=out)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default=part, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    return parser


class Blocks(nn.Module):
    """The model of the block benchmarks: `layers` x (Linear(hidden, hidden), LayerNorm, tanh),
    MSE loss."""

    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden))
                                    for _ in range(layers))

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.mse_loss(x, y)


def add_block_model_arguments(parser: argparse.ArgumentParser, layers: int, hidden: int,
                              chunk_elements: int, steps: int, batch: int) -> None:
    """The options of the benchmarks that train a stack of Linear + LayerNorm blocks on gloo
    ranks (collectives.py, grad_accumulation.py), with each benchmark's defaults."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--chunk-elements", type=int, default=chunk_elements)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--gather-ahead", type=int, default=1,
                        help="parallel.gather_ahead of our run (0: gather on use)")
    parser.add_argument("--reshard", choices=["on", "off"], default="on",
                        help="parallel.reshard_after_forward of our run")
    parser.add_argument("--transport", choices=["auto", "shm", "process_group"], default="auto",
                        help="parallel.transport of our run (auto: shm, the ranks share a host)")


def parallel_config(args: argparse.Namespace) -> dict:
    """Our config's `parallel` section from add_block_model_arguments' options."""
    return {"gather_ahead": args.gather_ahead, "reshard_after_forward": args.reshard == "on",
            "transport": args.transport}


def forwarded(args: argparse.Namespace, *names: str) -> list[str]:
    """`--name value` for each named argument: the driver's options, for its rank processes."""
    result = []
    for name in names:
        result += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return result


def launch_ranks(script: str, world: int, part: str, out: str, extra: list[str]) -> list | None:
    """Runs `script --rank-process --part PART --result-file F EXTRA` as `world` gloo ranks on
    this machine (torchrun's environment variables, one OpenMP thread each) and returns what
    rank 0 wrote to F (JSON), or None when a rank failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_file = os.path.abspath(f"{out}.{part}.tmp")
    command = [sys.executable, os.path.abspath(script), "--rank-process", "--part", part,
               "--result-file", result_file, *extra]
    procs = [subprocess.Popen(command, env=dict(
        os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1")) for r in range(world)]
    if any([proc.wait() != 0 for proc in procs]):  # a list: wait for every rank
        print(f"a rank of part '{part}' failed")
        return None
    with open(result_file) as handle:
        result = json.load(handle)
    os.remove(result_file)
    return result


def finish_rank(result, result_file: str, world: int) -> None:
    """Ends a rank process of launch_ranks: gathers every rank's JSON-able `result`, rank 0
    writes them to `result_file`, and the process leaves without interpreter teardown (once in
    about ten runs a rank aborted there, "terminate called without an active exception", after
    the results were complete, while the engine's objects and gloo's threads were torn down:
    see docs/benchmarks.md)."""
    import torch.distributed as dist
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(result_file, "w") as handle:
            json.dump(gathered, handle)
    dist.barrier()  # rank 0 has written the results
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def deepspeed_importable() -> bool:
    """Whether `import deepspeed` works here with its CPU accelerator (not a project
    dependency; tools/bench/grad_accumulation.py says how it was installed)."""
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return probe.returncode == 0
