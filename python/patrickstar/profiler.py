"""`patrickstar.profiler`: the profile recorder under its first import path; it lives in
`patrickstar.profiling.recorder`."""
from __future__ import annotations

from .profiling.recorder import (Profiler, active_profiler, now_ns, optimizer_phase, profile,
                                 profiler_from_config)

__all__ = ["Profiler", "profile", "active_profiler", "optimizer_phase", "profiler_from_config",
           "now_ns"]


def __getattr__(name: str):
    # Upstream PatrickStar's scripts do `from patrickstar.profiler import profiler` (a global
    # recorder with start/end/save); say what replaces it (README, "Coming from PatrickStar").
    if name == "profiler":
        raise ImportError("patrickstar.profiler.profiler is upstream PatrickStar's global "
                          "recorder; here profile with `with patrickstar.profile(model, "
                          "'prof/'):` or config {'profile': {'enabled': true, 'output_dir': "
                          "...}}", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
