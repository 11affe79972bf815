"""Turns a profile's raw record (profile.json, written by profiler.py) into the outputs:

* ``trace.json``: Chrome trace event format (Perfetto, chrome://tracing): compute phases, waits,
  copy streams, NVMe IO, evictions and collectives on their own tracks, memory as counters;
* ``memory.csv``: one row per moment (model data, non-model data, budget and bytes moved so far,
  per tier);
* ``summary.json``: peaks per tier, totals moved, prefetch hit rate, the largest non-model-data
  moment, chunk size and wasted bytes, the time split per iteration, findings;
* ``report.html``: one self-contained page (inline SVG and a little JS, nothing fetched).

Also the ``patrickstar-report`` command: ``patrickstar-report DIR`` prints the summary and
regenerates report.html; ``patrickstar-report --compare DIR_A DIR_B`` prints two runs side by
side.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import csv
import html
import io
import json
import math
import os
import sys
from typing import Any, Iterable

__all__ = ["ProfileError", "load_raw", "write_outputs", "build_summary", "build_trace",
           "memory_rows", "render_html", "main", "OUTPUT_FILES"]

RAW_FILE = "profile.json"
OUTPUT_FILES = ("trace.json", "memory.csv", "summary.json", "report.html")
MiB = 1 << 20
_RAW_KEYS = ("start_ns", "stop_ns", "run", "tiers", "stats_start", "stats_end", "layout",
             "events", "samples", "marks", "phases", "collectives")
_TIER_COLORS = {"device": "#d62728", "host": "#1f77b4", "nvme": "#2ca02c", None: "#eeeeee"}
_BUDGET_KEYS = {"device": "memory.device_budget", "host": "memory.host_budget",
                "nvme": "memory.nvme.budget"}
# A constrained tier whose waits exceed this share of step time is called a bottleneck.
_BOTTLENECK_SHARE = 0.05


class ProfileError(ValueError):
    """A profile directory that is missing, incomplete or unreadable (the message names it)."""


# ---- Loading -----------------------------------------------------------------------------------

def load_raw(directory: str | os.PathLike) -> dict:
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ProfileError(f"profile directory '{directory}' does not exist")
    path = os.path.join(directory, RAW_FILE)
    if not os.path.isfile(path):
        raise ProfileError(f"'{path}' is missing: '{directory}' is not a complete profile "
                           f"(patrickstar.profile() writes it with the other outputs)")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except json.JSONDecodeError as error:
        raise ProfileError(f"'{path}' is not valid JSON ({error}); the profile is incomplete")
    missing = [key for key in _RAW_KEYS if key not in raw]
    if missing:
        raise ProfileError(f"'{path}' is incomplete: missing {', '.join(missing)}")
    return raw


# ---- Analysis shared by every output -----------------------------------------------------------

def _events(raw: dict) -> list[dict]:
    columns = raw["events"]
    if not columns:
        return []
    keys = list(columns)
    return [dict(zip(keys, values)) for values in zip(*(columns[k] for k in keys))]


def _effective_ns(event: dict) -> int:
    return event["end_ns"] if event["type"] == "copy" else event["start_ns"]


class _Analysis:
    """Everything the outputs share, computed once from the raw record."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.start_ns = raw["start_ns"]
        self.tiers = raw["tiers"]
        self.tier_names = [t["name"] for t in self.tiers]
        self.tier_kinds = [t["kind"] for t in self.tiers]
        self.events = sorted(_events(raw), key=_effective_ns)
        self.copies = [e for e in self.events if e["type"] == "copy" and e["ok"]]
        self.evictions = [e for e in self.events if e["type"] == "eviction"]
        self.chunks = {c["id"]: c for c in raw["layout"].get("chunks", [])}
        self._rows()
        self._iterations()

    def tier_label(self, index: int) -> str:
        return "nowhere" if index < 0 else self.tier_names[index]

    def direction(self, event: dict) -> str:
        return f"{self.tier_label(event['from_tier'])}->{self.tier_label(event['to_tier'])}"

    def chunk_kind(self, chunk: int) -> str:
        info = self.chunks.get(chunk)
        return info["kind"] if info else "?"

    def _rows(self) -> None:
        samples = self.raw["samples"]
        marks = self.raw["marks"]
        count = len(samples.get("time_ns", []))
        device = self.raw.get("device_tier")
        joined = len(marks) == count and all(
            (m["kind"] == "end") == bool(samples["end_of_iteration"][i])
            for i, m in enumerate(marks))
        copy_ends = [e["end_ns"] for e in self.copies]
        cumulative_in = [[0] * len(self.tiers)]
        cumulative_out = [[0] * len(self.tiers)]
        for event in self.copies:
            moved_in = list(cumulative_in[-1])
            moved_out = list(cumulative_out[-1])
            moved_in[event["to_tier"]] += event["bytes"]
            moved_out[event["from_tier"]] += event["bytes"]
            cumulative_in.append(moved_in)
            cumulative_out.append(moved_out)
        self.rows = []
        for i in range(count):
            time_ns = samples["time_ns"][i]
            done = bisect.bisect_right(copy_ends, time_ns)
            mark = marks[i] if joined else {"event": "", "measured_non_model": 0}
            planned = samples["non_model_bytes"][i]
            non_model = list(planned)
            if device is not None and device < len(non_model):
                non_model[device] = max(non_model[device], mark["measured_non_model"])
            self.rows.append({
                "iteration": samples["iteration"][i], "moment": samples["moment"][i],
                "end_of_iteration": bool(samples["end_of_iteration"][i]), "time_ns": time_ns,
                "event": mark["event"], "model": samples["chunk_bytes"][i],
                "non_model": non_model, "planned_non_model": planned,
                "budget": samples["budget_bytes"][i], "bytes_in": cumulative_in[done],
                "bytes_out": cumulative_out[done]})

    def _iterations(self) -> None:
        """Complete iterations (ended inside the profile) with their time split."""
        marks = self.raw["marks"]
        ends = [m for m in marks if m["kind"] == "end"]
        end_rows = [r for r in self.rows if r["end_of_iteration"]]
        # Copies (sorted by end) and marks (recorded in time order) are sliced by bisection, so
        # long profiles stay linear.
        copy_ends = [e["end_ns"] for e in self.copies]
        mark_times = [m["time_ns"] for m in marks]
        self.iterations = []
        begin = self.start_ns
        for index, mark in enumerate(ends):
            end = mark["time_ns"]
            number = end_rows[index]["iteration"] if index < len(end_rows) else index
            waits = self.copies[bisect.bisect_right(copy_ends, begin):
                                bisect.bisect_right(copy_ends, end)]
            move_wait = sum(e["wait_ns"] for e in waits)
            collectives = [c for c in self.raw["collectives"]
                           if c["end_ns"] > begin and c["start_ns"] < end]
            coll = sum(_overlap(c["start_ns"], c["end_ns"], begin, end) for c in collectives)
            opt_span = sum(_overlap(p["start_ns"], p["end_ns"], begin, end)
                           for p in self.raw["phases"] if p["name"] == "optimizer")
            opt_inner = sum(e["wait_ns"] for e in waits if e["phase"] == "optimizer") + sum(
                _overlap(c["start_ns"], c["end_ns"], begin, end) for c in collectives
                if c["phase"] == "optimizer")
            optimizer = max(0, opt_span - opt_inner)
            total = end - begin
            compute = max(0, total - move_wait - coll - optimizer)
            in_window = marks[bisect.bisect_right(mark_times, begin):
                              bisect.bisect_right(mark_times, end)]
            spans = _phase_runs([m for m in in_window if m["kind"] == "tick"])
            spans += [("optimizer", max(begin, p["start_ns"]), min(end, p["end_ns"]))
                      for p in self.raw["phases"]
                      if p["name"] == "optimizer" and _overlap(p["start_ns"], p["end_ns"],
                                                                begin, end)]
            self.iterations.append({
                "iteration": number, "start_ns": begin, "end_ns": end, "total_ns": total,
                "compute_ns": compute, "move_wait_ns": move_wait, "collective_ns": coll,
                "optimizer_ns": optimizer, "spans": spans,
                "move_bytes": sum(e["bytes"] for e in waits)})
            begin = end

    def steady_iterations(self) -> list[dict]:
        """Iterations after warm-up (iteration 0) when there are others."""
        later = [it for it in self.iterations if it["iteration"] > 0]
        return later or self.iterations

    def locations(self, rows: list[dict]) -> dict[int, list[int]]:
        """Tier index (-1: no payload) of every chunk at each of `rows` (in time order)."""
        by_name = {name: i for i, name in enumerate(self.tier_names)}
        where = {cid: by_name.get(c.get("tier"), -1) for cid, c in self.chunks.items()}
        result = {cid: [] for cid in self.chunks}
        position = 0
        for row in rows:
            while (position < len(self.events)
                   and _effective_ns(self.events[position]) <= row["time_ns"]):
                event = self.events[position]
                position += 1
                if event["type"] == "copy" and event["ok"]:
                    where[event["chunk"]] = event["to_tier"]
                elif event["type"] == "zero_fill":
                    where[event["chunk"]] = event["to_tier"]
                elif event["type"] == "drop":
                    where[event["chunk"]] = -1
            for cid in result:
                result[cid].append(where.get(cid, -1))
        return result


def _phase_runs(ticks: list[dict]) -> list[tuple[str, int, int]]:
    """(phase, first tick, last tick) of each run of consecutive forward or backward ticks."""
    runs: list[list] = []
    for tick in ticks:
        phase = {"pre_forward": "forward", "post_forward": "forward",
                 "pre_backward": "backward", "post_backward": "backward"}.get(tick["event"])
        if phase is None:
            continue
        if runs and runs[-1][0] == phase:
            runs[-1][2] = tick["time_ns"]
        else:
            runs.append([phase, tick["time_ns"], tick["time_ns"]])
    return [tuple(run) for run in runs]


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _stat_delta(raw: dict, tier: int, key: str) -> int:
    return raw["stats_end"][tier].get(key, 0) - raw["stats_start"][tier].get(key, 0)


# ---- memory.csv --------------------------------------------------------------------------------

def memory_rows(raw: dict, analysis: _Analysis | None = None) -> tuple[list[str], list[list]]:
    """The header and rows of memory.csv: one row per closed moment."""
    a = analysis or _Analysis(raw)
    header = ["iteration", "moment", "end_of_iteration", "time_ms", "event"]
    for kind in a.tier_kinds:
        header += [f"{kind}_model_bytes", f"{kind}_non_model_bytes",
                   f"{kind}_planned_non_model_bytes", f"{kind}_budget_bytes",
                   f"{kind}_bytes_in_total", f"{kind}_bytes_out_total"]
    rows = []
    for r in a.rows:
        row = [r["iteration"], r["moment"], int(r["end_of_iteration"]),
               round((r["time_ns"] - a.start_ns) / 1e6, 4), r["event"]]
        for t in range(len(a.tiers)):
            row += [r["model"][t], r["non_model"][t], r["planned_non_model"][t], r["budget"][t],
                    r["bytes_in"][t], r["bytes_out"][t]]
        rows.append(row)
    return header, rows


# ---- trace.json --------------------------------------------------------------------------------

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


def build_trace(raw: dict, analysis: _Analysis | None = None) -> dict:
    a = analysis or _Analysis(raw)
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
    last_end = a.iterations[-1]["end_ns"] if a.iterations else a.start_ns
    for p in raw["phases"]:  # the parts of phases after the last complete iteration
        if p["end_ns"] > last_end:
            slice_(compute, p["name"], max(p["start_ns"], last_end), p["end_ns"], {}, "phase")
    waits = "compute: waiting for copies"
    tid(waits)
    for e in a.copies:
        if e["wait_ns"] > 0:
            slice_(waits, f"wait {a.direction(e)}", e["end_ns"] - e["wait_ns"], e["end_ns"],
                   {"chunk": e["chunk"], "cause": e["cause"]}, "wait")
    # Copy streams and IO: one track per direction, lanes for copies in flight together.
    by_track: dict[str, list] = collections.defaultdict(list)
    for e in a.copies:
        io_copy = "nvme" in (a.tier_kinds[e["from_tier"]], a.tier_kinds[e["to_tier"]])
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
    coll = [(c["start_ns"], c["end_ns"], c) for c in raw["collectives"]]
    for lane, c in _lanes(coll):
        slice_(f"collectives #{lane}", c["name"], c["start_ns"], c["end_ns"],
               dict(c.get("args", {}), bytes=c["bytes"], phase=c["phase"]), "collective")
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


# ---- summary.json ------------------------------------------------------------------------------

def build_summary(raw: dict, analysis: _Analysis | None = None) -> dict:
    a = analysis or _Analysis(raw)
    tiers = {}
    for t, info in enumerate(a.tiers):
        model = [r["model"][t] for r in a.rows] or [0]
        non_model = [r["non_model"][t] for r in a.rows] or [0]
        total = [r["model"][t] + r["non_model"][t] for r in a.rows] or [0]
        tiers[info["name"]] = {
            "kind": info["kind"], "budget_bytes": info["budget_bytes"],
            "peak_model_bytes": max(model), "peak_non_model_bytes": max(non_model),
            "peak_total_bytes": max(total),
            "bytes_in": _stat_delta(raw, t, "bytes_in"),
            "bytes_out": _stat_delta(raw, t, "bytes_out"),
            "evictions": _stat_delta(raw, t, "evictions"),
            "copy_wait_s": _stat_delta(raw, t, "copy_wait_ns") / 1e9}
    by_direction: dict[str, int] = collections.Counter()
    by_cause: dict[str, int] = collections.Counter()
    for e in a.copies:
        by_direction[a.direction(e)] += e["bytes"]
        by_cause[e["cause"]] += e["bytes"]
    issued = sum(_stat_delta(raw, t, "prefetch_issued") for t in range(len(a.tiers)))
    hits = sum(_stat_delta(raw, t, "prefetch_hits") for t in range(len(a.tiers)))
    misses = sum(_stat_delta(raw, t, "prefetch_misses") for t in range(len(a.tiers)))
    largest = None
    for r in a.rows:
        for t, name in enumerate(a.tier_names):
            if largest is None or r["non_model"][t] > largest["bytes"]:
                largest = {"bytes": r["non_model"][t], "tier": name, "iteration": r["iteration"],
                           "moment": r["moment"], "event": r["event"]}
    layout = raw["layout"]
    chunk_bytes_total = sum(c.get("bytes", 0) for c in layout.get("chunks", []))
    iterations = [{k: (v / 1e9 if k.endswith("_ns") else v) for k, v in it.items()
                   if k not in ("spans", "start_ns", "end_ns")} for it in a.iterations]
    iterations = [{k.replace("_ns", "_s"): v for k, v in it.items()} for it in iterations]
    steady = a.steady_iterations()
    mean = {}
    if steady:
        for key in ("total_ns", "compute_ns", "move_wait_ns", "collective_ns", "optimizer_ns"):
            mean[key.replace("_ns", "_s")] = sum(it[key] for it in steady) / len(steady) / 1e9
        mean["move_bytes"] = sum(it["move_bytes"] for it in steady) / len(steady)
    summary = {
        "version": 1,
        "run": dict(raw["run"], iterations=len(a.iterations), moments=len(a.rows),
                    duration_s=(raw["stop_ns"] - raw["start_ns"]) / 1e9,
                    non_model_measure=raw.get("non_model_measure", "")),
        "tiers": tiers,
        "moves": {"count": len(a.copies), "bytes": sum(e["bytes"] for e in a.copies),
                  "wait_s": sum(e["wait_ns"] for e in a.copies) / 1e9,
                  "by_direction": dict(by_direction), "by_cause": dict(by_cause),
                  "zero_fills": sum(1 for e in a.events if e["type"] == "zero_fill"),
                  "drops": sum(1 for e in a.events if e["type"] == "drop")},
        "prefetch": {"issued": issued, "hits": hits, "misses": misses,
                     "hit_rate": hits / (hits + misses) if hits + misses else None},
        "largest_non_model_moment": largest,
        "chunks": {"chunk_elements": layout.get("chunk_elements"),
                   "num_chunks": len(layout.get("chunks", [])),
                   "model_data_bytes": chunk_bytes_total,
                   "wasted_bytes": layout.get("wasted_bytes", 0),
                   "oversize_tensors": layout.get("oversize_tensors", [])},
        "evictions": {"count": len(a.evictions), "bytes": sum(e["bytes"] for e in a.evictions),
                      "top_causes": _eviction_causes(a)[:10]},
        "collectives": {"count": len(raw["collectives"]),
                        "bytes": sum(c["bytes"] for c in raw["collectives"]),
                        "time_s": sum(c["end_ns"] - c["start_ns"]
                                      for c in raw["collectives"]) / 1e9},
        "time": {"iterations": iterations, "steady_state_mean": mean},
        "dropped_events": raw.get("dropped", 0),
    }
    summary["findings"] = _findings(a, summary)
    return summary


def _eviction_causes(a: _Analysis) -> list[dict]:
    groups: dict[tuple, dict] = {}
    for e in a.evictions:
        for_kind = a.chunk_kind(e["for_chunk"]) if e["for_chunk"] >= 0 else None
        key = (e["phase"], e["trigger"], for_kind, a.chunk_kind(e["chunk"]), a.direction(e))
        group = groups.setdefault(key, {"count": 0, "bytes": 0, "distances": []})
        group["count"] += 1
        group["bytes"] += e["bytes"]
        if e["next_use_distance"] >= 0:
            group["distances"].append(e["next_use_distance"])
    rows = []
    for (phase, trigger, for_kind, victim_kind, direction), g in groups.items():
        if trigger == "access":
            why = f"accessing {for_kind} chunks"
        elif trigger == "budget":
            why = "keeping room for non-model data at a moment"
        elif trigger == "gather":
            why = f"gathering {for_kind} chunks"
        elif trigger == "explicit":
            why = "an explicit move"
        else:
            why = "making room"
        distance = (sum(g["distances"]) / len(g["distances"])) if g["distances"] else None
        rows.append({"phase": phase, "trigger": trigger, "for_kind": for_kind,
                     "victim_kind": victim_kind, "direction": direction, "count": g["count"],
                     "bytes": g["bytes"], "mean_next_use_distance": distance,
                     "description": f"{phase}: {why} moved {victim_kind} chunks {direction}"})
    rows.sort(key=lambda r: (-r["count"], -r["bytes"]))
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f} MiB"


def _mib_up(nbytes: float) -> str:
    return f"{math.ceil(nbytes / MiB * 10) / 10:.1f} MiB"


def _tier_need(a: _Analysis, tier: int) -> int | None:
    """Bytes `tier` needs so that one steady iteration makes no copies into or out of it: every
    chunk it holds or receives during the iteration, plus its peak non-model data then."""
    steady = a.steady_iterations()
    if not steady:
        return None
    last = steady[-1]
    rows = [r for r in a.rows if last["start_ns"] < r["time_ns"] <= last["end_ns"]]
    chunks = set()
    for chunk, places in a.locations(rows).items():
        if tier in places:
            chunks.add(chunk)
    for e in a.events:
        if (e["type"] in ("copy", "zero_fill") and e["to_tier"] == tier
                and last["start_ns"] < _effective_ns(e) <= last["end_ns"]):
            chunks.add(e["chunk"])
    # Only the non-model data the manager was told about shares the budget with chunks.
    non_model = max((r["planned_non_model"][tier] for r in rows), default=0)
    return sum(a.chunks[c].get("bytes", 0) for c in chunks if c in a.chunks) + non_model


def _findings(a: _Analysis, summary: dict) -> list[str]:
    findings = []
    mean = summary["time"]["steady_state_mean"]
    total = mean.get("total_s", 0.0)
    steady = a.steady_iterations()
    window = (steady[0]["start_ns"], steady[-1]["end_ns"]) if steady else None
    if total > 0 and window:
        # Waits attributed to the faster tier of each copy: that tier had no room to keep it.
        waits: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for e in a.copies:
            if window[0] < e["end_ns"] <= window[1]:
                waits[min(e["from_tier"], e["to_tier"])][a.direction(e)] += e["wait_ns"]
        per_iteration = 1e9 * len(steady)
        for tier, directions in sorted(waits.items()):
            share = sum(directions.values()) / per_iteration / total
            if share < _BOTTLENECK_SHARE:
                continue
            kind = a.tier_kinds[tier]
            budget = a.tiers[tier]["budget_bytes"]
            main_direction = directions.most_common(1)[0][0]
            text = (f"{kind} budget is the bottleneck: {share:.0%} of step time waits for "
                    f"{main_direction} copies")
            need = _tier_need(a, tier)
            if budget and need is not None and need > budget:
                text += (f"; raising {_BUDGET_KEYS.get(kind, 'its budget')} by "
                         f"{_mib_up(need - budget)} (to {_mib_up(need)}) removes them")
            elif not budget:
                text += " (the tier has no budget: these are first placements)"
            findings.append(text + ".")
        for key, label in (("optimizer_s", "the optimizer step"),
                           ("collective_s", "waiting for collectives")):
            share = mean.get(key, 0.0) / total
            if share >= 0.2:
                findings.append(f"{label} takes {share:.0%} of step time "
                                f"({mean[key] * 1e3:.1f} ms per iteration).")
    prefetch = summary["prefetch"]
    if prefetch["hit_rate"] is not None:
        if prefetch["issued"] == 0:
            findings.append(f"prefetching is off (prefetch_moments = "
                            f"{a.raw['run'].get('prefetch_moments', 0)}) or never had room: "
                            f"{prefetch['misses']} accesses after warm-up copied synchronously.")
        else:
            findings.append(f"prefetch hit rate {prefetch['hit_rate']:.0%}: {prefetch['hits']} "
                            f"of {prefetch['hits'] + prefetch['misses']} accesses that needed a "
                            f"copy after warm-up found it done ahead of time.")
    largest = summary["largest_non_model_moment"]
    if largest and largest["bytes"] > 0:
        findings.append(f"largest non-model data: {_mib(largest['bytes'])} on {largest['tier']} "
                        f"at iteration {largest['iteration']}, moment {largest['moment']}"
                        f"{' (' + largest['event'] + ')' if largest['event'] else ''}.")
    for t, name in enumerate(a.tier_names):
        measured = max((r["non_model"][t] for r in a.rows), default=0)
        planned = max((r["planned_non_model"][t] for r in a.rows), default=0)
        if measured > planned and measured >= MiB:
            findings.append(f"{name}: {_mib(measured)} of non-model data was measured "
                            f"({a.raw.get('non_model_measure', 'measured')}) but the manager "
                            f"planned with {_mib(planned)}; its budget does not leave room "
                            f"for the difference.")
    chunks = summary["chunks"]
    if chunks["model_data_bytes"]:
        waste = chunks["wasted_bytes"] / chunks["model_data_bytes"]
        if waste >= 0.1:
            findings.append(f"chunks waste {_mib(chunks['wasted_bytes'])} ({waste:.0%} of model "
                            f"data) at {chunks['chunk_elements']} elements per chunk; "
                            f"default_chunk_size \"auto\" searches for a tighter size.")
    top = summary["evictions"]["top_causes"]
    if top:
        findings.append(f"{summary['evictions']['count']} evictions moved "
                        f"{_mib(summary['evictions']['bytes'])}; most often "
                        f"{top[0]['description']} ({top[0]['count']} times).")
    if summary["dropped_events"]:
        findings.append(f"{summary['dropped_events']} events were dropped (the log was full): "
                        f"totals from events undercount; raise the profiler's capacity.")
    if not a.iterations:
        findings.append("no complete iteration was recorded: run at least one optimizer.step() "
                        "inside the profile for time splits and bottlenecks.")
    if not any("bottleneck" in f for f in findings) and total > 0:
        compute = mean.get("compute_s", 0.0) / total
        findings.insert(0, f"no memory bottleneck: compute is {compute:.0%} of step time, "
                           f"waiting for copies {mean.get('move_wait_s', 0.0) / total:.0%}.")
    return findings


# ---- report.html -------------------------------------------------------------------------------

def _svg_memory_panels(a: _Analysis, width: int = 1100) -> str:
    rows = a.rows
    if not rows:
        return "<p>No moments were recorded.</p>"
    panels = []
    height, left, top, bottom = 170, 70, 20, 30
    plot_w = width - left - 20
    n = len(rows)

    def x(i: int) -> float:
        return left + (plot_w * i / max(1, n - 1))

    for t, name in enumerate(a.tier_names):
        model = [r["model"][t] for r in rows]
        non_model = [r["non_model"][t] for r in rows]
        budget = a.tiers[t]["budget_bytes"]
        peak = max([m + nm for m, nm in zip(model, non_model)] + [budget, 1])
        scale = (height - top - bottom) / peak

        def y(v: float) -> float:
            return height - bottom - v * scale

        base = f"{x(0):.1f},{y(0):.1f} " + " ".join(
            f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(model)) + f" {x(n - 1):.1f},{y(0):.1f}"
        stacked = [m + nm for m, nm in zip(model, non_model)]
        upper = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(stacked))
        lower = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in reversed(list(enumerate(model))))
        parts = [f'<svg class="chart" width="{width}" height="{height}" '
                 f'viewBox="0 0 {width} {height}" role="img">',
                 f'<text x="{left}" y="14" class="title">{html.escape(name)} '
                 f'({a.tier_kinds[t]})</text>',
                 f'<polygon points="{base}" fill="{_TIER_COLORS.get(a.tier_kinds[t])}" '
                 f'fill-opacity="0.75"><title>model data</title></polygon>',
                 f'<polygon points="{upper} {lower}" fill="#ff7f0e" fill-opacity="0.6">'
                 f'<title>non-model data</title></polygon>']
        if budget:
            parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(budget):.1f}" '
                         f'y2="{y(budget):.1f}" stroke="black" stroke-dasharray="6,4">'
                         f'<title>budget {_mib(budget)}</title></line>'
                         f'<text x="{left + plot_w - 4}" y="{y(budget) - 4:.1f}" '
                         f'text-anchor="end" class="small">budget {_mib(budget)}</text>')
        for frac in (0, 0.5, 1):
            value = peak * frac
            parts.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" text-anchor="end" '
                         f'class="small">{value / MiB:.0f} MiB</text>')
        for i, r in enumerate(rows):
            if r["end_of_iteration"]:
                parts.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top}" '
                             f'y2="{height - bottom}" stroke="#999" stroke-width="0.5"/>')
        parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" '
                     f'class="small">moment ({n} closed moments; grey lines end iterations)'
                     f'</text></svg>')
        panels.append("".join(parts))
    legend = ('<p class="legend"><span style="background:#d62728"></span>device model data '
              '<span style="background:#1f77b4"></span>host model data '
              '<span style="background:#2ca02c"></span>NVMe model data '
              '<span style="background:#ff7f0e"></span>non-model data '
              '<span class="dash"></span>budget</p>')
    return legend + "\n".join(panels)


def _svg_heatmap(a: _Analysis, max_columns: int = 400, max_chunks: int = 256,
                 width: int = 1100) -> str:
    rows = a.rows[-max_columns:]
    if not rows or not a.chunks:
        return "<p>No chunk locations to show.</p>"
    locations = a.locations(rows)
    chunk_ids = sorted(a.chunks)[:max_chunks]
    left, top = 150, 10
    cell_h = max(3, min(14, 600 // max(1, len(chunk_ids))))
    plot_w = width - left - 10
    cell_w = plot_w / len(rows)
    height = top + cell_h * len(chunk_ids) + 30
    parts = [f'<svg id="heatmap" class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for row_index, cid in enumerate(chunk_ids):
        info = a.chunks[cid]
        y = top + row_index * cell_h
        label = f"chunk {cid} {info.get('kind', '')}"
        if cell_h >= 8:
            parts.append(f'<text x="{left - 4}" y="{y + cell_h - 2}" text-anchor="end" '
                         f'class="small">{html.escape(label)}</text>')
        places = locations[cid]
        start = 0
        for i in range(1, len(places) + 1):
            if i == len(places) or places[i] != places[start]:
                tier = places[start]
                kind = a.tier_kinds[tier] if tier >= 0 else None
                where = a.tier_label(tier)
                parts.append(f'<rect class="cell" x="{left + start * cell_w:.2f}" y="{y}" '
                             f'width="{(i - start) * cell_w:.2f}" height="{cell_h - 0.5}" '
                             f'fill="{_TIER_COLORS.get(kind, "#999")}" data-chunk="{cid}" '
                             f'data-where="{html.escape(where)}"><title>{html.escape(label)}: '
                             f'{html.escape(where)}</title></rect>')
                start = i
    first, last = rows[0], rows[-1]
    parts.append(f'<text x="{left}" y="{height - 8}" class="small">iteration {first["iteration"]}'
                 f' moment {first["moment"]}</text><text x="{left + plot_w}" y="{height - 8}" '
                 f'text-anchor="end" class="small">iteration {last["iteration"]} moment '
                 f'{last["moment"]}</text></svg>')
    note = ""
    if len(a.chunks) > max_chunks or len(a.rows) > max_columns:
        note = (f'<p class="small">Showing {len(chunk_ids)} of {len(a.chunks)} chunks and the '
                f'last {len(rows)} of {len(a.rows)} moments.</p>')
    legend = ('<p class="legend"><span style="background:#d62728"></span>device '
              '<span style="background:#1f77b4"></span>host '
              '<span style="background:#2ca02c"></span>NVMe '
              '<span style="background:#eeeeee"></span>no payload</p>')
    return legend + note + "".join(parts) + '<p id="heat-info" class="small">&nbsp;</p>'


def _svg_time_split(a: _Analysis, width: int = 1100) -> str:
    its = a.iterations
    if not its:
        return "<p>No complete iteration was recorded.</p>"
    keys = [("compute_ns", "compute", "#7f7f7f"), ("move_wait_ns", "waiting for moves", "#d62728"),
            ("collective_ns", "waiting for collectives", "#9467bd"),
            ("optimizer_ns", "optimizer", "#17becf")]
    left, bar_h = 90, 16
    plot_w = width - left - 80  # room for the total after the longest bar
    longest = max(it["total_ns"] for it in its) or 1
    shown = its[-40:]
    height = 10 + len(shown) * (bar_h + 4) + 10
    parts = [f'<svg class="chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    for row, it in enumerate(shown):
        y = 10 + row * (bar_h + 4)
        parts.append(f'<text x="{left - 6}" y="{y + bar_h - 4}" text-anchor="end" '
                     f'class="small">iteration {it["iteration"]}</text>')
        x = left
        for key, label, color in keys:
            w = plot_w * it[key] / longest
            if w > 0:
                parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" '
                             f'fill="{color}"><title>{label}: {it[key] / 1e6:.2f} ms'
                             f'</title></rect>')
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + bar_h - 4}" class="small">'
                     f'{it["total_ns"] / 1e6:.1f} ms</text>')
    parts.append("</svg>")
    legend = '<p class="legend">' + " ".join(
        f'<span style="background:{c}"></span>{label}' for _, label, c in keys) + "</p>"
    return legend + "".join(parts)


def _table(headers: list[str], rows: Iterable[list], table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    head = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table class="sortable"{ident}>{head}<tbody>{body}</tbody></table>'


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#222;max-width:1150px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3;cursor:pointer}
.small{font-size:11px;fill:#444;color:#444}.title{font-size:13px;font-weight:600}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;
vertical-align:middle}.legend .dash{border-top:2px dashed #000;height:0;width:18px}
.findings li{margin:4px 0}.chart{display:block;margin:6px 0}
"""

_SCRIPT = """
(function(){
  var info=document.getElementById('heat-info');
  var heat=document.getElementById('heatmap');
  if(heat&&info){heat.addEventListener('mouseover',function(ev){
    var t=ev.target;if(t&&t.dataset&&t.dataset.chunk!==undefined){
      info.textContent='chunk '+t.dataset.chunk+': '+t.dataset.where;}});}
  var tables=document.querySelectorAll('table.sortable');
  tables.forEach(function(table){
    table.querySelectorAll('th').forEach(function(th,col){
      th.addEventListener('click',function(){
        var body=table.tBodies[0];var rows=Array.prototype.slice.call(body.rows);
        var asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
        rows.sort(function(a,b){var x=a.cells[col].textContent,y=b.cells[col].textContent;
          var nx=parseFloat(x),ny=parseFloat(y);
          var c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;});
        rows.forEach(function(r){body.appendChild(r);});});});});
  var ready=document.createElement('div');ready.id='report-ready';
  ready.setAttribute('data-charts',String(document.querySelectorAll('svg.chart').length));
  document.body.appendChild(ready);
})();
"""


def render_html(raw: dict, summary: dict, analysis: _Analysis | None = None) -> str:
    a = analysis or _Analysis(raw)
    run = summary["run"]
    findings = "".join(f"<li>{html.escape(f)}</li>" for f in summary["findings"])
    tier_rows = [[name, t["kind"], _mib(t["budget_bytes"]) if t["budget_bytes"] else "unlimited",
                  _mib(t["peak_model_bytes"]), _mib(t["peak_non_model_bytes"]),
                  _mib(t["peak_total_bytes"]), _mib(t["bytes_in"]), _mib(t["bytes_out"]),
                  t["evictions"]] for name, t in summary["tiers"].items()]
    eviction_rows = [[r["description"], r["count"], _mib(r["bytes"]),
                      "-" if r["mean_next_use_distance"] is None
                      else f"{r['mean_next_use_distance']:.1f}"]
                     for r in summary["evictions"]["top_causes"]]
    mean = summary["time"]["steady_state_mean"]
    split = ", ".join(f"{label} {mean.get(key, 0) * 1e3:.1f} ms"
                      for key, label in (("compute_s", "compute"),
                                         ("move_wait_s", "waiting for moves"),
                                         ("collective_s", "collectives"),
                                         ("optimizer_s", "optimizer")))
    hit = summary["prefetch"]["hit_rate"]
    chunks = summary["chunks"]
    facts = _table(["", ""], [
        ["precision / device", f"{run.get('precision')} / {run.get('device')}"],
        ["iterations (complete) / moments", f"{run['iterations']} / {run['moments']}"],
        ["mean step time after warm-up", f"{mean.get('total_s', 0) * 1e3:.1f} ms ({split})"],
        ["bytes moved", f"{_mib(summary['moves']['bytes'])} in {summary['moves']['count']} "
                        f"copies, {summary['moves']['wait_s'] * 1e3:.1f} ms waited"],
        ["prefetch hit rate", "n/a" if hit is None else f"{hit:.0%}"],
        ["chunk size", f"{chunks['chunk_elements']} elements, {chunks['num_chunks']} chunks, "
                       f"{_mib(chunks['model_data_bytes'])} model data, "
                       f"{_mib(chunks['wasted_bytes'])} wasted"],
        ["non-model data measured as", run.get("non_model_measure", "")],
    ])
    eviction_table = (_table(["cause", "evictions", "bytes", "mean next-use distance"],
                             eviction_rows, "evictions") if eviction_rows
                      else "<p>No evictions.</p>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>PatrickStar-C++ memory profile</title><style>{_STYLE}</style></head>
<body>
<h1>PatrickStar-C++ memory profile</h1>
<h2>Findings</h2><ul class="findings">{findings}</ul>
<h2>Run</h2>{facts}
<h2>Memory by tier over moments</h2>{_svg_memory_panels(a)}
<h2>Per tier</h2>{_table(["tier", "kind", "budget", "peak model data", "peak non-model data",
                          "peak total", "moved in", "moved out", "evictions"], tier_rows, "tiers")}
<h2>Step time</h2>{_svg_time_split(a)}
<h2>Where each chunk is (chunk x moment)</h2>{_svg_heatmap(a)}
<h2>Top eviction causes</h2>{eviction_table}
<script>{_SCRIPT}</script>
</body></html>
"""


# ---- Writing -----------------------------------------------------------------------------------

def _write_text(path: str, text: str) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
    os.replace(temporary, path)


def write_outputs(directory: str | os.PathLike, raw: dict) -> dict:
    """Writes profile.json and the four outputs into `directory`; returns the summary."""
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ProfileError(f"cannot create profile directory '{directory}': {error}") from error
    analysis = _Analysis(raw)
    summary = build_summary(raw, analysis)
    _write_text(os.path.join(directory, RAW_FILE), json.dumps(raw))
    _write_text(os.path.join(directory, "trace.json"), json.dumps(build_trace(raw, analysis)))
    header, rows = memory_rows(raw, analysis)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    _write_text(os.path.join(directory, "memory.csv"), buffer.getvalue())
    _write_text(os.path.join(directory, "summary.json"), json.dumps(summary, indent=2))
    _write_text(os.path.join(directory, "report.html"), render_html(raw, summary, analysis))
    return summary


# ---- Command line ------------------------------------------------------------------------------

def _summary_lines(summary: dict) -> list[tuple[str, str]]:
    mean = summary["time"]["steady_state_mean"]
    hit = summary["prefetch"]["hit_rate"]
    lines = [("iterations", str(summary["run"]["iterations"])),
             ("step time (ms, after warm-up)", f"{mean.get('total_s', 0) * 1e3:.2f}"),
             ("  compute (ms)", f"{mean.get('compute_s', 0) * 1e3:.2f}"),
             ("  waiting for moves (ms)", f"{mean.get('move_wait_s', 0) * 1e3:.2f}"),
             ("  waiting for collectives (ms)", f"{mean.get('collective_s', 0) * 1e3:.2f}"),
             ("  optimizer (ms)", f"{mean.get('optimizer_s', 0) * 1e3:.2f}")]
    for name, tier in summary["tiers"].items():
        budget = _mib(tier["budget_bytes"]) if tier["budget_bytes"] else "unlimited"
        lines += [(f"{name}: budget", budget),
                  (f"{name}: peak model / non-model", f"{_mib(tier['peak_model_bytes'])} / "
                                                      f"{_mib(tier['peak_non_model_bytes'])}"),
                  (f"{name}: moved in / out", f"{_mib(tier['bytes_in'])} / "
                                              f"{_mib(tier['bytes_out'])}"),
                  (f"{name}: evictions", str(tier["evictions"]))]
    lines += [("bytes moved", _mib(summary["moves"]["bytes"])),
              ("prefetch hit rate", "n/a" if hit is None else f"{hit:.0%}"),
              ("chunk size (elements)", str(summary["chunks"]["chunk_elements"])),
              ("wasted bytes", _mib(summary["chunks"]["wasted_bytes"]))]
    largest = summary["largest_non_model_moment"]
    if largest:
        lines.append(("largest non-model moment", f"{_mib(largest['bytes'])} on "
                      f"{largest['tier']}, iteration {largest['iteration']} moment "
                      f"{largest['moment']}"))
    return lines


def _print_table(rows: list[list[str]], out) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(
        prog="patrickstar-report",
        description="Print a PatrickStar-C++ memory profile's summary and regenerate its "
                    "report.html, or compare two profiles.")
    parser.add_argument("directory", nargs="?", help="a profile directory")
    parser.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"),
                        help="show two profiles side by side")
    args = parser.parse_args(argv)
    if bool(args.directory) == bool(args.compare):
        parser.error("give one profile directory, or --compare DIR_A DIR_B")
    try:
        if args.compare:
            summaries = [build_summary(load_raw(d)) for d in args.compare]
            lines = [_summary_lines(s) for s in summaries]
            table = [["", args.compare[0], args.compare[1]]]
            keys_b = dict(lines[1])
            for key, value in lines[0]:
                table.append([key, value, keys_b.get(key, "-")])
            seen = {key for key, _ in lines[0]}
            table += [[key, "-", value] for key, value in lines[1] if key not in seen]
            _print_table(table, out)
            for label, summary in zip(("A", "B"), summaries):
                print(f"\nfindings {label}:", file=out)
                for finding in summary["findings"]:
                    print(f"  - {finding}", file=out)
            return 0
        raw = load_raw(args.directory)
        analysis = _Analysis(raw)
        summary = build_summary(raw, analysis)
        _print_table([["", args.directory]] + [[k, v] for k, v in _summary_lines(summary)], out)
        print("\nfindings:", file=out)
        for finding in summary["findings"]:
            print(f"  - {finding}", file=out)
        path = os.path.join(args.directory, "report.html")
        _write_text(path, render_html(raw, summary, analysis))
        print(f"\nwrote {path}", file=out)
        return 0
    except ProfileError as error:
        print(f"patrickstar-report: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
