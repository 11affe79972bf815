"""trace.json in the Chrome trace event format (Perfetto, chrome://tracing): compute phases,
waits, copy streams, NVMe IO, evictions and collectives on their own tracks, memory as counters."""
from __future__ import annotations

import collections
from typing import Any

from ..vocabulary import Tier
from .analysis import MiB, Analysis

__all__ = ["build_trace"]


def _lanes(intervals: list[tuple[int, int, Any]]) -> list[tuple[int, Any]]:
    """Greedy lane assignment so slices on one track never overlap without nesting."""
    lane_ends: list[int] = []
    placed = []
    for start, end, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        for lane, lane_end in enumerate(lane_ends):
            if lane_end <= start:
                lane_ends[lane] = end
                break
        else:
            lane = len(lane_ends)
            lane_ends.append(end)
        placed.append((lane, item))
    return placed


def build_trace(raw: dict, analysis: Analysis | None = None) -> dict:
    a = analysis or Analysis(raw)
    pid = int(raw["run"].get("rank", 0)) + 1
    t0 = a.start_ns

    def us(ns: int) -> float:
        return round((ns - t0) / 1000.0, 3)

    events: list[dict] = []
    threads: dict[str, int] = {}

    def tid(name: str) -> int:
        if name not in threads:
            threads[name] = len(threads) + 1
        return threads[name]

    def slice_(track: str, name: str, start: int, end: int, args: dict | None = None,
               category: str = "") -> None:
        events.append({"name": name, "cat": category or track, "ph": "X", "pid": pid,
                       "tid": tid(track), "ts": us(start), "dur": round((end - start) / 1000, 3),
                       "args": args or {}})

    compute = "compute"
    tid(compute)
    for it in a.iterations:
        slice_(compute, f"iteration {it['iteration']}", it["start_ns"], it["end_ns"],
               {k: it[k] for k in ("total_ns", "compute_ns", "move_wait_ns", "collective_ns",
                                   "optimizer_ns")}, "iteration")
        for phase, start, end in it["spans"]:
            slice_(compute, phase, start, end, {}, "phase")
    if a.incomplete is not None:  # the iteration the profile stopped inside
        it = a.incomplete
        slice_(compute, f"iteration {it['iteration']} (incomplete)", it["start_ns"],
               it["end_ns"], {}, "iteration")
    for phase, start, end in a.trailing_spans:
        slice_(compute, phase, start, end, {}, "phase")
    waits = "compute: waiting for copies"
    tid(waits)
    for e in a.copies:
        if e["wait_ns"] > 0:
            slice_(waits, f"wait {a.direction(e)}", e["end_ns"] - e["wait_ns"], e["end_ns"],
                   {"chunk": e["chunk"], "cause": e["cause"]}, "wait")
    # Copy streams and IO: one track per direction, lanes for copies in flight together.
    by_track: dict[str, list] = collections.defaultdict(list)
    for e in a.copies:
        io_copy = Tier.NVME in (a.tier_kinds[e["from_tier"]], a.tier_kinds[e["to_tier"]])
        track = f"{'IO' if io_copy else 'copy'} {a.direction(e)}"
        by_track[track].append((e["start_ns"], e["end_ns"], e))
    for track in sorted(by_track):
        for lane, e in _lanes(by_track[track]):
            slice_(f"{track} #{lane}", f"chunk {e['chunk']} ({e['cause']})", e["start_ns"],
                   e["end_ns"], {"chunk": e["chunk"], "kind": a.chunk_kind(e["chunk"]),
                                 "bytes": e["bytes"], "cause": e["cause"], "phase": e["phase"],
                                 "iteration": e["iteration"], "moment": e["moment"],
                                 "wait_ns": e["wait_ns"]}, "copy")
    evict_track = "evictions"
    for e in a.evictions:
        events.append({"name": f"evict chunk {e['chunk']}", "cat": "eviction", "ph": "i",
                       "s": "t", "pid": pid, "tid": tid(evict_track), "ts": us(e["start_ns"]),
                       "args": {"victim": e["chunk"], "victim_kind": a.chunk_kind(e["chunk"]),
                                "direction": a.direction(e), "bytes": e["bytes"],
                                "trigger": e["trigger"], "for_chunk": e["for_chunk"],
                                "next_use_distance": e["next_use_distance"],
                                "phase": e["phase"]}})
    # One track per kind of collective (allgather, reduce_scatter, all_reduce...): started
    # gathers overlap each other and the compute they hide behind.
    by_name: dict[str, list] = {}
    for c in raw["collectives"]:
        by_name.setdefault(c["name"], []).append((c["start_ns"], c["end_ns"], c))
    for name, coll in sorted(by_name.items()):
        for lane, c in _lanes(coll):
            wait_ns = c["end_ns"] - c.get("wait_start_ns", c["start_ns"])
            slice_(f"collectives {name} #{lane}", c["name"], c["start_ns"], c["end_ns"],
                   dict(c.get("args", {}), bytes=c["bytes"], phase=c["phase"],
                        wait_ns=wait_ns), "collective")
    counters = "memory"
    for r in a.rows:
        for t, name in enumerate(a.tier_names):
            events.append({"name": f"memory {name} (MiB)", "cat": "memory", "ph": "C",
                           "pid": pid, "tid": tid(counters), "ts": us(r["time_ns"]),
                           "args": {"model": round(r["model"][t] / MiB, 3),
                                    "non-model": round(r["non_model"][t] / MiB, 3)}})
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    metadata = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0,
                 "args": {"name": f"patrickstar rank {pid - 1}"}}]
    for name, number in threads.items():
        metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": number, "ts": 0,
                         "args": {"name": name}})
        metadata.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": number,
                         "ts": 0, "args": {"sort_index": number}})
    return {"traceEvents": metadata + events, "displayTimeUnit": "ms"}
