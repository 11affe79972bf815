"""The benchmark drivers' shared argument handling (tools/bench/common.py) and the drivers that use
it, as a user runs them: sizes below 1 are refused naming the option and the value (a negative
size failed deep in torch or the runtime, zero repeats divided by zero), and an explicit size
given with --quick wins over --quick's (it was replaced silently)."""
import argparse
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench")
sys.path.insert(0, BENCH)
from common import at_least, quick_defaults  # noqa: E402


def parser():
    made = argparse.ArgumentParser(prog="bench")
    made.add_argument("--steps", type=at_least(1), default=12)
    made.add_argument("--layers", type=at_least(1), default=None)
    made.add_argument("--budget", default="6GiB")
    made.add_argument("--quick", action="store_true")
    return made


def parsed(argv):
    made = parser()
    args = made.parse_args(argv)
    if args.quick:
        quick_defaults(made, args, argv, steps=4, layers=2, budget="8MiB")
    return args, made


def test_quick_fills_only_what_was_not_given():
    args, _ = parsed(["--quick"])
    assert (args.steps, args.layers, args.budget) == (4, 2, "8MiB")
    args, _ = parsed(["--quick", "--steps", "7", "--budget", "1GiB"])
    assert (args.steps, args.layers, args.budget) == (7, 2, "1GiB")
    # Given explicitly and equal to the default still counts as given.
    args, made = parsed(["--steps", "12", "--quick"])
    assert args.steps == 12
    # The parser's defaults are restored afterwards.
    assert made.get_default("steps") == 12 and made.get_default("layers") is None
    args, _ = parsed([])
    assert (args.steps, args.layers, args.budget) == (12, None, "6GiB")


def test_sizes_below_the_minimum_are_refused(capsys):
    with pytest.raises(SystemExit):
        parsed(["--steps", "0"])
    assert "argument --steps: must be >= 1 (got 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parsed(["--layers", "two"])
    assert "argument --layers: 'two' is not an integer" in capsys.readouterr().err


@pytest.mark.parametrize("script,argv,named", [
    ("train_cpu.py", ["--steps", "-3"], "argument --steps: must be >= 1 (got -3)"),
    ("largest_model.py", ["--quick", "--hidden", "-8"], "argument --hidden: must be >= 1 (got -8)"),
    ("nvme.py", ["--quick", "--repeats", "0"], "argument --repeats: must be >= 1 (got 0)"),
])
def test_drivers_refuse_bad_sizes_before_any_work(script, argv, named, tmp_path):
    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *argv],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert named in done.stderr
    assert not os.path.exists(tmp_path / "bench-results")  # nothing written
