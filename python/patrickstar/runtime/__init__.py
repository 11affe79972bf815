"""Upstream PatrickStar's entry point: `from patrickstar.runtime import initialize_engine`.

The same objects as `patrickstar.initialize_engine` / `patrickstar.initialize`.
"""
from .. import PatrickStarEngine, initialize, initialize_engine

__all__ = ["PatrickStarEngine", "initialize", "initialize_engine"]
