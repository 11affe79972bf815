"""NVMe tier throughput against fio, in the same run on the same directory.

Writes N chunks from host memory to the NVMe tier and reads them back (all submitted at once,
as the optimizer sweep and prefetch do), and runs fio with O_DIRECT sequential 1 MiB blocks
through io_uring at the same queue depth on the same bytes. Prints GB/s and our/fio ratios and
writes JSON (bench-results/nvme.json by default). Target: >= 0.9x fio for write and read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, machine_description, quick_defaults, write_json  # noqa: E402

import torch  # noqa: E402
from patrickstar import _C  # noqa: E402

MiB = 1 << 20


def run_fio(directory: str, mode: str, size: int, block: int, depth: int) -> float:
    """fio throughput in bytes/s for `mode` in {write, read}."""
    command = ["fio", "--name=ps-bench", f"--directory={directory}", f"--rw={mode}",
               f"--bs={block}", f"--size={size}", "--direct=1", "--ioengine=io_uring",
               f"--iodepth={depth}", "--numjobs=1", "--end_fsync=0", "--output-format=json",
               "--filename=fio-bench.dat"]
    if mode == "write":
        command.append("--fallocate=native")
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(result.stdout)["jobs"][0][mode]
    return job["bw_bytes"]


def run_tier(directory: str, chunks: int, chunk_bytes: int, block: int, depth: int,
             use_io_uring: bool, verify: bool = True) -> tuple[float, float]:
    """Our (write, read) throughput in bytes/s; `verify`: memory.nvme.verify's checksums."""
    host = _C.HostTier(name="bench-host")
    nvme = _C.NvmeTier(directory, budget=(chunks + 1) * chunk_bytes, queue_depth=depth,
                       block_size=block, use_io_uring=use_io_uring, slab_bytes=chunk_bytes,
                       verify=verify)
    engine = _C.CopyEngine(host_threads=2)
    sources = [host.allocate(chunk_bytes) for _ in range(chunks)]
    for index, block_ in enumerate(sources):
        host.tensor(block_, torch.uint8).fill_(index % 251)
    slots = [nvme.allocate(chunk_bytes) for _ in range(chunks)]  # preallocated, as in training
    started = time.perf_counter()
    handles = [engine.copy(src, dst) for src, dst in zip(sources, slots)]
    for handle in handles:
        handle.wait()
    write = chunks * chunk_bytes / (time.perf_counter() - started)
    targets = [host.allocate(chunk_bytes) for _ in range(chunks)]
    for block_ in targets:  # pool memory is warm in training; fault the pages in beforehand
        host.tensor(block_, torch.uint8).zero_()
    started = time.perf_counter()
    handles = [engine.copy(src, dst) for src, dst in zip(slots, targets)]
    for handle in handles:
        handle.wait()
    read = chunks * chunk_bytes / (time.perf_counter() - started)
    if not torch.equal(host.tensor(targets[-1], torch.uint8),
                       host.tensor(sources[-1], torch.uint8)):
        raise RuntimeError("read-back mismatch")
    return write, read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory to test")
    parser.add_argument("--chunk-mib", type=at_least(1), default=64)
    parser.add_argument("--total-mib", type=at_least(1), default=2048)
    parser.add_argument("--block-kib", type=at_least(1), default=1024, help="IO block (fio --bs)")
    parser.add_argument("--queue-depth", type=at_least(1), default=32)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--json", default="bench-results/nvme.json")
    args = parser.parse_args()
    if args.quick:
        quick_defaults(parser, args, total_mib=256, chunk_mib=16, repeats=1)
    if shutil.which("fio") is None:
        parser.error("fio is not installed (tools/setup.sh installs it)")
    chunk_bytes = args.chunk_mib * MiB
    chunks = max(1, args.total_mib // args.chunk_mib)
    size = chunks * chunk_bytes
    block = args.block_kib * 1024
    workdir = tempfile.mkdtemp(prefix="ps-nvme-bench-", dir=args.dir)
    # ours_io_uring and ours_pread verify checksums (memory.nvme.verify, the default);
    # ours_unverified is io_uring without them, the checksums' cost.
    contenders = (("ours_io_uring", True, True), ("ours_pread", False, True),
                  ("ours_unverified", True, False))
    rows = {name: {"write": [], "read": []} for name in ["fio"] + [c[0] for c in contenders]}
    try:
        # Interleaved so drift on the shared disk hits every contender alike.
        for _ in range(args.repeats):
            rows["fio"]["write"].append(run_fio(workdir, "write", size, block, args.queue_depth))
            rows["fio"]["read"].append(run_fio(workdir, "read", size, block, args.queue_depth))
            os.unlink(os.path.join(workdir, "fio-bench.dat"))
            for name, uring, verify in contenders:
                write, read = run_tier(workdir, chunks, chunk_bytes, block, args.queue_depth, uring,
                                       verify)
                rows[name]["write"].append(write)
                rows[name]["read"].append(read)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    best = {name: {mode: max(values) for mode, values in modes.items()}
            for name, modes in rows.items()}
    print(f"{chunks} chunks x {args.chunk_mib} MiB = {size / MiB:.0f} MiB, block "
          f"{args.block_kib} KiB, queue depth {args.queue_depth}, best of {args.repeats}")
    print(f"{'':16}{'write GB/s':>12}{'read GB/s':>12}{'write/fio':>12}{'read/fio':>12}")
    for name, value in best.items():
        print(f"{name:16}{value['write'] / 1e9:12.2f}{value['read'] / 1e9:12.2f}"
              f"{value['write'] / best['fio']['write']:12.2f}"
              f"{value['read'] / best['fio']['read']:12.2f}")
    write_json(args.json, {
        "benchmark": "nvme", "machine": machine_description(), "directory": args.dir,
        "chunk_bytes": chunk_bytes, "chunks": chunks, "block_bytes": block,
        "queue_depth": args.queue_depth, "runs_bytes_per_s": rows, "best_bytes_per_s": best,
        "ratio_vs_fio": {name: {mode: best[name][mode] / best["fio"][mode]
                                for mode in ("write", "read")} for name in best},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
