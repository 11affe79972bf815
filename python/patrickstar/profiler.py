"""`patrickstar.profiler`: the profile recorder under its first import path; it lives in
`patrickstar.profiling.recorder`."""
from __future__ import annotations

from . import _upstream
from .profiling.recorder import (Profiler, active_profiler, now_ns, optimizer_phase, profile,
                                 profiler_from_config)
from .profiling.upstream import profiler  # upstream PatrickStar's global recorder
from .profiling.upstream_format import TrainingStage

__all__ = ["Profiler", "profile", "active_profiler", "optimizer_phase", "profiler_from_config",
           "now_ns", "profiler", "TrainingStage"]



def __getattr__(name: str):
    return _upstream.missing_name(__name__, name)  # upstream's torch_profiler says what to use
