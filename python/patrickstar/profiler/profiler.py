"""Upstream PatrickStar's module path of its global recorder: `from patrickstar.profiler.profiler
import profiler` (its README imports `from patrickstar.profiler import profiler`, the same
object)."""
from __future__ import annotations

from ..profiling.upstream import profiler

__all__ = ["profiler"]
