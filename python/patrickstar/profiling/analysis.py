"""The analysis every profile output shares: the raw record loaded and checked, and an
`Analysis` of it (rows per moment, iterations with their time split, chunk locations)."""
from __future__ import annotations

import bisect
import json
import os

__all__ = ["Analysis", "GiB", "MiB", "OUTPUT_FILES", "ProfileError", "RAW_FILE", "RAW_KEYS",
           "effective_ns", "load_raw", "mib", "reserved_mib", "stat_delta"]


RAW_FILE = "profile.json"
OUTPUT_FILES = ("trace.json", "memory.csv", "summary.json", "report.html")
MiB = 1 << 20
GiB = 1 << 30
RAW_KEYS = ("start_ns", "stop_ns", "run", "tiers", "stats_start", "stats_end", "layout",
            "events", "samples", "marks", "phases", "collectives")
# The JSON type the recorder writes for each key: a record edited by hand or by another tool
# is refused by name here rather than by a TypeError deep in the analysis.
_RAW_TYPES = {"start_ns": int, "stop_ns": int, "run": dict, "tiers": list, "stats_start": list,
              "stats_end": list, "layout": dict, "events": dict, "samples": dict, "marks": list,
              "phases": list, "collectives": list}
_JSON_NAMES = {int: "a number", dict: "an object", list: "a list"}


class ProfileError(ValueError):
    """A profile directory that is missing, incomplete or unreadable (the message names it)."""


def load_raw(directory: str | os.PathLike) -> dict:
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise ProfileError(f"profile directory '{directory}' does not exist")
    path = os.path.join(directory, RAW_FILE)
    if not os.path.isfile(path):
        ranks = _rank_directories(directory)
        if ranks:  # Note [One profile directory per rank] in outputs.py
            raise ProfileError(f"'{directory}' holds the profiles of {len(ranks)} data-parallel "
                               f"ranks ({', '.join(r + '/' for r in ranks)}), one directory "
                               f"each: give one of them, e.g. "
                               f"'{os.path.join(directory, ranks[0])}'")
        raise ProfileError(f"'{path}' is missing: '{directory}' is not a complete profile. "
                           f"The profile is written with the other outputs when profiling "
                           f"stops (the end of the patrickstar.profile() block, "
                           f"model.profiler.stop(), model.destroy() or interpreter exit): a "
                           f"run still going, killed before that, or whose initialize() "
                           f"failed has written none")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except json.JSONDecodeError as error:
        raise ProfileError(f"'{path}' is not valid JSON ({error}); the profile is incomplete")
    if not isinstance(raw, dict):
        raise ProfileError(f"'{path}' holds {_json_name(raw)}, not a profile record (an object "
                           f"with {', '.join(RAW_KEYS)})")
    missing = [key for key in RAW_KEYS if key not in raw]
    if missing:
        raise ProfileError(f"'{path}' is incomplete: missing {', '.join(missing)}")
    wrong = [f"{key} is {_json_name(raw[key])} (expected {_JSON_NAMES[kind]})"
             for key, kind in _RAW_TYPES.items()
             if not isinstance(raw[key], kind) or isinstance(raw[key], bool)]
    if wrong:
        raise ProfileError(f"'{path}' is not a profile record PatrickStar wrote: "
                           + "; ".join(wrong))
    return raw


def _rank_directories(directory: str) -> list[str]:
    """The rank<k>/ subdirectories of `directory` holding a raw record, in rank order."""
    names = [name for name in os.listdir(directory)
             if name.startswith("rank") and name[4:].isdigit()
             and os.path.isfile(os.path.join(directory, name, RAW_FILE))]
    return sorted(names, key=lambda name: int(name[4:]))


def _json_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names = {str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _events(raw: dict) -> list[dict]:
    columns = raw["events"]
    if not columns:
        return []
    keys = list(columns)
    return [dict(zip(keys, values)) for values in zip(*(columns[k] for k in keys))]


def effective_ns(event: dict) -> int:
    return event["end_ns"] if event["type"] == "copy" else event["start_ns"]


class Analysis:
    """Everything the outputs share, computed once from the raw record."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.start_ns = raw["start_ns"]
        self.tiers = raw["tiers"]
        self.tier_names = [t["name"] for t in self.tiers]
        self.tier_kinds = [t["kind"] for t in self.tiers]
        self.events = sorted(_events(raw), key=effective_ns)
        self.copies = [e for e in self.events if e["type"] == "copy" and e["ok"]]
        self.evictions = [e for e in self.events if e["type"] == "eviction"]
        self.chunks = {c["id"]: c for c in raw["layout"].get("chunks", [])}
        self._rows()
        self._peaks()
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
        # Note [Where measured non-model data lives] in recorder.py; profiles written before
        # it name the device tier ("device_tier").
        device = self.raw.get("non_model_tier", self.raw.get("device_tier"))
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

    # Note [Peaks between moments]
    # A moment's sample is taken when it closes (the start of the next tick, or the end of an
    # iteration), so chunks that appear and go within one moment are never sampled: the last
    # gradient chunks of a backward, written after its last tick and dropped by the optimizer
    # before the end of the iteration, made every sampled device figure 12% below the manager's
    # own peak_chunk_bytes on a 4-layer MLP (1.875 MiB reported, 2.125 MiB held); a backward now
    # ends with a tick (Note [A moment after the backward] in engine.py), which samples those,
    # but chunks can still come and go within any moment (a copy issued and settled). The events
    # carry every change of a tier's chunk bytes, with its time: a copy adds its bytes to the
    # destination when issued and takes them from the source when settled (from the destination
    # if it failed), a zero-fill adds them, a drop takes them (ChunkManager::AddChunkBytes's
    # callers). Replayed from the tier's chunk bytes at the profile's start they give the most
    # each tier held between two samples, `model_peak`. The replay is used only if it ends at
    # the manager's own chunk bytes for every tier; otherwise (events dropped, a copy issued
    # before the profile started, chunks placed without an event) `model_peak` falls back to
    # the samples. Either way a tier whose peak_chunk_bytes rose during the profile reached
    # exactly that figure inside it, and every tier held its chunk bytes at the profile's start
    # and stop (window_peaks): a profile with no moment (stopped before the first forward) gave
    # a peak of 0 MiB on the host that held all the parameters.
    def _peaks(self) -> None:
        count = len(self.tiers)
        for row in self.rows:
            row["model_peak"] = list(row["model"])
        start = [t.get("chunk_bytes") for t in self.raw["stats_start"]]
        end = [t.get("chunk_bytes") for t in self.raw["stats_end"]]
        self.window_peaks = [None] * count
        for t, (before, after) in enumerate(zip(self.raw["stats_start"], self.raw["stats_end"])):
            held = [before.get("chunk_bytes"), after.get("chunk_bytes")]
            if after.get("peak_chunk_bytes", 0) > before.get("peak_chunk_bytes", 0):
                held.append(after["peak_chunk_bytes"])
            held = [value for value in held if value is not None]
            self.window_peaks[t] = max(held) if held else None
        self.exact_peaks = False
        if None in start or None in end or len(start) != count or self.raw.get("dropped"):
            return
        changes = []  # (time, tier, delta) in the order the manager made them
        for e in _events(self.raw):
            if e["type"] == "copy":
                changes.append((e["start_ns"], e["to_tier"], e["bytes"]))
                changes.append((e["end_ns"], e["from_tier"] if e["ok"] else e["to_tier"],
                                -e["bytes"]))
            elif e["type"] == "zero_fill":
                changes.append((e["start_ns"], e["to_tier"], e["bytes"]))
            elif e["type"] == "drop":
                changes.append((e["start_ns"], e["from_tier"], -e["bytes"]))
        changes.sort(key=lambda change: change[0])  # stable: ties keep the manager's order
        level = list(start)
        peaks = []  # per row: the most each tier held since the previous row
        position = 0
        for row in self.rows:
            high = list(level)
            while position < len(changes) and changes[position][0] <= row["time_ns"]:
                _, tier, delta = changes[position]
                position += 1
                if not 0 <= tier < count:
                    return
                level[tier] += delta
                high[tier] = max(high[tier], level[tier])
            peaks.append(high)
        for _, tier, delta in changes[position:]:
            if not 0 <= tier < count:
                return
            level[tier] += delta
        if level != end:
            return
        for row, high in zip(self.rows, peaks):
            row["model_peak"] = [max(a, b) for a, b in zip(high, row["model"])]
        self.exact_peaks = True

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
            # Waiting for collectives: the union of the intervals this rank was blocked on one
            # (a started collective's span overlaps compute: Note [Recording collectives] in
            # recorded_collectives.py).
            blocked = _merged([(max(begin, c.get("wait_start_ns", c["start_ns"])),
                                min(end, c["end_ns"])) for c in self.raw["collectives"]])
            coll = sum(b - a for a, b in blocked)
            optimizer_spans = [(p["start_ns"], p["end_ns"]) for p in self.raw["phases"]
                               if p["name"] == "optimizer"]
            opt_span = sum(_overlap(a, b, begin, end) for a, b in optimizer_spans)
            opt_inner = sum(e["wait_ns"] for e in waits if e["phase"] == "optimizer") + sum(
                _overlap(a, b, p0, p1) for a, b in blocked for p0, p1 in optimizer_spans)
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
        self._trailing(begin)

    def _trailing(self, begin: int) -> None:
        """What was recorded after the last complete iteration: `trailing_spans`, its
        forward/backward runs of ticks and optimizer spans (the tail of the last step's
        optimizer phase, which goes on past its end of iteration, or the phases of an
        iteration the profile stopped inside), and `incomplete`, that iteration if the next one
        had begun ({"iteration", "start_ns", "end_ns"}, else None). Without them a failed
        run's trace showed no phase of the iteration that failed. The last run of ticks lasts
        until the profile stopped (or the optimizer step after it began): the phase the run
        was in."""
        marks = [m for m in self.raw["marks"] if m["time_ns"] > begin]
        stop = self.raw["stop_ns"]
        runs = [[phase, start, end] for phase, start, end
                in _phase_runs([m for m in marks if m["kind"] == "tick"])]
        optimizer = [(p["start_ns"], p["end_ns"]) for p in self.raw["phases"]
                     if p["name"] == "optimizer" and p["end_ns"] > begin]
        if runs:
            after = [start for start, _ in optimizer if start >= runs[-1][2]]
            runs[-1][2] = min(after + [stop])
        spans = [tuple(run) for run in runs]
        spans += [("optimizer", max(begin, start), end) for start, end in optimizer]
        self.trailing_spans = sorted(spans, key=lambda span: span[1])
        rows = [r for r in self.rows if r["time_ns"] > begin]
        self.incomplete = None
        if marks or rows:
            number = rows[0]["iteration"] if rows else (
                self.iterations[-1]["iteration"] + 1 if self.iterations else 0)
            self.incomplete = {"iteration": number, "start_ns": begin, "end_ns": stop}

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
                   and effective_ns(self.events[position]) <= row["time_ns"]):
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


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of `intervals` as sorted disjoint ones (empty ones dropped)."""
    merged: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def stat_delta(raw: dict, tier: int, key: str) -> int:
    return raw["stats_end"][tier].get(key, 0) - raw["stats_start"][tier].get(key, 0)


def mib(nbytes: float) -> str:
    """`nbytes` for people: MiB with one decimal, or KiB when that would read 0.0 MiB for bytes
    that are there (int8 Adam state's scale chunks, a small model's activations), or GiB with two
    decimals from 1 GiB up (an NVMe budget, the free space of its disk, read "74399.0 MiB")."""
    if 0 < abs(nbytes) < MiB / 20:
        return f"{nbytes / 1024:.1f} KiB"
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / MiB:.1f} MiB"


def reserved_mib(tier: dict) -> str:
    """The bytes `tier`'s slab pool had reserved when the profile stopped, as mib() prints
    them: what its budget bounds (Note [Budgets bound the slab pool] in slab_budget.py); "-" in
    a record without them."""
    reserved = tier.get("reserved_bytes")
    return "-" if reserved is None else mib(reserved)
