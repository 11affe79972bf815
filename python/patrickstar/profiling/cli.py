"""The `patrickstar-report` command: `patrickstar-report DIR` prints the summary and
regenerates report.html; `patrickstar-report --compare DIR_A DIR_B` prints two runs side by side."""
from __future__ import annotations

import argparse
import os
import sys

from .analysis import Analysis, ProfileError, load_raw, mib, reserved_mib
from .html_page import render_html
from .outputs import write_text
from .summary import build_summary

__all__ = ["main"]


def _summary_lines(summary: dict) -> list[tuple[str, str]]:
    mean = summary["time"]["steady_state_mean"]
    hit = summary["prefetch"]["hit_rate"]
    ranks = summary["run"].get("world_size", 1)

    def ms(key: str) -> str:  # no complete iteration: no time split, not 0.00 ms
        return f"{mean[key] * 1e3:.2f}" if key in mean else "n/a"

    lines = [("iterations", str(summary["run"]["iterations"])),
             ("step time (ms, after warm-up)", ms("total_s")),
             ("  compute (ms)", ms("compute_s")),
             ("  waiting for moves (ms)", ms("move_wait_s")),
             ("  waiting for collectives (ms)", ms("collective_s")),
             ("  optimizer (ms)", ms("optimizer_s"))]
    for name, tier in summary["tiers"].items():
        budget = mib(tier["budget_bytes"]) if tier["budget_bytes"] else "unlimited"
        lines += [(f"{name}: budget", budget),
                  (f"{name}: peak model / non-model", f"{mib(tier['peak_model_bytes'])} / "
                                                      f"{mib(tier['peak_non_model_bytes'])}"),
                  (f"{name}: slab pool reserved at stop", reserved_mib(tier)),
                  (f"{name}: moved in / out", f"{mib(tier['bytes_in'])} / "
                                              f"{mib(tier['bytes_out'])}"),
                  (f"{name}: evictions", str(tier["evictions"]))]
    lines += [("bytes moved", mib(summary["moves"]["bytes"])),
              ("prefetch hit rate", "n/a" if hit is None else f"{hit:.0%}")]
    largest = summary["largest_non_model_moment"]
    if largest:
        lines.append(("largest non-model moment", f"{mib(largest['bytes'])} on "
                      f"{largest['tier']}, iteration {largest['iteration']} moment "
                      f"{largest['moment']}"))
    lines += [("chunk size (elements)", str(summary["chunks"]["chunk_elements"])),
              ("wasted bytes", mib(summary["chunks"]["wasted_bytes"])),
              ("model data", mib(summary["chunks"]["model_data_bytes"])
                             + _owned(summary["chunks"], ranks))]
    # One line per kind, its element type in the value, so --compare lines up an fp32 run's
    # momentum with an int8 run's (kinds of one run only follow at the end).
    lines += [(f"  {kind}", f"{mib(k['bytes'])} {k['dtype']}{_owned(k, ranks)}")
              for kind, k in summary["chunks"].get("by_kind", {}).items()]
    return lines


def _owned(entry: dict, ranks: int) -> str:
    """Under data parallelism, what this rank keeps of the whole model's bytes the line gives
    (Note [Model data of a data-parallel rank] in summary.py)."""
    if ranks > 1 and "owned_bytes" in entry:
        return f", this rank owns {mib(entry['owned_bytes'])}"
    return ""


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
            values_a, values_b = dict(lines[0]), dict(lines[1])
            keys = [key for key, _ in lines[0]]
            # A line of B only goes after the line B has before it: appended at the end, an
            # NVMe tier of B (A without one) was listed under A's model data per kind.
            for index, (key, _) in enumerate(lines[1]):
                if key not in values_a:
                    before = lines[1][index - 1][0] if index else None
                    keys.insert(keys.index(before) + 1 if before in keys else len(keys), key)
            table = [["", args.compare[0], args.compare[1]]]
            table += [[key, values_a.get(key, "-"), values_b.get(key, "-")] for key in keys]
            _print_table(table, out)
            for label, summary in zip(("A", "B"), summaries):
                print(f"\nfindings {label}:", file=out)
                for finding in summary["findings"]:
                    print(f"  - {finding}", file=out)
            out.flush()  # (into a pipe: a reader gone raises here, not at exit)
            return 0
        raw = load_raw(args.directory)
        analysis = Analysis(raw)
        summary = build_summary(raw, analysis)
        reader_left = False
        try:
            _print_table([["", args.directory]]
                         + [[k, v] for k, v in _summary_lines(summary)], out)
            print("\nfindings:", file=out)
            for finding in summary["findings"]:
                print(f"  - {finding}", file=out)
            out.flush()
        except BrokenPipeError:  # the page is regenerated all the same
            reader_left = _reader_left(out)
        path = os.path.join(args.directory, "report.html")
        write_text(path, render_html(raw, summary, analysis))
        if not reader_left:
            print(f"\nwrote {path}", file=out)
            out.flush()
        return 0
    except BrokenPipeError:
        _reader_left(out)
        return 0
    except ProfileError as error:
        print(f"patrickstar-report: {error}", file=sys.stderr)
        return 2


def _reader_left(out) -> bool:
    """The reader of the output went away (`patrickstar-report DIR | head`): what is left to
    print goes nowhere, and the interpreter's flush at exit does not raise again (Python's
    advice for SIGPIPE: point stdout at devnull). That used to end in a BrokenPipeError
    traceback, before report.html was regenerated."""
    if out is sys.stdout:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return True


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
