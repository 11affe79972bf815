"""Gradient accumulation with data parallelism: communication per optimizer step, ours against
DeepSpeed ZeRO-3, on 2 gloo ranks of this machine (issue 8).

    python tools/bench/grad_accumulation.py [--layers 100] [--hidden 128] [--accumulation 4]

The model has `layers` blocks of Linear(hidden, hidden) + LayerNorm(hidden): 4 small tensors a
block. Each contender trains with `accumulation` micro-steps per optimizer step, fp32, Adam, the
same micro-batches; per optimizer step we report the collectives issued (by kind), the bytes they
move (a collective's whole group: an allgather's output, a reduce-scatter's input, an
all-reduce's buffer, per rank) and the wall time (median over steps after a warm-up step).

  * ours: patrickstar.initialize, chunk-granular data parallelism. Gathered groups are kept
    until the step, so only the first micro-step gathers; gradients accumulate in their chunks
    and each gradient group is reduce-scattered once, at the accumulation boundary.
  * deepspeed: DeepSpeed ZeRO stage 3 (CPU accelerator, gloo), when it is importable: it gathers
    parameters in forward and again in backward and reduce-scatters gradients on every
    micro-step. Its collectives are counted by wrapping torch.distributed's functions.
  * zero3_pattern: when DeepSpeed is missing, the ZeRO-3 pattern over our own group sizes through
    torch.distributed (an allgather of every compute group in forward and in backward and a
    reduce-scatter of every gradient group, each micro-step), communication only.

The script starts its two ranks itself and rank 0 writes the JSON.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, write_json  # noqa: E402

WORLD = 2

# torch.distributed entry points a ZeRO implementation may use, and which argument holds the
# group's bytes (the larger side of an allgather / reduce-scatter).
_COUNTED = {"all_gather_into_tensor": ("allgather", 0), "_all_gather_base": ("allgather", 0),
            "all_gather": ("allgather", 0), "reduce_scatter_tensor": ("reduce_scatter", 1),
            "_reduce_scatter_base": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
            "all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0),
            "all_to_all_single": ("all_to_all", 1)}


class Counter:
    """Counts torch.distributed collectives and their group bytes (installed before DeepSpeed
    binds the functions)."""

    def __init__(self):
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.enabled = False

    def install(self) -> None:
        import torch.distributed.distributed_c10d as c10d
        for name, (kind, arg) in _COUNTED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, kind, arg)
            setattr(dist, name, wrapped)
            if hasattr(c10d, name):
                setattr(c10d, name, wrapped)

    def _wrap(self, original, kind, arg):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.enabled:
                value = args[arg] if len(args) > arg else next(iter(kwargs.values()))
                tensors = value if isinstance(value, (list, tuple)) else [value]
                self.calls[kind] += 1
                self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
            return original(*args, **kwargs)
        return counted


class Blocks(nn.Module):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden))
                                    for _ in range(layers))

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.mse_loss(x, y)


def micro_batches(args, rank: int):
    generator = torch.Generator().manual_seed(1000 + rank)
    batch = args.batch // WORLD
    return [(torch.randn(batch, args.hidden, generator=generator),
             torch.randn(batch, args.hidden, generator=generator))
            for _ in range(args.accumulation)]


def timed_steps(step, steps: int) -> list[float]:
    step()  # warm-up: connections, allocations, the chunk manager's trace
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def run_ours(args, rank: int) -> dict:
    import patrickstar
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: Blocks(args.layers, args.hidden),
        config={"default_chunk_size": args.chunk_elements,
                "gradient_accumulation_steps": args.accumulation,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    batches = micro_batches(args, rank)
    collectives = model._dp.collectives
    per_micro = []

    def step():
        for x, y in batches:
            issued = collectives.collectives_issued
            model.backward(model(x, y))
            per_micro.append(collectives.collectives_issued - issued)
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up outside the counts
    per_micro.clear()
    issued, moved = collectives.collectives_issued, collectives.bytes_communicated
    times = timed_steps(step, args.steps)
    steps = args.steps + 1  # timed_steps' own warm-up step is counted too
    compute_groups = len(model._dp._compute_groups)
    grad_groups = len(model._dp._grad_groups)
    return {"step_seconds": statistics.median(times),
            "collectives_per_step": (collectives.collectives_issued - issued) / steps,
            "bytes_per_step": (collectives.bytes_communicated - moved) / steps,
            "collectives_per_micro_step": per_micro[:args.accumulation],
            "compute_groups": compute_groups, "grad_groups": grad_groups,
            # Not in the counts above: one all-reduce of per-parameter flags per boundary.
            "small_all_reduces_per_step": 1,
            "chunk_elements": model.layout["chunk_elements"]}


def run_deepspeed(args, rank: int, counter: Counter) -> dict:
    import deepspeed
    torch.manual_seed(0)
    model = Blocks(args.layers, args.hidden)
    config = {"train_micro_batch_size_per_gpu": args.batch // WORLD,
              "gradient_accumulation_steps": args.accumulation,
              "zero_optimization": {"stage": 3, "contiguous_gradients": True,
                                    "overlap_comm": False,
                                    "reduce_bucket_size": args.chunk_elements,
                                    "stage3_prefetch_bucket_size": args.chunk_elements,
                                    "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
              "wall_clock_breakdown": False}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batches = micro_batches(args, rank)

    def step():
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only

    step()
    counter.calls.clear()
    counter.bytes.clear()
    counter.enabled = True
    times = timed_steps(step, args.steps)
    counter.enabled = False
    steps = args.steps + 1
    # dist.barrier() in timed_steps is not a counted function.
    return {"step_seconds": statistics.median(times),
            "collectives_per_step": sum(counter.calls.values()) / steps,
            "bytes_per_step": sum(counter.bytes.values()) / steps,
            "by_kind": {kind: {"collectives_per_step": counter.calls[kind] / steps,
                               "bytes_per_step": counter.bytes[kind] / steps}
                        for kind in counter.calls},
            "deepspeed": deepspeed.__version__}


def run_zero3_pattern(args, rank: int) -> dict:
    """The ZeRO-3 pattern over our group sizes: per micro-step, an allgather of every compute
    group in forward and again in backward, and a reduce-scatter of every gradient group."""
    from patrickstar import _C
    manager = _C.ChunkManager(tiers=[_C.HostTier(budget=0, name="host", pinned=False)],
                              copy_engine=_C.CopyEngine(host_threads=1), world_size=WORLD,
                              rank=rank)
    model = Blocks(args.layers, args.hidden)
    for i, p in enumerate(model.parameters()):
        manager.register_tensor(f"p{i}", list(p.shape), _C.ChunkKind.COMPUTE_PARAM, "float32")
    for i, p in enumerate(model.parameters()):
        manager.register_tensor(f"p{i}#g", list(p.shape), _C.ChunkKind.GRADIENT, "float32")
    layout = manager.build_chunk_lists(args.chunk_elements)
    groups = layout["num_chunks"] // 2 // WORLD
    chunk = layout["chunk_elements"]
    shard, full = torch.randn(chunk), torch.empty(chunk * WORLD)
    grad = torch.randn(chunk * WORLD)
    calls = collections.Counter()

    def step():
        for _ in range(args.accumulation):
            for _ in range(2 * groups):  # forward and backward gathers
                dist.all_gather_into_tensor(full, shard)
                calls["allgather"] += 1
            for _ in range(groups):
                dist.reduce_scatter_tensor(shard, grad)
                calls["reduce_scatter"] += 1

    step()
    calls.clear()
    times = timed_steps(step, args.steps)
    steps = args.steps + 1
    group_bytes = chunk * WORLD * 4
    return {"step_seconds": statistics.median(times),
            "collectives_per_step": sum(calls.values()) / steps,
            "bytes_per_step": sum(calls.values()) * group_bytes / steps,
            "communication_only": True}


def run_rank(args) -> None:
    rank = int(os.environ["RANK"])
    # torch 2.13 deprecates the *_into_tensor / *_tensor names DeepSpeed calls, on every call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    counter = Counter()
    if args.part == "deepspeed":
        counter.install()
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks share the cores
    if args.part == "ours":
        result = run_ours(args, rank)
    elif args.part == "deepspeed":
        result = run_deepspeed(args, rank, counter)
    else:
        result = run_zero3_pattern(args, rank)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(args.result_file, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def launch(args, part: str) -> list[dict] | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_file = os.path.abspath(f"{args.out}.{part}.tmp")
    command = [sys.executable, os.path.abspath(__file__), "--rank-process", "--part", part,
               "--result-file", result_file, "--layers", str(args.layers), "--hidden",
               str(args.hidden), "--chunk-elements", str(args.chunk_elements), "--steps",
               str(args.steps), "--batch", str(args.batch), "--accumulation",
               str(args.accumulation)]
    procs = [subprocess.Popen(command, env=dict(
        os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1")) for r in range(WORLD)]
    failed = [proc.wait() != 0 for proc in procs]
    if any(failed):
        print(f"a rank of part '{part}' failed")
        return None
    with open(result_file) as handle:
        result = json.load(handle)
    os.remove(result_file)
    return result


def deepspeed_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return probe.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk-elements", type=int, default=1 << 18)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default="bench-results/grad_accumulation.json")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    ours = launch(args, "ours")
    if ours is None:
        raise SystemExit("our run failed")
    baseline_name = "deepspeed" if deepspeed_importable() else "zero3_pattern"
    baseline = launch(args, baseline_name)
    if baseline is None and baseline_name == "deepspeed":
        baseline_name = "zero3_pattern"
        baseline = launch(args, baseline_name)
    if baseline is None:
        raise SystemExit("the baseline failed")
    o, b = ours[0], baseline[0]
    ratios = {key: b[key] / o[key] if o[key] else None
              for key in ("collectives_per_step", "bytes_per_step", "step_seconds")}
    payload = {"machine": machine_description(), "config": vars(args), "baseline": baseline_name,
               "ours": ours, baseline_name: baseline, "baseline_over_ours": ratios}
    print(f"{args.layers} blocks of Linear({args.hidden}) + LayerNorm, 2 gloo ranks, "
          f"accumulation {args.accumulation}; per optimizer step, rank 0:")
    for name, r in (("ours", o), (baseline_name, b)):
        print(f"  {name:14s} {r['collectives_per_step']:7.1f} collectives "
              f"{r['bytes_per_step'] / 2**20:8.1f} MiB {r['step_seconds'] * 1e3:8.1f} ms")
    print("  baseline / ours: " + ", ".join(
        f"{key} {value:.2f}x" for key, value in ratios.items() if value is not None))
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
