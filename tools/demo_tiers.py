"""Memory-tier demo: streams a model's worth of chunks through emulated device memory, host
memory and an NVMe file under tight budgets, checks every byte against torch, and prints what
each tier saw. (The training demo replaces this once patrickstar.initialize lands.)"""
import argparse
import os
import tempfile
import time

import torch
from tqdm import tqdm

import patrickstar
from patrickstar import _C

MiB = 1 << 20


def fmt(nbytes):
    return f"{nbytes / MiB:9.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=48, help="number of chunks (default 48)")
    parser.add_argument("--chunk-mib", type=int, default=16, help="chunk size in MiB")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(),
                        help="directory for the NVMe tier's file (default: the temp dir)")
    args = parser.parse_args()
    if args.chunks < 1 or args.chunk_mib < 1:
        parser.error("--chunks and --chunk-mib must be positive")

    chunk_bytes = args.chunk_mib * MiB
    numel = chunk_bytes // 4
    device = _C.EmulatedDeviceTier(budget=4 * chunk_bytes, name="device")
    host = _C.HostTier(budget=8 * chunk_bytes, name="host", pinned=_C.cuda_available())
    nvme = _C.NvmeTier(args.nvme_dir, budget=(args.chunks + 1) * chunk_bytes, name="nvme")
    engine = _C.CopyEngine(host_threads=2)
    print(f"patrickstar {patrickstar.__version__}, torch {torch.__version__}, "
          f"CUDA build {_C.build_info()['with_cuda']}, GPU {_C.cuda_available()}")
    print(f"NVMe file {nvme.path} (O_DIRECT {nvme.direct_io}, io_uring {nvme.uses_io_uring})"
          + (f" note: {nvme.fallback_note}" if nvme.fallback_note else ""))
    print(f"{args.chunks} chunks of {args.chunk_mib} MiB; budgets: device {fmt(device.budget)}, "
          f"host {fmt(host.budget)}")

    # "Forward": each chunk is produced on the device, then spilled device -> host -> NVMe.
    generator = torch.Generator().manual_seed(0)
    seeds, slots = [], []
    started = time.perf_counter()
    for index in tqdm(range(args.chunks), desc="write (device->host->nvme)", unit="chunk"):
        on_device = device.allocate(chunk_bytes)
        seed = int(torch.randint(0, 2**31, (1,), generator=generator))
        device.tensor(on_device, torch.float32).copy_(
            torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
        staging = host.allocate(chunk_bytes)
        engine.copy_and_wait(on_device, staging)
        device.free(on_device)
        slot = nvme.allocate(chunk_bytes)
        engine.copy(staging, slot).wait()
        host.free(staging)
        seeds.append(seed)
        slots.append(slot)
    # "Backward": read back in reverse order, prefetching the next chunk while checking this one.
    mismatches = 0
    pending = None
    for index in tqdm(reversed(range(args.chunks)), total=args.chunks,
                      desc="read (nvme->host->device)", unit="chunk"):
        if pending is None:
            buffer = host.allocate(chunk_bytes)
            pending = (buffer, engine.copy(slots[index], buffer))
        buffer, handle = pending
        handle.wait()
        pending = None
        if index > 0:
            next_buffer = host.allocate(chunk_bytes)
            pending = (next_buffer, engine.copy(slots[index - 1], next_buffer))
        on_device = device.allocate(chunk_bytes)
        engine.copy_and_wait(buffer, on_device)
        host.free(buffer)
        expected = torch.randn(numel, generator=torch.Generator().manual_seed(seeds[index]))
        if not torch.equal(device.tensor(on_device, torch.float32), expected):
            mismatches += 1
        device.free(on_device)
        nvme.free(slots[index])
    elapsed = time.perf_counter() - started
    moved = 4 * args.chunks * chunk_bytes  # each chunk crosses two links each way
    print(f"\nmoved {fmt(moved)} in {elapsed:.2f} s ({moved / elapsed / MiB:.0f} MiB/s), "
          f"{mismatches} mismatching chunks")
    print(f"{'tier':8} {'peak in use':>14} {'peak reserved':>14} {'budget':>14} {'blocks':>8}")
    for tier in (device, host, nvme):
        s = tier.stats()
        print(f"{tier.name:8} {fmt(s['bytes']['peak']):>14} {fmt(s['peak_reserved_bytes']):>14} "
              f"{fmt(s['budget_bytes']):>14} {s['blocks']['allocated']:>8}")
        assert s["peak_reserved_bytes"] <= s["budget_bytes"], f"{tier.name} exceeded its budget"
    try:
        device.allocate(5 * chunk_bytes)
    except patrickstar.ChunkOutOfMemoryError as error:
        print(f"\nasking the device for more than its budget raises ChunkOutOfMemoryError:\n  {error}")
    path = nvme.path
    del nvme, tier, slots, slot  # every reference, blocks included, keeps the tier alive
    print(f"NVMe file removed at shutdown: {not os.path.exists(path)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
