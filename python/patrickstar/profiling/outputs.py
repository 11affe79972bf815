"""Writes every output of a profile from its raw record."""
from __future__ import annotations

import csv
import io
import json
import os

from .analysis import RAW_FILE, Analysis, ProfileError
from .html_page import render_html
from .memory_csv import memory_rows
from .summary import build_summary
from .trace import build_trace

__all__ = ["write_outputs", "write_text"]


def write_text(path: str, text: str) -> None:
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
    analysis = Analysis(raw)
    summary = build_summary(raw, analysis)
    write_text(os.path.join(directory, RAW_FILE), json.dumps(raw))
    write_text(os.path.join(directory, "trace.json"), json.dumps(build_trace(raw, analysis)))
    header, rows = memory_rows(raw, analysis)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_text(os.path.join(directory, "memory.csv"), buffer.getvalue())
    write_text(os.path.join(directory, "summary.json"), json.dumps(summary, indent=2))
    write_text(os.path.join(directory, "report.html"), render_html(raw, summary, analysis))
    return summary
