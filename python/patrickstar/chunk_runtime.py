"""The chunk runtime of one engine: its memory tiers, copy engine and chunk manager, built from
the config (GPU memory with CUDA, an emulated device tier otherwise; host memory; NVMe when
configured)."""
from __future__ import annotations

import json
import os
import warnings

import torch

from . import _C
from .utils.host_memory import host_memory_limit
from .vocabulary import Tier

__all__ = ["ChunkRuntime", "Chunks", "PREFETCH_MOMENTS", "torch_computes_on_host",
           "warn_budgets_beyond_the_machine"]

PREFETCH_MOMENTS = 2


def torch_computes_on_host() -> bool:
    """Whether the engine's torch compute (and so its update placement, Note [Optimizer sweep]
    in optimizer.py) runs on the host: a CPU build, or the strict emulated device
    (PATRICKSTAR_STRICT_DEVICE=1, Note [Strict device] in runtime/strict_device.h), which takes
    the CUDA tiers and copy routes while torch stays the CPU build."""
    return not _C.cuda_available() or _C.strict_device()


class Chunks:
    """The C++ chunk manager with `access` returning a torch view (valid until release)."""

    def __init__(self, tiers, copy_engine, world_size=1, rank=0):
        # Prefetch looks PREFETCH_MOMENTS moments ahead in the warm-up trace (Note [Prefetch] in
        # chunk_manager_moves.cc). It was off while prefetch moves corrupted backward; the cause was
        # autograd's saved views of moved chunks (Note [Saved views of parameters] in
        # saved_views.py), not the manager. Data parallelism prefetches too: a group's gather pins
        # its local chunk where a prefetch in flight takes it (Note [Pinning a group for a
        # collective]), and the pins and gathers are accesses in the trace like any other.
        self.manager = _C.ChunkManager(tiers=tiers, copy_engine=copy_engine,
                                       world_size=world_size, rank=rank,
                                       prefetch_moments=PREFETCH_MOMENTS)
        self.before_access = None  # data parallelism: gathers a remote group first
        # The calls of every moment and every optimizer update, bound once: __getattr__ runs
        # only after a failed normal lookup, which costs more than the call itself.
        for name in ("tick", "release", "release_tensors", "chunk_tier", "chunk_tiers",
                     "set_tensor_state", "start_move", "end_iteration"):
            setattr(self, name, getattr(self.manager, name))

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def access(self, tensor_id: int, tier: str) -> torch.Tensor:
        if self.before_access is not None:
            self.before_access(tensor_id)
        try:
            return self.manager.access_tensor(tensor_id, tier)
        except BaseException:
            self.release_left_in_compute([tensor_id])
            raise

    def access_tensors(self, tensor_ids: list[int], tiers: list[str]) -> list[torch.Tensor]:
        """access() of each tensor on its tier, all or none."""
        if self.before_access is not None:
            for tensor_id in tensor_ids:
                self.before_access(tensor_id)
        try:
            return self.manager.access_tensors(tensor_ids, tiers)
        except BaseException:
            self.release_left_in_compute(tensor_ids)
            raise

    def release_left_in_compute(self, tensor_ids) -> None:
        """Note [Interrupted access]
        Python runs a signal handler (Ctrl-C's KeyboardInterrupt, a SIGALRM timeout, a job
        scheduler's SIGTERM handler) at the first bytecode after a C++ call returns, so a signal
        that arrives during a long access (an NVMe read) is raised here after the access
        succeeded, before the caller holds the view it must release. The tensors would stay in
        COMPUTE, and every later access of them (the next forward, step, save, and the
        load_checkpoint() meant to recover) fails with "illegal state transition COMPUTE ->
        COMPUTE". A failed access itself changes nothing (all or none), and no caller accesses a
        tensor already in COMPUTE (that is the illegal transition), so a tensor of this call found
        in COMPUTE was put there by it: release it to HOLD, the state every caller releases to."""
        for tensor_id in tensor_ids:
            try:
                if self.manager.tensor_info(tensor_id)["state"] == _C.TensorState.COMPUTE:
                    self.manager.release(tensor_id, _C.TensorState.HOLD)
            except Exception:  # the original error matters more than a failed cleanup
                pass

    def stats(self) -> list[dict]:
        return json.loads(self.manager.tier_stats_json())

    def reset_peak_stats(self) -> None:
        self.manager.reset_peak_stats()

    @property
    def peak_total_bytes(self) -> int:
        """The peak of all tiers' chunk bytes together."""
        return int(self.manager.peak_total_chunk_bytes)


class ChunkRuntime:
    """Tiers, copy engine and chunk manager of one engine (`config.memory`)."""

    def __init__(self, config, local_rank: int, world_size: int = 1, rank: int = 0):
        memory = config.memory
        tiers = []
        # The strict device takes the CUDA tiers and copy routes; torch stays on the CPU, and
        # with it the CPU build's update placement (torch_computes_on_host).
        if _C.cuda_available():
            self.device = torch.device("cpu") if torch_computes_on_host() \
                else torch.device("cuda", local_rank)
            if self.device.type == "cuda":
                # Note [The current device is the local rank's]: torch's own allocations
                # without a device (NCCL buffers of the pipeline's and tensor slices' collectives,
                # the script's torch.cuda calls) go to the current device, GPU 0 by default on
                # every rank; DeepSpeed's init_distributed sets it to the local rank's too.
                torch.cuda.set_device(self.device)
            tiers.append(_C.DeviceTier(local_rank, budget=memory.device_budget or 0,
                                       name=f"cuda:{local_rank}"))
        else:
            self.device = torch.device("cpu")
            tiers.append(_C.EmulatedDeviceTier(budget=memory.device_budget or 0, name=Tier.DEVICE))
        tiers.append(_C.HostTier(budget=memory.host_budget or 0, name=Tier.HOST,
                                 pinned=_C.cuda_available()))
        if memory.nvme.path is not None:
            try:
                tiers.append(_C.NvmeTier(memory.nvme.path, budget=memory.nvme.budget,
                                         queue_depth=memory.nvme.queue_depth,
                                         block_size=memory.nvme.block_size,
                                         verify=memory.nvme.verify, name=Tier.NVME))
            except OSError as error:  # the path, not the key: say which key gave it
                # A JSON config's "~/nvme" reaches here as written: nothing expands it.
                tilde = (" ('~' is not expanded: give the full path)"
                         if str(memory.nvme.path).startswith("~") else "")
                error.add_note(f"config key 'memory.nvme.path' = {memory.nvme.path!r}: an "
                               f"existing directory the swap file is made in{tilde}")
                raise
        self.tiers = tiers
        self.has_nvme = memory.nvme.path is not None
        warn_budgets_beyond_the_machine(memory)
        self.copy_engine = _C.CopyEngine(host_threads=2, device=local_rank)
        self.chunks = Chunks(tiers, self.copy_engine, world_size, rank)


def warn_budgets_beyond_the_machine(memory) -> None:
    """A budget is a cap the tiers fill up to, not a reservation, so one larger than what is
    there passes initialize() and fails only when the run grows into it, possibly days later:
    a host budget past the machine's memory ends in the OOM killer's SIGKILL (no Python error,
    no message), an NVMe budget past the disk's free space in ENOSPC. Say so at the start."""
    limit = host_memory_limit()
    if memory.host_budget is not None and limit is not None and memory.host_budget > limit[0]:
        warnings.warn(
            f"config key 'memory.host_budget' = {memory.host_budget} bytes is more than "
            f"{limit[1]}, {limit[0]} bytes: when the host chunks grow past it the kernel's OOM "
            f"killer ends the process without an error; lower the budget (every rank on this "
            f"machine has its own)", stacklevel=3)
    nvme = memory.nvme
    if nvme.path is not None and nvme.budget > 0:
        try:
            info = os.statvfs(nvme.path)
        except OSError:
            return
        free = info.f_bavail * info.f_frsize
        if nvme.budget > free:
            warnings.warn(
                f"config key 'memory.nvme.budget' = {nvme.budget} bytes is more than the "
                f"{free} bytes free on the filesystem of '{nvme.path}': when the swap file "
                f"outgrows the disk, training stops with 'No space left on device'; lower the "
                f"budget or free space (a budget of 0 takes the free space at start)",
                stacklevel=3)
