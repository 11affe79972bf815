"""memory.csv: one row per moment (model data at its close and the most held during it,
non-model data, budget and bytes moved so far, per tier)."""
from __future__ import annotations


from .analysis import Analysis

__all__ = ["memory_rows"]


def memory_rows(raw: dict, analysis: Analysis | None = None) -> tuple[list[str], list[list]]:
    """The header and rows of memory.csv: one row per closed moment."""
    a = analysis or Analysis(raw)
    header = ["iteration", "moment", "end_of_iteration", "time_ms", "event"]
    for kind in a.tier_kinds:
        header += [f"{kind}_model_bytes", f"{kind}_peak_model_bytes", f"{kind}_non_model_bytes",
                   f"{kind}_planned_non_model_bytes", f"{kind}_budget_bytes",
                   f"{kind}_bytes_in_total", f"{kind}_bytes_out_total"]
    rows = []
    for r in a.rows:
        row = [r["iteration"], r["moment"], int(r["end_of_iteration"]),
               round((r["time_ns"] - a.start_ns) / 1e6, 4), r["event"]]
        for t in range(len(a.tiers)):
            row += [r["model"][t], r["model_peak"][t], r["non_model"][t],
                    r["planned_non_model"][t], r["budget"][t],
                    r["bytes_in"][t], r["bytes_out"][t]]
        rows.append(row)
    return header, rows
