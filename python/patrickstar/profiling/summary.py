"""summary.json: peaks per tier, totals moved, prefetch hit rate, the largest non-model-data
moment, chunk size and wasted bytes, the time split per iteration, and findings."""
from __future__ import annotations

import collections
import math

from ..dtypes import BY_NAME, element_size
from ..config import auto_chunk_floor
from ..guards import has_payload
from ..slab_budget import block_bytes, slab_budget
from ..vocabulary import Tier
from .analysis import GiB, MiB, Analysis, effective_ns, mib, stat_delta

__all__ = ["build_summary"]


_BUDGET_KEYS = {Tier.DEVICE: "memory.device_budget", Tier.HOST: "memory.host_budget",
                Tier.NVME: "memory.nvme.budget"}
# A constrained tier whose waits exceed this share of step time is called a bottleneck.
_BOTTLENECK_SHARE = 0.05


def build_summary(raw: dict, analysis: Analysis | None = None) -> dict:
    a = analysis or Analysis(raw)
    tiers = {}
    for t, info in enumerate(a.tiers):
        # Note [Peaks between moments] in analysis.py: the most held between samples too.
        model = [r["model_peak"][t] for r in a.rows] or [0]
        if a.window_peaks[t] is not None:
            model.append(a.window_peaks[t])
        non_model = [r["non_model"][t] for r in a.rows] or [0]
        total = [r["model_peak"][t] + r["non_model"][t] for r in a.rows] or [0]
        tiers[info["name"]] = {
            "kind": info["kind"], "budget_bytes": info["budget_bytes"],
            "peak_model_bytes": max(model), "peak_non_model_bytes": max(non_model),
            "peak_total_bytes": max(max(total), max(model)),
            "bytes_in": stat_delta(raw, t, "bytes_in"),
            "bytes_out": stat_delta(raw, t, "bytes_out"),
            "evictions": stat_delta(raw, t, "evictions"),
            "copy_wait_s": stat_delta(raw, t, "copy_wait_ns") / 1e9,
            # What the budget bounds (Note [Budgets bound the slab pool] in slab_budget.py): a
            # tier evicted with its chunks and non-model data below the budget because its pool
            # had reserved it.
            "reserved_bytes": raw["stats_end"][t].get("reserved_bytes")}
    by_direction: dict[str, int] = collections.Counter()
    by_cause: dict[str, int] = collections.Counter()
    for e in a.copies:
        by_direction[a.direction(e)] += e["bytes"]
        by_cause[e["cause"]] += e["bytes"]
    issued = sum(stat_delta(raw, t, "prefetch_issued") for t in range(len(a.tiers)))
    hits = sum(stat_delta(raw, t, "prefetch_hits") for t in range(len(a.tiers)))
    misses = sum(stat_delta(raw, t, "prefetch_misses") for t in range(len(a.tiers)))
    largest = None
    for r in a.rows:
        for t, name in enumerate(a.tier_names):
            if largest is None or r["non_model"][t] > largest["bytes"]:
                largest = {"bytes": r["non_model"][t], "tier": name, "iteration": r["iteration"],
                           "moment": r["moment"], "event": r["event"]}
    layout = raw["layout"]
    chunk_bytes_total = _payload_bytes(layout.get("chunks", []))
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
                    non_model_measure=raw.get("non_model_measure", ""),
                    failure=raw.get("failure")),
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
                   "wasted_bytes": layout.get("wasted_bytes", 0) + _alignment_bytes(layout),
                   "oversize_tensors": layout.get("oversize_tensors", []),
                   "owned_bytes": _owned_bytes(layout.get("chunks", []), raw["run"]),
                   "by_kind": _chunks_by_kind(layout, raw["run"])},
        "evictions": {"count": len(a.evictions), "bytes": sum(e["bytes"] for e in a.evictions),
                      "top_causes": _eviction_causes(a)[:10]},
        "collectives": _collectives(raw["collectives"]),
        "time": {"iterations": iterations, "steady_state_mean": mean},
        "dropped_events": raw.get("dropped", 0),
    }
    summary["findings"] = _findings(a, summary)
    return summary


# Note [Wasted bytes of small chunks]
# A chunk's memory is a block of its capacity rounded up to 4 KiB (kBlockAlignment in
# runtime/tier.h), and model_data_bytes counts the blocks; the layout's wasted_bytes counts only
# the unused capacity. int8 Adam state's scale chunks hold one float32 per 2048 elements, so at
# 32768 elements per chunk a scale chunk of 128 bytes took a 4 KiB block: of a 2-layer Llama's
# 4.5 MiB the report called 0.3 MiB wasted, and the padding of its 24 scale chunks (93 KiB)
# was in neither. The padding counts as wasted, so model data less wasted is what the tensors
# hold.
def _alignment_bytes(layout: dict) -> int:
    """Bytes of the chunks' blocks beyond their capacity (Note [Wasted bytes of small
    chunks]); chunks without tensors (data-parallel padding) have no payload."""
    padding = 0
    for chunk in layout.get("chunks", []):
        if not has_payload(chunk) or chunk.get("dtype") not in BY_NAME:
            continue
        capacity = chunk["capacity_elements"] * element_size(chunk["dtype"])
        padding += max(0, chunk.get("bytes", 0) - capacity)
    return padding


# Note [Model data of a data-parallel rank]
# The layout lists the chunks of the whole model on every rank, each with the rank that owns
# it; a rank keeps its own chunks (its parameter shards, and their gradients and optimizer
# state) and only gathers the others for a while. model_data_bytes and by_kind's bytes are the
# whole model's (estimate_memory()'s figures); owned_bytes is what this rank keeps, about 1/N
# of it (all of it on one process). Both count the chunks that hold tensors: the padding chunks
# of the layout never get memory (Note [Padding chunks are not memory] in guards.py; they
# were counted, so a 2-rank model with tensors larger than the chunk reported each such
# tensor's chunk once per rank, and a rank owning only padding owned the bytes of tensors it
# never keeps).
def _payload_bytes(chunks: list[dict]) -> int:
    return sum(c.get("bytes", 0) for c in chunks if has_payload(c))


def _owned_bytes(chunks: list[dict], run: dict) -> int:
    rank = run.get("rank", 0)
    return _payload_bytes([c for c in chunks if c.get("owner_rank", rank) == rank])


def _chunks_by_kind(layout: dict, run: dict) -> dict:
    """Chunks, bytes (the whole model's, and this rank's own: Note [Model data of a
    data-parallel rank]) and element type per chunk kind, in layout order: what the model data
    is made of (int8 Adam state is uint8 moments plus float32 scales; bf16 without a master
    keeps a bf16 param_compensation), comparable with estimate_memory()'s kinds."""
    groups: dict[str, list[dict]] = {}
    for chunk in layout.get("chunks", []):
        groups.setdefault(chunk["kind"], []).append(chunk)
    kinds = {}
    for kind, chunks in groups.items():
        dtypes = {c.get("dtype", "?") for c in chunks}
        kinds[kind] = {"dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
                       "chunks": len(chunks), "bytes": _payload_bytes(chunks),
                       "owned_bytes": _owned_bytes(chunks, run)}
    return kinds


def _collectives(records: list[dict]) -> dict:
    """Count, payload bytes, summed spans (time_s: issue to finish, overlapping compute for
    started ones) and summed blocked time (wait_s) of the collectives, in total, by name and
    by phase (Note [Recording collectives] in recorded_collectives.py)."""
    def totals(subset: list[dict]) -> dict:
        return {"count": len(subset), "bytes": sum(c["bytes"] for c in subset),
                "time_s": sum(c["end_ns"] - c["start_ns"] for c in subset) / 1e9,
                "wait_s": sum(c["end_ns"] - c.get("wait_start_ns", c["start_ns"])
                              for c in subset) / 1e9}
    result = totals(records)
    for key, field in (("by_name", "name"), ("by_phase", "phase")):
        groups: dict[str, list[dict]] = {}
        for c in records:
            groups.setdefault(c[field], []).append(c)
        result[key] = {value: totals(subset) for value, subset in sorted(groups.items())}
    return result


def _eviction_causes(a: Analysis) -> list[dict]:
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
        elif trigger == "explicit":  # rows differ by the kind moved explicitly, so name it
            why = f"an explicit move of {for_kind} chunks" if for_kind else "an explicit move"
        else:
            why = "making room"
        distance = (sum(g["distances"]) / len(g["distances"])) if g["distances"] else None
        rows.append({"phase": phase, "trigger": trigger, "for_kind": for_kind,
                     "victim_kind": victim_kind, "direction": direction, "count": g["count"],
                     "bytes": g["bytes"], "mean_next_use_distance": distance,
                     "description": f"{phase}: {why} moved {victim_kind} chunks {direction}"})
    rows.sort(key=lambda r: (-r["count"], -r["bytes"]))
    return rows


def _mib_up(nbytes: float) -> str:
    """`nbytes` as mib() prints it, rounded up: a budget named this way holds `nbytes`."""
    if nbytes >= GiB:
        return f"{math.ceil(nbytes / GiB * 100) / 100:.2f} GiB"
    return f"{math.ceil(nbytes / MiB * 10) / 10:.1f} MiB"


def _tier_need(a: Analysis, tier: int) -> int | None:
    """The budget `tier` needs so that one steady iteration makes no copies into or out of it:
    slabs for every chunk it holds or receives during the iteration, plus its peak non-model
    data then (Note [Budgets bound the slab pool] in slab_budget.py)."""
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
                and last["start_ns"] < effective_ns(e) <= last["end_ns"]):
            chunks.add(e["chunk"])
    # Only the non-model data the manager was told about shares the budget with chunks.
    non_model = max((r["planned_non_model"][tier] for r in rows), default=0)
    blocks = collections.Counter(
        block_bytes(a.chunks[c].get("bytes", 0))
        for c in chunks if c in a.chunks and a.chunks[c].get("bytes", 0) > 0)
    return slab_budget(blocks, non_model)


def _findings(a: Analysis, summary: dict) -> list[str]:
    findings = []
    failure = summary["run"].get("failure")
    if failure:  # Note [Profiles of failed runs] in recorder.py
        first_line = failure.strip().splitlines()[0] if failure.strip() else failure
        findings.append(f"the profiled run failed: {first_line} (these figures stop at the "
                        f"failure).")
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
        findings.append(f"largest non-model data: {mib(largest['bytes'])} on {largest['tier']} "
                        f"at iteration {largest['iteration']}, moment {largest['moment']}"
                        f"{' (' + largest['event'] + ')' if largest['event'] else ''}.")
    for t, name in enumerate(a.tier_names):
        measured = max((r["non_model"][t] for r in a.rows), default=0)
        planned = max((r["planned_non_model"][t] for r in a.rows), default=0)
        if measured > planned and measured >= MiB:
            findings.append(f"{name}: {mib(measured)} of non-model data was measured "
                            f"({a.raw.get('non_model_measure', 'measured')}) but the manager "
                            f"planned with {mib(planned)}; its budget does not leave room "
                            f"for the difference.")
    chunks = summary["chunks"]
    if chunks["model_data_bytes"]:
        waste = chunks["wasted_bytes"] / chunks["model_data_bytes"]
        if waste >= 0.1:
            # "auto" searches sizes from its floor up: for chunks already below it, it would
            # waste more (a small model in 4K-element chunks was told to use it).
            floor = auto_chunk_floor(summary["run"].get("world_size", 1))
            advice = ("default_chunk_size \"auto\" searches for a tighter size"
                      if chunks["chunk_elements"] > floor else
                      f"a smaller default_chunk_size wastes less (\"auto\" keeps at least "
                      f"{floor} elements per chunk here)")
            findings.append(f"chunks waste {mib(chunks['wasted_bytes'])} ({waste:.0%} of model "
                            f"data) at {chunks['chunk_elements']} elements per chunk; {advice}.")
    top = summary["evictions"]["top_causes"]
    if top:
        findings.append(f"{summary['evictions']['count']} evictions moved "
                        f"{mib(summary['evictions']['bytes'])}; most often "
                        f"{top[0]['description']} ({top[0]['count']} times).")
    if summary["dropped_events"]:
        capacity = a.raw.get("capacity")
        now = f" (now {capacity} events)" if capacity else ""
        findings.append(f"{summary['dropped_events']} events were dropped (the log was full): "
                        f"totals from events undercount; raise the profiler's capacity{now}, "
                        f"the events it holds between two ends of iteration: "
                        f"patrickstar.profile(model, dir, capacity=N).")
    if not a.iterations:
        findings.append("no complete iteration was recorded: run at least one optimizer.step() "
                        "inside the profile for time splits and bottlenecks.")
    if not any("bottleneck" in f for f in findings) and total > 0:
        compute = mean.get("compute_s", 0.0) / total
        # (after the failure, which comes first)
        findings.insert(1 if failure else 0,
                        f"no memory bottleneck: compute is {compute:.0%} of step time, "
                        f"waiting for copies {mean.get('move_wait_s', 0.0) / total:.0%}.")
    return findings
