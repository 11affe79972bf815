"""Per-rank peak model data under data parallelism, ours against PyTorch FSDP2 (and DeepSpeed
ZeRO-3 when importable), for 1, 2, 4 and 8 gloo ranks on this machine (issue 18).

    python tools/bench/dp_memory.py [--worlds 1 2 4 8] [--layers 24] [--chunk-elements auto]

The model is issue 18's: `layers` blocks of Linear(512, 2048), GELU, Linear(2048, 512),
LayerNorm(512) (24 blocks: 50.4M parameters), Adam, chunks of 1.5M elements (issue 18's
measurement; `--chunk-elements auto` lets the runtime search the size, as
`"default_chunk_size": "auto"` does, and DeepSpeed's buckets stay 1.5M elements). Each contender
trains two optimizer steps, fp32 and bf16, with and without gradient accumulation (2 micro-steps);
every rank sees its own micro-batches (memory does not depend on the values).

  * ours: `model.peak_model_bytes`, the peak of the chunk bytes of all tiers together
    (issue 18 summed each tier's `peak_chunk_bytes`, which counts a chunk twice when it sits on
    the device in backward and on the host in the CPU optimizer step; kept in the JSON as
    sum_of_tier_peaks): compute parameters, gradients and optimizer state (master weights,
    momentum, variance), gathered copies included, over training (`reset_peak_memory_stats()` after initialize(), whose peak,
    every rank building the whole model once, is reported apart as init_peak_model_bytes).
  * ours_full (with accumulation only): the same with `parallel.gradient_accumulation` "full"
    (full-size gradients accumulated on every rank, one reduce-scatter at the boundary) instead
    of the default "sharded" (a reduce-scatter into the owner's shard every micro-step).
  * fsdp2: `fully_shard` per block and on the root, CPU, gloo (bf16: MixedPrecisionPolicy with
    bf16 parameters). The same model data is counted, sampled at every module's forward and
    backward hooks and after the step: each parameter's local shard and its gradient, the
    optimizer state, and the unsharded parameters (and their gradients) while FSDP2 holds them.
    With `--fsdp2-collectives` it is also sampled as each of FSDP2's allgathers and
    reduce-scatters is issued, counting their flat buffers (the gathered output, the copied-in
    gradients): model data in flight that the module hooks never see.
  * deepspeed: ZeRO stage 3 on the CPU accelerator when `import deepspeed` works (see
    tools/bench/grad_accumulation.py for how it was installed); counted like FSDP2 from its
    partitioned parameters (`ds_tensor`), the parameters it holds gathered, the optimizer
    state, and every tensor the ZeRO optimizer object holds (flat fp32 partitions, gradient
    partitions and buckets: its gradients are not in `p.grad`).

The reported figure per configuration is the largest per-rank peak over the ranks, and the ratio
to the same contender in one process. Issue 18's targets for ours: <= 0.35 at 4 ranks, <= 0.22 at
8.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (deepspeed_importable, finish_rank, forwarded, launch_ranks,  # noqa: E402
                    machine_description, rank_parser, write_json)

CHUNK_ELEMENTS = 1_500_000
BATCH = 8  # per rank and micro-step


class Blocks(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512))
            for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.float().pow(2).mean()


def batches(rank: int, count: int, dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(BATCH, 512, generator=generator).to(dtype) for _ in range(count)]


def compute_dtype(args):
    return torch.bfloat16 if args.precision == "bf16" else torch.float32


def train(args, rank: int, dtype, micro_step, end_step) -> None:
    """args.steps optimizer steps of args.accumulation micro-steps each."""
    for _ in range(args.steps):
        for x in batches(rank, args.accumulation, dtype):
            micro_step(x)
        end_step()


def run_ours(args, rank: int, accumulation_mode: str = "sharded") -> dict:
    import patrickstar
    torch.manual_seed(0)
    chunk = args.chunk_elements
    config = {"default_chunk_size": chunk if chunk == "auto" else int(chunk),
              "gradient_accumulation_steps": args.accumulation,
              "parallel": {"gradient_accumulation": accumulation_mode,
                           "remake_compute": not args.keep_compute},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    model, optimizer = patrickstar.initialize(lambda: Blocks(args.layers), config=config)
    # Training's peak, as FSDP2's and DeepSpeed's are counted from their sharded models: every
    # rank built the whole model once before (reported apart, as init_peak_model_bytes).
    init_peak = model.peak_model_bytes
    model.reset_peak_memory_stats()
    ends = [time.perf_counter()]
    def end_step():
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
    train(args, rank, compute_dtype(args), lambda x: model.backward(model(x)), end_step)
    stats = model.memory_stats()
    # Wall time of each optimizer step after the first (warm-up), micro-steps included.
    step_seconds = [b - a for a, b in zip(ends[1:], ends[2:])]
    return {"peak_model_bytes": model.peak_model_bytes,
            "step_seconds": step_seconds,
            "chunk_elements": model.layout["chunk_elements"],
            "sum_of_tier_peaks": sum(t["peak_chunk_bytes"] for t in stats),
            "init_peak_model_bytes": init_peak}


def _storage_bytes(tensor) -> int:
    if tensor is None:
        return 0
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.untyped_storage().nbytes()


class ModelDataSampler:
    """The largest sum of model-data storages seen at any module hook (FSDP2, DeepSpeed)."""

    def __init__(self, model: nn.Module, optimizer, extra):
        self.model, self.optimizer, self.extra, self.peak = model, optimizer, extra, 0
        self.collective_samples = 0
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: self.sample())
            module.register_forward_hook(lambda *_: self.sample())
            module.register_full_backward_pre_hook(lambda *_: self.sample())
            module.register_full_backward_hook(lambda *_: self.sample())

    def sample(self, in_flight=()) -> None:
        """`in_flight`: tensors a collective is about to move, counted with the rest."""
        storages = {}  # one count per storage: views of a flat buffer share it
        def add(tensor):
            if tensor is None:
                return
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0),
                                               storage.nbytes())
        for p in self.model.parameters():
            add(p)
            add(p.grad)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    add(value)
        for tensor in self.extra():
            add(tensor)
        for tensor in in_flight:
            add(tensor)
        storages.pop(0, None)  # freed storages (resized to 0) have no address
        self.peak = max(self.peak, sum(storages.values()))


def fsdp_unsharded(model: nn.Module):
    """FSDP2's unsharded parameters and their gradients (storage resized to 0 when freed)."""
    def tensors():
        for module in model.modules():
            if not hasattr(module, "_get_fsdp_state"):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in (group.fsdp_params if group is not None else []):
                yield from fsdp_param.all_gather_outputs
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    yield unsharded.grad
    return tensors


def sample_fsdp2_collectives(sampler: ModelDataSampler) -> None:
    """Samples as FSDP2 issues each allgather and reduce-scatter, with its flat input and
    output buffers (torch's default AllGather / ReduceScatter objects, wrapped in place)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    for cls in (collectives.DefaultAllGather, collectives.DefaultReduceScatter):
        issue = cls.__call__

        def sampled(self, output_tensor, input_tensor, *args, _issue=issue, **kwargs):
            sampler.collective_samples += 1
            sampler.sample((output_tensor, input_tensor))
            return _issue(self, output_tensor, input_tensor, *args, **kwargs)
        cls.__call__ = sampled


def run_fsdp2(args, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = Blocks(args.layers)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16)
              if args.precision == "bf16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = ModelDataSampler(model, optimizer, fsdp_unsharded(model))
    if args.fsdp2_collectives:
        sample_fsdp2_collectives(sampler)
    def end_step():
        optimizer.step()
        sampler.sample()
        optimizer.zero_grad()
    train(args, rank, torch.float32, lambda x: (model(x) / args.accumulation).backward(),
          end_step)
    return {"peak_model_bytes": sampler.peak, "collective_samples": sampler.collective_samples}


def optimizer_buffers(zero_optimizer):
    """Tensors held by a DeepSpeed ZeRO optimizer's attributes (directly, or in a list, tuple or
    dict one level down), where it keeps gradient partitions and flat fp32 copies."""
    for value in vars(zero_optimizer).values():
        items = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if torch.is_tensor(item):
                yield item
                yield item.grad
            elif isinstance(item, (list, tuple)):
                for inner in item:
                    if torch.is_tensor(inner):
                        yield inner
                        yield inner.grad


def run_deepspeed(args, rank: int, world: int) -> dict:
    import deepspeed
    torch.manual_seed(0)
    model = Blocks(args.layers)
    config = {"train_micro_batch_size_per_gpu": BATCH,
              "gradient_accumulation_steps": args.accumulation,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": CHUNK_ELEMENTS,
                                    "stage3_prefetch_bucket_size": CHUNK_ELEMENTS,
                                    "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": args.precision == "bf16"},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    zero_optimizer = engine.optimizer

    def partitions():
        for p in model.parameters():
            yield getattr(p, "ds_tensor", None)
            yield p.data  # numel 0 while released
        # The ZeRO-3 optimizer's own buffers: fp32 partitions, the gradient partitions and
        # buckets it reduces into (not p.grad), counted once per storage like the rest.
        yield from optimizer_buffers(zero_optimizer)
    sampler = ModelDataSampler(model, optimizer, partitions)
    def micro_step(x):
        engine.backward(engine(x))
        engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
    train(args, rank, compute_dtype(args), micro_step, sampler.sample)
    return {"peak_model_bytes": sampler.peak, "deepspeed": deepspeed.__version__}


def run_rank(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torch 2.13's deprecations and FSDP2's note on full backward hooks (our sampler's), per call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.part == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    runner = {"ours": lambda: run_ours(args, rank),
              "ours_full": lambda: run_ours(args, rank, "full"),
              "fsdp2": lambda: run_fsdp2(args, rank, world),
              "deepspeed": lambda: run_deepspeed(args, rank, world)}[args.part]
    finish_rank(runner(), args.result_file, world)


def main() -> None:
    parser = rank_parser(__doc__.split("\n\n")[0], "bench-results/dp_memory.json", "ours")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk-elements", default=str(CHUNK_ELEMENTS),
                        help="ours: elements per chunk, or 'auto'")
    parser.add_argument("--contenders", nargs="+", default=None,
                        help="a subset of ours, fsdp2, deepspeed (default: all that run here)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--fsdp2-collectives", action="store_true",
                        help="also sample FSDP2's model data as it issues each collective")
    parser.add_argument("--accumulations", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--keep-compute", action="store_true",
                        help="ours: parallel.remake_compute false (the owner keeps its 16-bit "
                             "compute chunks between uses)")
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.chunk_elements != "auto":
        args.chunk_elements = int(args.chunk_elements)
    contenders = args.contenders or (
        ["ours", "fsdp2"] + (["deepspeed"] if deepspeed_importable() else []))
    rows = []
    for precision in args.precisions:
        for accumulation in args.accumulations:
            single = {}
            for world in sorted(args.worlds):
                names = list(contenders)
                if "ours" in names and accumulation > 1:
                    names.insert(names.index("ours") + 1, "ours_full")
                for name in names:
                    result = launch_ranks(__file__, world, name, args.out, forwarded(
                        args, "layers", "steps", "chunk_elements") + ["--precision", precision,
                                                    "--accumulation", str(accumulation)]
                        + (["--keep-compute"] if args.keep_compute else [])
                        + (["--fsdp2-collectives"] if args.fsdp2_collectives else []))
                    if result is None:
                        rows.append({"contender": name, "world": world, "precision": precision,
                                     "accumulation": accumulation, "failed": True})
                        continue
                    peak = max(r["peak_model_bytes"] for r in result)
                    if world == 1:
                        single[name] = peak
                    row = {"contender": name, "world": world, "precision": precision,
                           "accumulation": accumulation, "peak_model_bytes": peak,
                           "per_rank": [r["peak_model_bytes"] for r in result],
                           "step_seconds": result[0].get("step_seconds"),
                           "chunk_elements": result[0].get("chunk_elements"),
                           "collective_samples": result[0].get("collective_samples"),
                           "over_one_process": peak / single[name] if name in single else None}
                    rows.append(row)
                    ratio = row["over_one_process"]
                    print(f"{precision} acc {accumulation} {name:9s} {world} ranks: "
                          f"{peak / 2**20:8.1f} MiB per rank"
                          + (f" ({ratio:.2f} of one process)" if ratio is not None else "")
                          + (f", step {statistics.median(row['step_seconds']):.3f} s (median "
                             f"of {len(row['step_seconds'])})" if row["step_seconds"] else ""),
                          flush=True)
    params = sum(p.numel() for p in Blocks(args.layers).parameters())
    write_json(args.out, {"machine": machine_description(), "config": vars(args),
                          "parameters": params, "chunk_elements": args.chunk_elements,
                          "deepspeed_bucket_elements": CHUNK_ELEMENTS, "rows": rows})


if __name__ == "__main__":
    main()
