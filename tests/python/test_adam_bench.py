"""tools/bench/adam.py as a user runs it: explicit sizes win over --quick's, and bad arguments
are refused before anything is allocated, naming the problem (an unknown --only ran nothing and
exited 0 with an empty JSON; a negative --params failed deep in torch)."""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench",
                      "adam.py")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bad_arguments_are_named():
    done = run("--only", "nomatch")
    assert done.returncode == 2 and "--only 'nomatch' matches no variant" in done.stderr
    assert "'ours bf16 param kahan + int8 state'" in done.stderr
    done = run("--params", "-5")
    assert done.returncode == 2 and "--params and --reps must be >= 1" in done.stderr


def test_explicit_sizes_win_over_quick(tmp_path):
    out = tmp_path / "adam.json"
    done = run("--quick", "--only", "int8 state + bf16 copy, bf16", "--params", "65536", "--reps",
               "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["params"] == 65536
    name = "ours int8 state + bf16 copy, bf16 grads"
    assert list(result["variants"]) == [name]
    assert len(result["variants"][name]["ours_all"]) == 2
    assert result["variants"][name]["bytes_per_param"] == 16
