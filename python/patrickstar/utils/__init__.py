"""Helpers under upstream PatrickStar's names (`from patrickstar.utils import logger`).

`logger` is the package's logger; its level also sets the C++ runtime's log level, so
`logger.setLevel(logging.WARNING)` quiets both. The rest are small distributed and memory
helpers that upstream scripts call. Upstream helpers with no counterpart here fail on import
with a message naming what to use instead (patrickstar/_upstream.py).
"""
from .. import _upstream
from . import global_timer
from .distributed import get_local_world_size, get_rank, get_world_size
from .logging import log_dist, logger, print_rank
from .memory_monitor import get_sys_memory_used, see_memory_usage
from .model_size_calculator import get_ps_model_size

__all__ = ["get_local_world_size", "global_timer", "get_ps_model_size", "get_rank", "get_sys_memory_used",
           "get_world_size", "log_dist", "logger", "print_rank", "see_memory_usage"]


def __getattr__(name: str):
    return _upstream.missing_name(__name__, name)
