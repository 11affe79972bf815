"""One rank of test_lowp_boundaries.py's 2-rank runs of the tied odd vocabulary.

    lowp_boundaries_worker.py OUT_DIR RUN [RUN...]     runs of TWO_RANK by run_id

For each run: train STEPS on this rank's half of each batch; train RESUME_AT, save to
OUT_DIR/two-RUN (kept for the test's 2 -> 1 load), load into a new engine and train the rest.
Results in OUT_DIR/rank<r>.pt as test_data_parallel.launch reads them."""
from __future__ import annotations

import os
import sys
import traceback

from dp_scenarios import shard
from dp_worker import save_and_exit
from test_lowp_boundaries import (RESUME_AT, TWO_RANK, TiedLM, cpu_state, initialize, run_config,
                                  run_id, tied_batches, tied_train)


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


def main() -> None:
    out, wanted = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    runs = {run_id(r): r for r in TWO_RANK}
    results = {}
    for name in wanted:
        try:
            results[name] = run(out, runs[name], rank, world)
        except Exception as error:  # noqa: BLE001 (reported to the test, which fails on it)
            results[name] = {"error": repr(error), "traceback": traceback.format_exc()}
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
