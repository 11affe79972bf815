"""`patrickstar.report`: the profile outputs under their first import path, and the entry point
of the `patrickstar-report` command (pyproject.toml). They live in `patrickstar.profiling`."""
from __future__ import annotations

from .profiling import (OUTPUT_FILES, RAW_FILE, ProfileError, build_summary, build_trace,
                        load_raw, main, memory_rows, render_html, write_outputs)

__all__ = ["ProfileError", "load_raw", "write_outputs", "build_summary", "build_trace",
           "memory_rows", "render_html", "main", "OUTPUT_FILES", "RAW_FILE"]

# `python -m patrickstar.report DIR` (where the console script is not on PATH) ran this module
# as a script, which only imported the names and exited 0 without a word.
if __name__ == "__main__":
    raise SystemExit(main())
