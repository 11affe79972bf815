"""`patrickstar.profiler`: the profile recorder under its first import path; it lives in
`patrickstar.profiling.recorder`. A package, as upstream PatrickStar's was, so that upstream's
`from patrickstar.profiler.profiler import profiler` finds the same recorder."""
from __future__ import annotations

from .. import _upstream
from ..profiling.recorder import (Profiler, active_profiler, now_ns, optimizer_phase, profile,
                                 profiler_from_config)
# Upstream PatrickStar's global recorder, through the submodule first, so that the name is the
# recorder, not the submodule (importing a submodule later does not rebind it).
from .profiler import profiler
from ..profiling.upstream_format import TrainingStage

__all__ = ["Profiler", "profile", "active_profiler", "optimizer_phase", "profiler_from_config",
           "now_ns", "profiler", "TrainingStage"]


def __getattr__(name: str):
    return _upstream.missing_name(__name__, name)  # upstream's torch_profiler says what to use
