"""Upstream PatrickStar's profile format, built from this package's raw record.

Upstream's `profiler.save(path)` pickled one dict, and its `tools/profile_visualizer.py` reads
that dict back (memory by time per device, or every chunk's location by time). This module
builds the same dict from the raw record (recorder.py's `Profiler.raw()`), so a script written
for upstream can point upstream's visualizer, or its own code, at what `save()` wrote:

    start_time, end_time, warmup_finish_time   seconds
    gpu_memory_used, cpu_memory_used           [(moment, seconds, chunk + non-model bytes)]
    gpu_chunk_memory_used, cpu_chunk_memory_used   [(moment, seconds, chunk bytes)]
    stage_convert_time                         [(seconds, TrainingStage)]
    chunk_life_cycle                           {chunk id: {"type": kind,
                                                "life_cycle": [(seconds, what, device)]}}

Note [Upstream profile mapping]
Times: every figure is one clock, the chunk manager's steady clock in seconds plus
`clock_offset_s` (upstream.py passes time.time() - steady seconds taken at start(), so the
figures read like upstream's time.time() values); only differences between them mean anything.
Memory: "gpu" is the device tier, "cpu" the host tier, one entry per closed moment (memory.csv's
rows): chunk bytes are the tier's model bytes sampled at the moment's close, memory used adds
that tier's non-model bytes (memory.csv's <tier>_non_model_bytes: the larger of what was
measured and what the manager was told). The NVMe tier has no list in upstream's format (it had
no NVMe tier); its bytes are in memory.csv and summary.json.
Stages: a stage change is recorded where forward starts (the first forward tick after another
stage), where backward starts and where the optimizer step starts, so an iteration reads
FWD, BWD, ADAM; iteration ends and the time before the first forward are no stage upstream had
and open none (upstream's visualizer colours every span by a stage in 1..3).
Chunk locations: "allocate" (zero-filled in a tier, or where a chunk was when the profile
started), "move" (a copy settled in its destination) and "release" (payload dropped), at the
time the chunk is where the entry says (a copy's end). Devices: the device tier is the engine's
CUDA device (cuda:0 when the engine runs without CUDA: upstream's format tells its two tiers
apart only by device type), the host tier is torch.device("cpu"), and the NVMe tier is None, as
a dropped payload is: upstream had no NVMe tier, and its visualizer draws None as "not in
memory", which is what a chunk on NVMe is to the device and host figures.
Warm-up: `warmup_finish_time` is when the script called warmup_finish(); without that call, the
end of the first iteration (the warm-up in this package's other outputs), or the start.
"""
from __future__ import annotations

import enum

import torch

from ..vocabulary import Tier
from .analysis import Analysis, effective_ns

__all__ = ["TrainingStage", "UPSTREAM_KEYS", "upstream_state_dict"]


class TrainingStage(enum.IntEnum):
    """Upstream's training stages, with its values (its visualizer reads `.value`)."""
    UNSTART = 0
    FWD = 1
    BWD = 2
    ADAM = 3


UPSTREAM_KEYS = ("start_time", "end_time", "warmup_finish_time", "gpu_memory_used",
                 "gpu_chunk_memory_used", "cpu_memory_used", "cpu_chunk_memory_used",
                 "stage_convert_time", "chunk_life_cycle")

_STAGE_OF_TICK = {"pre_forward": TrainingStage.FWD, "post_forward": TrainingStage.FWD,
                  "pre_backward": TrainingStage.BWD, "post_backward": TrainingStage.BWD}


def upstream_state_dict(raw: dict, warmup_finish_ns: int | None = None,
                        clock_offset_s: float = 0.0, analysis: Analysis | None = None) -> dict:
    """Upstream's `Profiler.state_dict()` built from `raw` (Note [Upstream profile mapping]).
    `warmup_finish_ns` is when warmup_finish() was called (profiler clock), if it was;
    `analysis` is `Analysis(raw)` when the caller has one already."""
    analysis = Analysis(raw) if analysis is None else analysis

    def seconds(ns: int) -> float:
        return ns / 1e9 + clock_offset_s

    state = {"start_time": seconds(raw["start_ns"]), "end_time": seconds(raw["stop_ns"]),
             "warmup_finish_time": seconds(_warmup_finish_ns(raw, warmup_finish_ns))}
    for prefix, kind in (("gpu", Tier.DEVICE), ("cpu", Tier.HOST)):
        tier = _tier_of_kind(raw, kind)
        used, chunk = [], []
        if tier is not None:
            for row in analysis.rows:
                at = seconds(row["time_ns"])
                chunk.append((row["moment"], at, int(row["model"][tier])))
                used.append((row["moment"], at,
                             int(row["model"][tier]) + int(row["non_model"][tier])))
        state[f"{prefix}_memory_used"] = used
        state[f"{prefix}_chunk_memory_used"] = chunk
    state["stage_convert_time"] = [(seconds(ns), stage) for ns, stage in _stage_changes(raw)]
    state["chunk_life_cycle"] = _chunk_life_cycle(raw, analysis, seconds)
    return {key: state[key] for key in UPSTREAM_KEYS}


def _tier_of_kind(raw: dict, kind: str) -> int | None:
    return next((i for i, t in enumerate(raw["tiers"]) if t["kind"] == kind), None)


def _warmup_finish_ns(raw: dict, called_ns: int | None) -> int:
    if called_ns is not None:
        return called_ns
    first_end = next((m["time_ns"] for m in raw["marks"] if m["kind"] == "end"), None)
    return first_end if first_end is not None else raw["start_ns"]


def _stage_changes(raw: dict) -> list[tuple[int, TrainingStage]]:
    """(time, stage) where each run of ticks of one stage, or an optimizer step, begins."""
    starts = [(m["time_ns"], _STAGE_OF_TICK[m["event"]]) for m in raw["marks"]
              if m["kind"] == "tick" and m["event"] in _STAGE_OF_TICK]
    starts += [(p["start_ns"], TrainingStage.ADAM) for p in raw["phases"]
               if p["name"] == "optimizer"]
    starts.sort(key=lambda start: start[0])  # stable: a tie keeps ticks before the optimizer
    changes: list[tuple[int, TrainingStage]] = []
    for time_ns, stage in starts:
        if not changes or changes[-1][1] != stage:
            changes.append((time_ns, stage))
    return changes


def _devices(raw: dict) -> list:
    """The torch.device (or None) upstream's format gives each tier."""
    engine_device = torch.device(raw["run"].get("device", "cpu"))
    cuda = engine_device if engine_device.type == "cuda" else torch.device("cuda", 0)
    if cuda.index is None:
        cuda = torch.device("cuda", 0)
    by_kind = {Tier.DEVICE: cuda, Tier.HOST: torch.device("cpu")}
    return [by_kind.get(t["kind"]) for t in raw["tiers"]]


def _chunk_life_cycle(raw: dict, analysis: Analysis, seconds) -> dict:
    devices = _devices(raw)
    by_name = {t["name"]: i for i, t in enumerate(raw["tiers"])}

    def device(tier: int):
        return devices[tier] if 0 <= tier < len(devices) else None

    cycles = {}
    for cid, chunk in analysis.chunks.items():
        life = []
        where = by_name.get(chunk.get("tier"))
        if where is not None:
            life.append((seconds(raw["start_ns"]), "allocate", device(where)))
        cycles[cid] = {"type": chunk["kind"], "life_cycle": life}
    for event in analysis.events:  # in effective_ns order
        cycle = cycles.get(event["chunk"])
        if cycle is None:
            continue
        if event["type"] == "copy" and event["ok"]:
            entry = ("move", device(event["to_tier"]))
        elif event["type"] == "zero_fill":
            entry = ("allocate", device(event["to_tier"]))
        elif event["type"] == "drop":
            entry = ("release", None)
        else:  # evictions are decisions; the copy they cause records the move
            continue
        cycle["life_cycle"].append((seconds(effective_ns(event)),) + entry)
    return cycles
