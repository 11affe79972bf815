"""One rank of test_interrupts.py's 2-rank runs: a backward that raised on every rank.

    failed_backward_worker.py OUT_DIR

For each case of test_interrupts.FAILED_BACKWARD_CASES (how the backward is called, the layer
whose hook raises, the hook's kind, gradient_accumulation_steps): trains STEPS steps on this
rank's half of each batch; in step 1 the step's last backward raises in the user's hook on
every rank, the script catches it and calls optimizer.zero_grad(), then runs step 1 again.
Results in OUT_DIR/rank<r>.pt (the gathered state dict per case, or the error), as
test_data_parallel.launch reads them.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings

import patrickstar
from dp_worker import save_and_exit
from test_interrupts import (FAILED_BACKWARD_CASES, FailedBackwardNet, backward_by, case_id,
                             failed_backward_batches, raising_hook, step_losses)


def run(case: tuple, rank: int, world: int) -> dict:
    how, layer, kind, accumulation = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(FailedBackwardNet, config={
            "default_chunk_size": 4096, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "parallel": {"collective_timeout": 30}})
    for step, (x, y) in enumerate(failed_backward_batches()):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if step == 1:
            handles = []
            for micro, loss in enumerate(step_losses(
                    model, x, y, accumulation,
                    lambda: handles.append(raising_hook(getattr(model.module, layer), kind)))):
                if micro < accumulation - 1:  # the micro-steps before the failure
                    backward_by(how, model, loss, accumulation)
                    continue
                try:
                    backward_by(how, model, loss, accumulation)
                except RuntimeError as error:
                    if "a user's backward hook failed" not in str(error):
                        raise
                else:
                    raise AssertionError("the hook did not raise")
                handles[0].remove()
            del loss
            optimizer.zero_grad()
        for loss in step_losses(model, x, y, accumulation):
            backward_by(how, model, loss, accumulation)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.destroy()
    return {"state": state}


def main() -> None:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for case in FAILED_BACKWARD_CASES:
        try:
            results[case_id(case)] = run(case, rank, world)
        except Exception as error:  # noqa: BLE001 (reported to the test, which fails on it)
            results[case_id(case)] = {"error": repr(error), "traceback": traceback.format_exc()}
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
