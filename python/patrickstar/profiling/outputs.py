"""Writes every output of a profile from its raw record."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile

from .analysis import RAW_FILE, Analysis, ProfileError
from .html_page import render_html
from .memory_csv import memory_rows
from .summary import build_summary
from .trace import build_trace

__all__ = ["make_directory", "rank_directory", "write_bytes", "write_outputs", "write_text"]


# Note [One profile directory per rank]
# Every rank of a data-parallel job runs the same script and config, so every rank profiles
# into the same output_dir. Writing there directly, the ranks raced for the same files: one rank's
# os.replace of 'profile.json.tmp' found the file already renamed by another and raised (in
# destroy(), losing that rank's profile), and whichever rank wrote last left its files over the
# others'. With more than one rank, rank k writes into '<output_dir>/rank<k>/' instead (what
# `patrickstar-report` is then pointed at); a single process writes into output_dir itself.
def rank_directory(directory: str | os.PathLike, run: dict) -> str:
    """Where a profile of `run` (the raw record's "run": world_size, rank) is written."""
    directory = os.fspath(directory)
    if run.get("world_size", 1) > 1:
        return os.path.join(directory, f"rank{run.get('rank', 0)}")
    return directory


def make_directory(directory: str | os.PathLike, run: dict) -> str:
    """Creates the directory a profile of `run` is written into (rank_directory) and returns it.
    Profiler.start() calls it too, so a directory that cannot be made (a path under a file, no
    permission) fails before the run is profiled rather than when its profile is written."""
    directory = rank_directory(directory, run)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ProfileError(f"cannot create profile directory '{directory}': {error}") from error
    # An existing directory passes makedirs whether or not files can be made in it (no write
    # permission, a read-only mount): the run was profiled to the end and its profile lost to a
    # bare PermissionError at stop(). Making (and removing) a file now fails before the run.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ProfileError(f"cannot write into profile directory '{directory}': "
                           f"{error}") from error
    return directory


def write_bytes(path: str, data: bytes) -> None:
    """`data` into `path` through a temporary file renamed over it (no half-written output).
    An OSError (the directory became unwritable, a full disk) is a ProfileError naming `path`."""
    # The process id keeps writers of the same path (ranks given one directory by hand) from
    # renaming each other's temporary file.
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise ProfileError(f"cannot write profile output '{path}': {error}") from error


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_outputs(directory: str | os.PathLike, raw: dict,
                  analysis: Analysis | None = None) -> dict:
    """Writes profile.json and the four outputs into `directory` (its rank<k>/ subdirectory
    under data parallelism: Note [One profile directory per rank]); returns the summary.
    `analysis` is `Analysis(raw)` when the caller has one already."""
    directory = make_directory(directory, raw["run"])
    analysis = Analysis(raw) if analysis is None else analysis
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
