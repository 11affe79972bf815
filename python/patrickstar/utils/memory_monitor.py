"""Process and device memory figures for training logs."""
from __future__ import annotations

import resource

import torch

from .logging import logger

__all__ = ["get_sys_memory_used", "see_memory_usage"]


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def get_sys_memory_used(device) -> int:
    """Bytes in use: torch's allocated bytes on a CUDA device, the process's RSS on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _rss_bytes()


def see_memory_usage(message: str, force: bool = False) -> None:
    """Logs RSS (and CUDA allocated/reserved bytes) with `message`; only with `force=True`, as
    upstream. The chunk tiers' own figures are `model.memory_stats()`."""
    if not force:
        return
    parts = [f"RSS {_rss_bytes() / 2**30:.3f} GiB"]
    if torch.cuda.is_available():
        parts.append(f"CUDA allocated {torch.cuda.memory_allocated() / 2**30:.3f} GiB, "
                     f"reserved {torch.cuda.memory_reserved() / 2**30:.3f} GiB")
    logger.warning("%s | %s", message, ", ".join(parts))
