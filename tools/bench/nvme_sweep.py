"""The optimizer sweep with Adam state on NVMe, against its parts measured alone in the same run.

Note [Optimizer sweep] in python/patrickstar/optimizer.py streams NVMe-resident state through host
memory: row k+1 is read while row k is updated and row k-1 written back. With perfect overlap a
step costs max(read, Adam, write); without any, their sum. This driver measures, on one model:
  * sweep:  `optimizer.step()` of an engine whose momentum and variance live on NVMe (a host
            budget of a few rows), after forward/backward, best of N;
  * adam:   `optimizer.step()` of the same model with everything in memory;
  * read / write: the same chunks (count and size) moved between the host and NVMe tiers alone,
            all submitted at once (the disk's best case).
Prints sweep / max(read, adam, write) (target <= 1.2: real overlap) and sweep / (read + adam +
write) (1.0 would be no overlap at all), and writes JSON (bench-results/nvme_sweep.json).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, write_json  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import patrickstar  # noqa: E402
from patrickstar import _C  # noqa: E402


class Stack(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def step_times(config: dict, width: int, depth: int, repeats: int) -> tuple[list[float], dict]:
    """Seconds of each `optimizer.step()` (after forward/backward) and the final tier stats."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(lambda: Stack(width, depth), config=config)
    x = torch.randn(4, width)
    times = []
    for _ in range(repeats + 1):  # the first step is the warm-up (zero-filled state)
        loss = model(x)
        model.backward(loss)
        started = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - started)
        opt.zero_grad()
    stats = model.memory_stats()
    model.destroy()
    return times[1:], stats


def raw_io(directory: str, chunks: int, chunk_bytes: int, repeats: int) -> tuple[float, float]:
    """Best seconds to write and to read `chunks` chunks between host blocks and the NVMe tier."""
    host = _C.HostTier(name="bench-host")
    nvme = _C.NvmeTier(directory, budget=(chunks + 1) * chunk_bytes, slab_bytes=chunk_bytes)
    engine = _C.CopyEngine(host_threads=2)
    blocks = [host.allocate(chunk_bytes) for _ in range(chunks)]
    for index, block in enumerate(blocks):
        host.tensor(block, torch.uint8).fill_(index % 251)
    slots = [nvme.allocate(chunk_bytes) for _ in range(chunks)]
    best_write = best_read = float("inf")
    for _ in range(repeats):
        for source, target, best in ((blocks, slots, "write"), (slots, blocks, "read")):
            started = time.perf_counter()
            for handle in [engine.copy(s, t) for s, t in zip(source, target)]:
                handle.wait()
            elapsed = time.perf_counter() - started
            if best == "write":
                best_write = min(best_write, elapsed)
            else:
                best_read = min(best_read, elapsed)
    for block in blocks:
        host.free(block)
    for slot in slots:
        nvme.free(slot)
    return best_write, best_read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="NVMe directory")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--ring-rows", type=int, default=4,
                        help="host budget in rows of state (momentum + variance chunks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small model, one repeat")
    parser.add_argument("--json", default="bench-results/nvme_sweep.json")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.repeats = 512, 8, 1
    chunk = args.width * args.width  # one weight per chunk
    chunk_bytes = chunk * 4
    state_chunks = 2 * args.depth  # momentum + variance
    base = {"default_chunk_size": chunk, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    workdir = tempfile.mkdtemp(prefix="ps-sweep-bench-", dir=args.dir)
    try:
        adam, _ = step_times(base, args.width, args.depth, args.repeats)
        on_nvme = dict(base, memory={"host_budget": args.ring_rows * 2 * chunk_bytes,
                                     "nvme": {"path": workdir}})
        sweep, stats = step_times(on_nvme, args.width, args.depth, args.repeats)
        write, read = raw_io(workdir, state_chunks, chunk_bytes, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    nvme = next(tier for tier in stats if tier["kind"] == "nvme")
    host = next(tier for tier in stats if tier["kind"] == "host")
    best = {"sweep": min(sweep), "adam": min(adam), "read": read, "write": write}
    bound = max(best["adam"], read, write)
    print(f"{args.depth} x {args.width}^2 fp32 parameters ({args.depth * chunk / 1e6:.0f} M), "
          f"Adam state {state_chunks * chunk_bytes / 2**20:.0f} MiB on NVMe, host budget "
          f"{args.ring_rows} rows; best of {args.repeats}")
    for name, value in best.items():
        print(f"  {name:6} {value * 1e3:9.1f} ms")
    print(f"  sweep / max(read, adam, write) = {best['sweep'] / bound:.2f}  (target <= 1.2)")
    print(f"  sweep / (read + adam + write)  = "
          f"{best['sweep'] / (read + best['adam'] + write):.2f}  (1.0 = no overlap)")
    print(f"  host peak {host['peak_chunk_bytes'] / 2**20:.0f} MiB, NVMe resident "
          f"{nvme['chunk_bytes'] / 2**20:.0f} MiB, host prefetch hits {host['prefetch_hits']} / "
          f"misses {host['prefetch_misses']}")
    write_json(args.json, {
        "benchmark": "nvme_sweep", "machine": machine_description(), "directory": args.dir,
        "width": args.width, "depth": args.depth, "chunk_bytes": chunk_bytes,
        "state_bytes": state_chunks * chunk_bytes, "ring_rows": args.ring_rows,
        "seconds": {"sweep": sweep, "adam": adam, "read_best": read, "write_best": write},
        "ratio_vs_max_part": best["sweep"] / bound,
        "ratio_vs_sum_of_parts": best["sweep"] / (read + best["adam"] + write),
        "tier_stats": stats,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
