"""Memory profiles: recording a run and turning the record into its outputs.

    recorder.py    Profiler, profile(): records one engine's chunk traffic, phases, collectives
    analysis.py    the raw record (profile.json) loaded and analysed once for every output
    memory_csv.py  memory.csv: one row per moment
    trace.py       trace.json: Chrome trace event format (Perfetto, chrome://tracing)
    summary.py     summary.json: peaks, totals, prefetch hit rate, time split, findings
    html_page.py   report.html: one self-contained page (inline SVG, nothing fetched)
    outputs.py     writes them all
    cli.py         the `patrickstar-report` command
    upstream.py    upstream PatrickStar's global `profiler` (start/end/save/state_dict)
    upstream_format.py  upstream's profile pickle, built from the raw record
"""
from __future__ import annotations

from .analysis import OUTPUT_FILES, RAW_FILE, ProfileError, load_raw
from .cli import main
from .html_page import render_html
from .memory_csv import memory_rows
from .outputs import write_outputs
from .recorder import (Profiler, active_profiler, now_ns, optimizer_phase, profile,
                       profiler_from_config)
from .summary import build_summary
from .trace import build_trace

__all__ = ["OUTPUT_FILES", "ProfileError", "Profiler", "RAW_FILE", "active_profiler",
           "build_summary", "build_trace", "load_raw", "main", "memory_rows", "now_ns",
           "optimizer_phase", "profile", "profiler_from_config", "render_html", "write_outputs"]
