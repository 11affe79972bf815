"""Chunk-group collectives against per-tensor and flat collectives, and one data-parallel training
step against PyTorch FSDP2, on 2 gloo ranks of this machine (issue 8).

    python tools/bench/collectives.py [--layers 200] [--hidden 256] [--out bench-results/...]

The model has `layers` blocks of Linear(hidden, hidden) + LayerNorm(hidden): 4 tensors a block,
many small tensors. Part 1 moves the bytes of one iteration (an allgather of the parameters and
a reduce-scatter of the gradients) three ways, in the same run: our chunk groups (one collective
per group, each reduce-scatter algorithm of the c10d back end), one collective per tensor, and
one flat collective of all the bytes (the transport's limit), and our chunk groups once more
over the shared-memory communicator (`chunked_shm`, runtime/shm_communicator.h), with the time
of one group's allgather on each transport. Part 2 times one training step of our 2-rank data
parallelism (`--transport`, `--reshard`) and of FSDP2 (`fully_shard` per block, CPU, gloo) on
the same model and batch, with each rank's peak resident memory above its baseline after setup;
`--parts` runs some of the three parts only.
The script starts its two ranks itself (no torchrun needed) and rank 0 writes the JSON.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Blocks, add_block_model_arguments, forwarded, launch_ranks,  # noqa: E402
                    machine_description, parallel_config, rank_parser, write_json)

WORLD = 2


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (connections, allocations)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_collectives(args, rank: int) -> dict:
    from patrickstar import _C
    torch.manual_seed(0)
    model = Blocks(args.layers, args.hidden)
    shapes = [tuple(p.shape) for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]
    total = sum(numels)
    results = {"tensors": len(shapes), "parameters": total, "bytes_per_direction": 4 * total}

    # Per tensor: each rank holds 1/WORLD of every tensor (padded), allgather + reduce-scatter.
    shards = [torch.randn((n + WORLD - 1) // WORLD) for n in numels]
    gathered = [torch.empty(s.numel() * WORLD) for s in shards]
    grads = [torch.randn(s.numel() * WORLD) for s in shards]

    def per_tensor():
        for shard, out in zip(shards, gathered):
            dist.all_gather_into_tensor(out, shard)
        for grad, shard in zip(grads, shards):
            dist.reduce_scatter_tensor(shard, grad)

    flat_shard = torch.randn((total + WORLD - 1) // WORLD)
    flat_full = torch.empty(flat_shard.numel() * WORLD)
    flat_grad = torch.randn(flat_shard.numel() * WORLD)

    def flat():
        dist.all_gather_into_tensor(flat_full, flat_shard)
        dist.reduce_scatter_tensor(flat_shard, flat_grad)

    results["per_tensor"] = {"collectives": 2 * len(shapes),
                             "seconds": median_time(per_tensor, args.repeats)}
    results["flat"] = {"collectives": 2, "seconds": median_time(flat, args.repeats)}

    # Ours: the chunk manager's compute and gradient lists, gathered and reduce-scattered by
    # group through the c10d back end (each reduce-scatter algorithm), then through shared
    # memory.
    for algorithm in ("ring", "native", "allreduce", "shm"):
        tiers = [_C.HostTier(budget=0, name="host", pinned=False)]
        manager = _C.ChunkManager(tiers=tiers, copy_engine=_C.CopyEngine(host_threads=1),
                                  world_size=WORLD, rank=rank)
        ids = [manager.register_tensor(f"p{i}", list(s), _C.ChunkKind.COMPUTE_PARAM, "float32")
               for i, s in enumerate(shapes)]
        grad_ids = [manager.register_tensor(f"p{i}#g", list(s), _C.ChunkKind.GRADIENT,
                                            "float32") for i, s in enumerate(shapes)]
        layout = manager.build_chunk_lists(args.chunk_elements)
        for tensor in ids:
            manager.access(tensor, "host")
            manager.release(tensor, _C.TensorState.HOLD)
        if algorithm == "shm":
            gathered_names = [None] * WORLD
            dist.all_gather_object(gathered_names, f"/ps-bench-{os.getpid()}-{time.time_ns()}")
            communicator = _C.shm_communicator(gathered_names[0], rank=rank, world_size=WORLD)
        else:
            communicator = _C.process_group_communicator(dist.group.WORLD.group_name,
                                                         reduce_scatter=algorithm)
        collectives = _C.GroupCollectives(manager, communicator, tier="host")
        compute_groups = collectives.groups(_C.ChunkKind.COMPUTE_PARAM)
        grad_groups = list(reversed(collectives.groups(_C.ChunkKind.GRADIENT)))

        def chunked():
            collectives.release_all(_C.ChunkKind.COMPUTE_PARAM)
            for group in compute_groups:
                collectives.gather(group)
            for tensor in grad_ids:  # backward wrote every gradient
                manager.access(tensor, "host")
                manager.release(tensor, _C.TensorState.HOLD)
            for group in grad_groups:
                collectives.start_reduce_scatter(group)
            collectives.finish_reduce_scatters()

        before = collectives.collectives_issued
        seconds = median_time(chunked, args.repeats)
        issued = (collectives.collectives_issued - before) // (args.repeats + 1)
        results[f"chunked_{algorithm}"] = {"collectives": issued, "seconds": seconds,
                                           "chunk_elements": layout["chunk_elements"],
                                           "groups": len(compute_groups) + len(grad_groups)}

        def gathers_only():
            collectives.release_all(_C.ChunkKind.COMPUTE_PARAM)
            for group in compute_groups:
                collectives.gather(group)

        if algorithm in ("ring", "shm"):  # the allgathers are the same for the three c10d rows
            results[f"chunked_{algorithm}"]["allgather_seconds_per_group"] = median_time(
                gathers_only, args.repeats) / len(compute_groups)
        del collectives, communicator, manager
    flat_seconds = results["flat"]["seconds"]
    for key in ("per_tensor", "chunked_ring", "chunked_native", "chunked_allreduce",
                "chunked_shm"):
        results[key]["vs_flat"] = results[key]["seconds"] / flat_seconds
    results["chunked_shm"]["vs_chunked_ring"] = (results["chunked_shm"]["seconds"]
                                                 / results["chunked_ring"]["seconds"])
    results["chunked_shm"]["allgather_vs_gloo"] = (
        results["chunked_shm"]["allgather_seconds_per_group"]
        / results["chunked_ring"]["allgather_seconds_per_group"])
    return results


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def part_training(args, rank: int, which: str) -> dict:
    """One of the contenders, in a fresh process (peak memory is per process)."""
    torch.manual_seed(0)
    batch = args.batch // WORLD
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, args.hidden, generator=generator)
    y = torch.randn(batch, args.hidden, generator=generator)
    baseline = current_rss_bytes()
    if which == "ours":
        import patrickstar
        model, optimizer = patrickstar.initialize(
            lambda: Blocks(args.layers, args.hidden),
            config={"default_chunk_size": args.chunk_elements,
                    "parallel": parallel_config(args),
                    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})

        def step():
            model.backward(model(x, y))
            optimizer.step()
            optimizer.zero_grad()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        model = Blocks(args.layers, args.hidden)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False, fused=True)

        def step():
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()

    seconds = median_time(step, args.steps)
    return {"step_seconds": seconds, "peak_rss_above_baseline_bytes": peak_rss_bytes() - baseline}


def part_interleaved(args, rank: int) -> dict:
    """Our training step in several configurations (`--interleave transport:reshard,...`), one
    engine each in this process, their steps taken in turn (the first of each round rotating):
    on a machine whose load changes from minute to minute (other jobs on the 2 cores) the
    configurations see the same load, which separate runs do not."""
    import patrickstar
    configurations = [item.split(":") for item in args.interleave.split(",")]
    batch = args.batch // WORLD
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, args.hidden, generator=generator)
    y = torch.randn(batch, args.hidden, generator=generator)
    engines = []
    for transport, reshard in configurations:
        torch.manual_seed(0)
        engines.append(patrickstar.initialize(
            lambda: Blocks(args.layers, args.hidden),
            config={"default_chunk_size": args.chunk_elements,
                    "parallel": {"gather_ahead": args.gather_ahead,
                                 "reshard_after_forward": reshard == "on",
                                 "transport": transport},
                    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))

    def step(model, optimizer):
        model.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()

    for model, optimizer in engines:  # warm-up
        step(model, optimizer)
    times = [[] for _ in engines]
    for round_index in range(args.steps):
        for k in range(len(engines)):
            index = (round_index + k) % len(engines)
            dist.barrier()
            start = time.perf_counter()
            step(*engines[index])
            times[index].append(time.perf_counter() - start)
    return {f"{transport}:reshard_{reshard}": {"step_seconds": statistics.median(t),
                                               "transport": engines[i][0].dp.transport}
            for i, ((transport, reshard), t) in enumerate(zip(configurations, times))}


def run_rank(args) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks share the two cores
    if args.part == "collectives":
        result = part_collectives(args, rank)
    elif args.part == "interleaved":
        result = part_interleaved(args, rank)
    else:
        result = part_training(args, rank, args.part)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(args.result_file, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def launch(args, part: str) -> list[dict]:
    result = launch_ranks(__file__, WORLD, part, args.out, forwarded(
        args, "layers", "hidden", "chunk_elements", "repeats", "steps", "batch", "gather_ahead",
        "reshard", "transport", "interleave"))
    if result is None:
        raise SystemExit(f"a rank of part '{part}' failed")
    return result


def main() -> None:
    parser = rank_parser(__doc__.split("\n\n")[0], "bench-results/collectives.json", "collectives")
    add_block_model_arguments(parser, layers=200, hidden=256, chunk_elements=1 << 21, steps=3,
                              batch=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default="collectives,ours,fsdp2",
                        help="comma-separated parts to run: collectives, ours, fsdp2, "
                             "interleaved")
    parser.add_argument("--interleave",
                        default="shm:on,shm:off,process_group:on,process_group:off",
                        help="the interleaved part's configurations, transport:reshard each")
    args = parser.parse_args()
    if args.rank_process:
        run_rank(args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    parts = set(args.parts.split(","))
    unknown = parts - {"collectives", "ours", "fsdp2", "interleaved"}
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}")
    collectives = launch(args, "collectives")[0] if "collectives" in parts else None
    ours = launch(args, "ours") if "ours" in parts else None
    fsdp = launch(args, "fsdp2") if "fsdp2" in parts else None
    interleaved = launch(args, "interleaved") if "interleaved" in parts else None
    step = {"ours": ours, "fsdp2": fsdp, "interleaved": interleaved}
    if ours and fsdp:
        step["ours_vs_fsdp2_time"] = statistics.mean(
            o["step_seconds"] for o in ours) / statistics.mean(f["step_seconds"] for f in fsdp)
    payload = {"machine": machine_description(), "config": vars(args),
               "collectives": collectives, "training_step": step}
    c = collectives
    if c is not None:
        print(f"{c['tensors']} tensors, {c['parameters']} params, 2 gloo ranks")
        for key in ("flat", "per_tensor", "chunked_ring", "chunked_native", "chunked_allreduce",
                    "chunked_shm"):
            print(f"  {key:18s} {c[key]['collectives']:5d} collectives  "
                  f"{c[key]['seconds'] * 1e3:8.1f} ms  {c[key].get('vs_flat', 1.0):5.2f}x flat")
        for key in ("chunked_ring", "chunked_shm"):
            print(f"  one group's allgather, {key}: "
                  f"{c[key]['allgather_seconds_per_group'] * 1e3:.1f} ms")
        shm = c["chunked_shm"]
        print(f"  shm / gloo (same run): iteration {shm['vs_chunked_ring']:.2f}, "
              f"allgather {shm['allgather_vs_gloo']:.2f}")
    if interleaved is not None:
        for key in interleaved[0]:
            print(f"  step {key:26s} " + "  ".join(
                f"rank{r}: {v[key]['step_seconds'] * 1e3:.0f} ms"
                for r, v in enumerate(interleaved)))
    for name, ranks in (("ours", ours), ("fsdp2", fsdp)):
        if ranks is None:
            continue
        print(f"  step {name:6s} " + "  ".join(
            f"rank{r}: {v['step_seconds'] * 1e3:.0f} ms, peak +"
            f"{v['peak_rss_above_baseline_bytes'] / 2**20:.0f} MiB" for r, v in enumerate(ranks)))
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
