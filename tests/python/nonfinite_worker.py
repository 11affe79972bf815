"""One rank of test_guards_data_parallel.py: rank 1's loss is NaN at step 1.

    nonfinite_worker.py OUT_DIR POLICY      POLICY: skip or raise
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

import patrickstar
from dp_worker import error_result, save_and_exit
from test_initialize import MLP, mlp_batches


def main() -> None:
    out, policy = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    result = {"losses": [], "errors": []}
    try:
        torch.manual_seed(0)
        model, opt = patrickstar.initialize(MLP, config={
            "default_chunk_size": 4096, "nonfinite_loss": policy,
            "parallel": {"collective_timeout": 20}})
        for step, (x, y) in enumerate(mlp_batches(4)):
            x = x.chunk(2)[rank]
            loss = model(x, y.chunk(2)[rank])
            if step == 1 and rank == 1:
                loss = loss * float("nan")
            try:
                model.backward(loss)
            except FloatingPointError as error:
                result["errors"].append(str(error))
                model.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
            result["losses"].append(loss.item())
        result["skipped_steps"] = opt.skipped_steps
        result["state"] = model.state_dict()
    except BaseException as error:  # noqa: BLE001 (reported to the test)
        result.update(error_result(error))
    save_and_exit(out, rank, result)


if __name__ == "__main__":
    main()
