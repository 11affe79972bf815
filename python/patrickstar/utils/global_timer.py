"""Upstream PatrickStar's `patrickstar.utils.global_timer`: `my_timer` and `data_move_cnter`,
which its example scripts start, print and reset around training steps.

`my_timer` times what the script names (`start_profile(key)` / `finish_profile(key)`) and, from
`start()`, the wall time of the span it prints. `data_move_cnter` counts what the script
`update`s and, in `print()`, the chunk bytes each engine copied into and out of each memory tier
since the last `reset()` (from `model.memory_stats()`: the runtime's own counters; upstream's
runtime called `update` itself). The per-phase breakdown upstream printed is the profiler's here
(`patrickstar.profile`: trace.json, summary.json).
"""
from __future__ import annotations

import time
import weakref

from .logging import logger

__all__ = ["DataMoveCnter", "GlobalTimer", "data_move_cnter", "my_timer", "watch"]

# Engines whose chunk traffic data_move_cnter reports (added by the engine; held weakly so a
# global never keeps an engine alive).
_engines: "weakref.WeakSet" = weakref.WeakSet()


def watch(engine) -> None:
    """Called by each engine at construction: data_move_cnter reports its chunk traffic."""
    _engines.add(engine)


class GlobalTimer:
    def __init__(self):
        self.elapse_stat: dict[str, float] = {}
        self.start_time: dict[str, float] = {}
        self._span_start: float | None = None

    def start(self) -> None:
        """Starts the span that `print()` reports."""
        self._span_start = time.perf_counter()

    def start_profile(self, key: str) -> None:
        if self.start_time.get(key):
            raise RuntimeError(f"my_timer.start_profile('{key}'): '{key}' is already started; "
                               f"call finish_profile('{key}') first")
        self.start_time[key] = time.perf_counter()

    def finish_profile(self, key: str) -> None:
        started = self.start_time.get(key)
        if not started:
            raise RuntimeError(f"my_timer.finish_profile('{key}'): '{key}' was not started")
        self.elapse_stat[key] = self.elapse_stat.get(key, 0.0) + time.perf_counter() - started
        self.start_time[key] = 0.0

    def reset(self) -> None:
        for key in self.elapse_stat:
            self.elapse_stat[key] = 0.0
        self._span_start = None

    def lines(self) -> list[str]:
        lines = []
        if self._span_start is not None:
            lines.append(f"span since my_timer.start(): "
                         f"{time.perf_counter() - self._span_start:.6f} s")
        total = sum(self.elapse_stat.values())
        for key, seconds in self.elapse_stat.items():
            share = seconds / total * 100 if total > 0 else 0.0
            lines.append(f"{key}, {seconds:.6f} s, {share:.1f} %")
        return lines

    def print(self) -> None:
        logger.info("*********** PROFILE RESULTS *************")
        for line in self.lines():
            logger.info(line)


class DataMoveCnter:
    def __init__(self):
        self.amount_dict: dict[str, int] = {}
        self.times_dict: dict[str, int] = {}
        self._baseline: dict[tuple[int, str], tuple[int, int]] = {}  # (id, tier) -> in, out

    def update(self, key_name: str, tensor_size: int) -> None:
        self.times_dict[key_name] = self.times_dict.get(key_name, 0) + 1
        self.amount_dict[key_name] = self.amount_dict.get(key_name, 0) + int(tensor_size)

    def _tier_traffic(self) -> list[tuple[tuple[int, int, str], int, int]]:
        traffic = []
        # Keyed by the engine's id (a WeakSet has no stable order), numbered in creation order.
        for number, engine in enumerate(sorted(_engines, key=lambda e: e.created_ns)):
            if getattr(engine, "chunks", None) is None:  # destroyed
                continue
            stats = engine.memory_stats()
            for tier in stats:
                traffic.append(((id(engine), number, tier["name"]), tier["bytes_in"],
                                tier["bytes_out"]))
        return traffic

    def reset(self) -> None:
        for key in self.times_dict:
            self.times_dict[key] = 0
            self.amount_dict[key] = 0
        self._baseline = {(key[0], key[2]): (bytes_in, bytes_out)
                          for key, bytes_in, bytes_out in self._tier_traffic()}

    def lines(self) -> list[str]:
        lines = []
        for key, times in self.times_dict.items():
            amount = self.amount_dict[key]
            seconds = my_timer.elapse_stat.get(key, 0.0)
            rate = f", {amount / seconds / 2**20:.1f} MB/s" if amount and seconds > 0 else ""
            lines.append(f"{key}: {amount / 2**20:.3f} MB, {times} times{rate}")
        for key, bytes_in, bytes_out in self._tier_traffic():
            engine_id, number, tier = key
            base_in, base_out = self._baseline.get((engine_id, tier), (0, 0))
            lines.append(f"engine {number} tier {tier}: {(bytes_in - base_in) / 2**20:.3f} MB "
                         f"in, {(bytes_out - base_out) / 2**20:.3f} MB out")
        return lines

    def print(self) -> None:
        logger.info("*********** DATA MOVE RESULTS *************")
        for line in self.lines():
            logger.info(line)


my_timer = GlobalTimer()
data_move_cnter = DataMoveCnter()
