"""One rank of test_lowp_boundaries.py's 2-rank runs.

    lowp_boundaries_worker.py OUT_DIR RUN [RUN...]     runs of TWO_RANK by run_id, or
                                                      "tables-STATE_DTYPE"

For each TWO_RANK run (the tied odd vocabulary): train STEPS on this rank's half of each batch;
train RESUME_AT, save to OUT_DIR/two-RUN (kept for the test's 2 -> 1 load), load into a new
engine and train the rest. For "tables-STATE_DTYPE": TwoTables without a host budget
(profiled) and within one. Results in OUT_DIR/rank<r>.pt as test_data_parallel.launch reads
them."""
from __future__ import annotations

import json
import os
import sys
import traceback

from dp_scenarios import shard
from dp_worker import save_and_exit
from test_lowp_boundaries import (RESUME_AT, TABLES_HOST_BUDGET, TWO_RANK, TiedLM, TwoTables,
                                  cpu_state, initialize, run_config, run_id, tables_config,
                                  tables_train, tied_batches, tied_train)


def run(out: str, which: tuple, rank: int, world: int) -> dict:
    cfg = run_config(which, world)
    data = [shard(batch, rank, world) for batch in tied_batches(batch=4)]
    model, optimizer = initialize(TiedLM, cfg)
    losses = tied_train(model, optimizer, data)
    final = cpu_state(model)
    model.destroy()
    model, optimizer = initialize(TiedLM, cfg)
    first = tied_train(model, optimizer, data[:RESUME_AT])
    model.save_checkpoint(os.path.join(out, f"two-{run_id(which)}"), tag="t")
    at_save = cpu_state(model)
    model.destroy()
    model, optimizer = initialize(TiedLM, cfg)
    model.load_checkpoint(os.path.join(out, f"two-{run_id(which)}"), "t")
    second = tied_train(model, optimizer, data[RESUME_AT:])
    resumed = cpu_state(model)
    model.destroy()
    return {"losses": losses, "final": final, "at_save": at_save,
            "resumed_losses": first + second, "resumed": resumed}


def tables(out: str, state_dtype: str, rank: int) -> dict:
    """TwoTables trained without a host budget (profiled into OUT_DIR/profile-STATE_DTYPE),
    then within TABLES_HOST_BUDGET (its losses: reading the state dict moves a table's compute
    chunk to the host, beyond the budget)."""
    result = {}
    for budget in (None, TABLES_HOST_BUDGET):
        cfg = tables_config(state_dtype, budget)
        if budget is None:
            cfg["profile"] = {"enabled": True,
                              "output_dir": os.path.join(out, f"profile-{state_dtype}")}
        model, optimizer = initialize(TwoTables, cfg)
        layout = json.loads(model.chunks.layout_json())["chunks"]
        losses = tables_train(model, optimizer, rank)
        result[budget] = {"losses": losses, "host_peak": max(
            t["peak_chunk_bytes"] for t in model.memory_stats() if t["kind"] == "host")}
        model.destroy()
    result["layout"] = layout
    return result


def main() -> None:
    out, wanted = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    runs = {run_id(r): r for r in TWO_RANK}
    results = {}
    for name in wanted:
        try:
            results[name] = (tables(out, name.removeprefix("tables-"), rank)
                             if name.startswith("tables-") else run(out, runs[name], rank, world))
        except Exception as error:  # noqa: BLE001 (reported to the test, which fails on it)
            results[name] = {"error": repr(error), "traceback": traceback.format_exc()}
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
