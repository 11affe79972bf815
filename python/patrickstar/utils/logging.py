"""The `patrickstar` logger, whose level is also the C++ runtime's (runtime/logging.h)."""
from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from .. import _C

__all__ = ["RuntimeLogger", "log_dist", "logger", "print_rank"]

# Python level -> the runtime's level names (it has no CRITICAL).
_RUNTIME_LEVELS = ((logging.ERROR, "error"), (logging.WARNING, "warning"), (logging.INFO, "info"),
                   (logging.DEBUG, "debug"))


class RuntimeLogger(logging.Logger):
    """A logger whose `setLevel` also sets the level of the C++ runtime's messages."""

    def setLevel(self, level) -> None:  # noqa: N802 (logging's name)
        super().setLevel(level)
        effective = self.getEffectiveLevel()
        name = next((name for threshold, name in _RUNTIME_LEVELS if effective >= threshold),
                    "debug")
        _C.set_log_level(name)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted (as logging's last-resort
    handler does), so redirecting or capturing stderr later still catches the messages."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        del value


def _make_logger() -> logging.Logger:
    previous = logging.getLoggerClass()
    logging.setLoggerClass(RuntimeLogger)
    try:
        result = logging.getLogger("patrickstar")
    finally:
        logging.setLoggerClass(previous)
    if not result.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[patrickstar %(levelname)s] %(message)s"))
        result.addHandler(handler)
        result.propagate = False
    return result


logger = _make_logger()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(message: str, ranks=(0,), level: int = logging.INFO) -> None:
    """Logs `message` on the given ranks only (`ranks=[-1]`: every rank)."""
    ranks = list(ranks) if ranks is not None else [0]
    if -1 in ranks or _rank() in ranks:
        logger.log(level, "[Rank %d] %s", _rank(), message)


def print_rank(message: str, rank: int = 0, debug: bool = False, force: bool = False) -> None:
    """Prints `message` on `rank` only; with `debug=True` only when the logger is at DEBUG or
    `force` is set."""
    if debug and not force and not logger.isEnabledFor(logging.DEBUG):
        return
    if _rank() == rank:
        print(f"[Rank {rank}] {message}", flush=True)
