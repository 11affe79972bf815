"""tools/bench/train_cpu.py's documented smoke run (`--quick`) as a user runs it: it must train
every contender and write its JSON, not stop at initialize() on a budget below what one module
needs on the device; an explicit size given with it wins (--quick replaced it silently)."""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "bench",
                      "train_cpu.py")


def test_quick_run_trains_every_contender(tmp_path):
    out = tmp_path / "train_cpu.json"
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--steps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["median_step_seconds"]) == {
        "torch_adamw", "torch_adamw_fused", "ours_no_budget", "ours_budget_50",
        "ours_budget_25"}
    assert result["steps"] == 3  # --quick's own is 4
    assert all(len(v) == result["steps"] for v in result["step_seconds"].values())
    budgets = result["device_budget_bytes"]
    assert budgets["ours_budget_50"] >= budgets["ours_budget_25"] >= 4 * (1 << 18) * 4
