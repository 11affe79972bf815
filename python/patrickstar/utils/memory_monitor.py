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


_SCALES = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}  # upstream's names, binary units


def see_memory_usage(message: str, force: bool = False, scale_name: str | None = None) -> None:
    """Logs RSS (and CUDA allocated/reserved bytes) with `message`; only with `force=True`, as
    upstream. `scale_name` ("B", "KB", "MB", "GB"; upstream's keyword) picks the unit, GiB with
    three decimals without it. The chunk tiers' own figures are `model.memory_stats()`."""
    if scale_name is not None and scale_name not in _SCALES:
        raise ValueError(f"see_memory_usage: scale_name {scale_name!r} is not one of "
                         f"{sorted(_SCALES, key=_SCALES.get)}")
    if not force:
        return
    if scale_name is None:
        def show(n: int) -> str:
            return f"{n / 2**30:.3f} GiB"
    else:
        def show(n: int) -> str:
            return f"{round(n / _SCALES[scale_name], 2)} {scale_name}"
    parts = [f"RSS {show(_rss_bytes())}"]
    if torch.cuda.is_available():
        parts.append(f"CUDA allocated {show(torch.cuda.memory_allocated())}, "
                     f"reserved {show(torch.cuda.memory_reserved())}")
    logger.warning("%s | %s", message, ", ".join(parts))
