"""Gradient accumulation with data parallelism: communication per optimizer step, ours against
ZeRO-3 (DeepSpeed when importable, PyTorch FSDP2 always), on 2 gloo ranks of this machine
(issue 8).

    python tools/bench/grad_accumulation.py [--layers 100] [--hidden 128] [--accumulation 4]

The model has `layers` blocks of Linear(hidden, hidden) + LayerNorm(hidden): 4 small tensors a
block. Each contender trains with `accumulation` micro-steps per optimizer step, fp32, Adam, the
same micro-batches; per optimizer step we report the collectives issued (by kind), the bytes they
move (a collective's whole group: an allgather's output, a reduce-scatter's input, an
all-reduce's buffer, per rank) and the wall time (median over the timed steps, after a warm-up
step). Every contender computes the same forward, backward and Adam update.

  * ours: patrickstar.initialize, chunk-granular data parallelism with
    `parallel.gradient_accumulation` "full": gradients accumulate in their full-size chunks and
    each gradient group is reduce-scattered once, at the accumulation boundary. With
    `--reshard off` gathered groups are kept until the step, so only the first micro-step
    gathers; with `--reshard on` (the runtime's default) every micro-step gathers in forward and
    backward, as ZeRO-3 does.
  * ours_sharded: the same with "sharded" (the runtime's default): a reduce-scatter into the
    owner's shard every micro-step, as ZeRO-3 and FSDP2 do (gradients 1/N per rank between
    micro-steps). The ratios are against "ours".
  * deepspeed: DeepSpeed ZeRO stage 3 (CPU accelerator, gloo), only when `import deepspeed`
    works (it is not a project dependency: e.g. `pip install --target DIR deepspeed einops
    hjson msgpack ninja psutil py-cpuinfo` and PYTHONPATH=DIR): it gathers parameters in forward
    (again in backward when they were released) and reduce-scatters gradients on every
    micro-step.
  * fsdp2: PyTorch FSDP2 (`fully_shard` per block and on the root, CPU, gloo) with its defaults,
    the ZeRO-3 pattern: parameters gathered in forward, freed, gathered again in backward, and
    gradients reduce-scattered on every micro-step.
  * fsdp2_no_sync: the same with `set_requires_gradient_sync(False)` on the micro-steps before
    the boundary (FSDP2's own accumulation mode): one reduce-scatter per boundary, but every
    rank keeps whole unsharded gradients between boundaries, and parameters are still gathered
    twice per micro-step.

The baselines' collectives are counted by wrapping torch.distributed's functions before the
library binds them. The script starts its two ranks itself and rank 0 writes the JSON.
"""
from __future__ import annotations

import collections
import functools
import os
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Blocks, add_block_model_arguments, deepspeed_importable,  # noqa: E402
                    finish_rank, forwarded, launch_ranks, machine_description,
                    parallel_config, rank_parser, write_json)

WORLD = 2

# torch.distributed entry points a ZeRO implementation may use, and which argument (position,
# keyword) holds the group's bytes: the larger side of an allgather / reduce-scatter. FSDP2 calls
# the *_single names, DeepSpeed the *_tensor ones.
_COUNTED = {"all_gather_into_tensor": ("allgather", 0, "output_tensor"),
            "_all_gather_base": ("allgather", 0, "output_tensor"),
            "all_gather_single": ("allgather", 0, "output_tensor"),
            "all_gather": ("allgather", 0, "tensor_list"),
            "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
            "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
            "reduce_scatter_single": ("reduce_scatter", 1, "input"),
            "reduce_scatter": ("reduce_scatter", 1, "input_list"),
            "all_reduce": ("all_reduce", 0, "tensor"), "broadcast": ("broadcast", 0, "tensor"),
            "all_to_all_single": ("all_to_all", 1, "input")}


class Counter:
    """Counts torch.distributed collectives and their group bytes (installed before DeepSpeed
    binds the functions)."""

    def __init__(self):
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.enabled = False
        # torch 2.13's deprecated all_gather_into_tensor / reduce_scatter_tensor call the *_single
        # functions through the module: count the outermost call only.
        self._inside = threading.local()

    def install(self) -> None:
        import torch.distributed.distributed_c10d as c10d
        for name, (kind, arg, keyword) in _COUNTED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(original, kind, arg, keyword)
            setattr(dist, name, wrapped)
            if hasattr(c10d, name):
                setattr(c10d, name, wrapped)

    def _wrap(self, original, kind, arg, keyword):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            outermost = not getattr(self._inside, "active", False)
            if self.enabled and outermost:
                value = args[arg] if len(args) > arg else kwargs[keyword]
                tensors = value if isinstance(value, (list, tuple)) else [value]
                self.calls[kind] += 1
                self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
            self._inside.active = True
            try:
                return original(*args, **kwargs)
            finally:
                if outermost:
                    self._inside.active = False
        return counted


def micro_batches(args, rank: int):
    generator = torch.Generator().manual_seed(1000 + rank)
    batch = args.batch // WORLD
    return [(torch.randn(batch, args.hidden, generator=generator),
             torch.randn(batch, args.hidden, generator=generator))
            for _ in range(args.accumulation)]


def timed_steps(step, steps: int) -> dict:
    """Median wall and CPU (this process, all threads) seconds per step, after a warm-up step.
    CPU time is less sensitive than wall time to other processes on a shared machine."""
    step()  # warm-up: connections, allocations, the chunk manager's trace
    wall, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"step_seconds": statistics.median(wall), "step_cpu_seconds": statistics.median(cpu)}


def run_ours(args, rank: int, accumulation_mode: str) -> dict:
    import patrickstar
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: Blocks(args.layers, args.hidden),
        config={"default_chunk_size": args.chunk_elements,
                "parallel": {**parallel_config(args),
                             "gradient_accumulation": accumulation_mode},
                "gradient_accumulation_steps": args.accumulation,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    batches = micro_batches(args, rank)
    collectives = model.dp  # both of its process groups' chunk collectives
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
    compute_groups = model.dp.compute_group_count
    grad_groups = model.dp.grad_group_count
    return {**times,
            "collectives_per_step": (collectives.collectives_issued - issued) / steps,
            "bytes_per_step": (collectives.bytes_communicated - moved) / steps,
            "collectives_per_micro_step": per_micro[:args.accumulation],
            "compute_groups": compute_groups, "grad_groups": grad_groups,
            "gather_ahead": args.gather_ahead, "reshard": args.reshard,
            "gradient_accumulation": accumulation_mode,
            "gathers_started_ahead_per_step": model.dp.gathers_ahead / (steps + 1),
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

    return dict(counted_run(step, args, counter), deepspeed=deepspeed.__version__)


def run_fsdp2(args, rank: int, counter: Counter, no_sync: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = Blocks(args.layers, args.hidden)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = micro_batches(args, rank)

    def step():
        for micro, (x, y) in enumerate(batches):
            if no_sync:
                model.set_requires_gradient_sync(micro + 1 == len(batches))
            (model(x, y) / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return counted_run(step, args, counter)


def counted_run(step, args, counter: Counter) -> dict:
    step()  # warm-up outside the counts
    counter.calls.clear()
    counter.bytes.clear()
    counter.enabled = True
    times = timed_steps(step, args.steps)
    counter.enabled = False
    steps = args.steps + 1  # timed_steps' own warm-up step is counted too
    # dist.barrier() in timed_steps is not a counted function.
    return {**times,
            "collectives_per_step": sum(counter.calls.values()) / steps,
            "bytes_per_step": sum(counter.bytes.values()) / steps,
            "by_kind": {kind: {"collectives_per_step": counter.calls[kind] / steps,
                               "bytes_per_step": counter.bytes[kind] / steps}
                        for kind in counter.calls}}


def run_rank(args) -> None:
    rank = int(os.environ["RANK"])
    # torch 2.13 deprecates the *_into_tensor / *_tensor names DeepSpeed calls, on every call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    counter = Counter()
    if not args.part.startswith("ours"):
        counter.install()
    if args.part == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks share the cores
    if args.part == "ours":  # parallel.gradient_accumulation "full": the mode compared here
        result = run_ours(args, rank, "full")
    elif args.part == "ours_sharded":
        result = run_ours(args, rank, "sharded")
    elif args.part == "deepspeed":
        result = run_deepspeed(args, rank, counter)
    else:
        result = run_fsdp2(args, rank, counter, no_sync=args.part == "fsdp2_no_sync")
    finish_rank(result, args.result_file, WORLD)


def launch(args, part: str) -> list[dict] | None:
    return launch_ranks(__file__, WORLD, part, args.out, forwarded(
        args, "layers", "hidden", "chunk_elements", "steps", "batch", "accumulation",
        "gather_ahead", "reshard"))


def main() -> None:
    parser = rank_parser(__doc__.split("\n\n")[0], "bench-results/grad_accumulation.json", "ours")
    add_block_model_arguments(parser, layers=100, hidden=128, chunk_elements=1 << 18, steps=3,
                              batch=32)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every contender, interleaved (medians are reported)")
    args = parser.parse_args()
    if args.rank_process:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    names = ["ours", "ours_sharded"]
    if deepspeed_importable():
        names.append("deepspeed")
    else:
        print("DeepSpeed is not importable here: the ZeRO-3 baseline is PyTorch FSDP2")
    names += ["fsdp2", "fsdp2_no_sync"]
    # Rounds interleave the contenders, so that load from other processes on a shared machine
    # falls on all of them alike; each figure is the median over rounds of rank 0's median.
    rounds = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            result = launch(args, name)
            if result is None and name == "ours":
                raise SystemExit("our run failed")
            if result is not None:
                rounds[name].append(result)
    ran = {}
    for name, results in rounds.items():
        if results:
            ran[name] = dict(results[0][0], **{
                key: statistics.median(r[0][key] for r in results)
                for key in ("step_seconds", "step_cpu_seconds")})
    o = ran["ours"]
    keys = ("collectives_per_step", "bytes_per_step", "step_seconds", "step_cpu_seconds")
    ratios = {name: {key: r[key] / o[key] if o[key] else None for key in keys}
              for name, r in ran.items() if name != "ours"}
    payload = {"machine": machine_description(), "config": vars(args),
               "failed": [name for name, results in rounds.items() if not results],
               "summary": ran, "rounds": rounds, "baseline_over_ours": ratios}
    print(f"{args.layers} blocks of Linear({args.hidden}) + LayerNorm, 2 gloo ranks, "
          f"accumulation {args.accumulation}; per optimizer step, rank 0, median of "
          f"{args.rounds} round(s):")
    for name, r in ran.items():
        print(f"  {name:14s} {r['collectives_per_step']:7.1f} collectives "
              f"{r['bytes_per_step'] / 2**20:8.1f} MiB {r['step_seconds'] * 1e3:8.1f} ms "
              f"(cpu {r['step_cpu_seconds'] * 1e3:8.1f} ms)")
    for name, ratio in ratios.items():
        print(f"  {name} / ours: " + ", ".join(
            f"{key} {value:.2f}x" for key, value in ratio.items() if value is not None))
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
