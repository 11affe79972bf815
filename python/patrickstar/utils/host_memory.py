"""How much memory this process may use on the host."""
from __future__ import annotations

import os

__all__ = ["host_memory_limit"]


def host_memory_limit() -> tuple[int, str] | None:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        what = "this machine's memory"
    except (ValueError, OSError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < limit:
            limit, what = int(text), f"the cgroup limit ({path})"
        break
    return limit, what
