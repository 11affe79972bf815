"""One rank of a two-rank Hugging Face run (launched by test_hf_families_more.py):

    hf_families_worker.py OUT_DIR SCENARIO [SCENARIO...]

Each scenario of test_hf_families_more.TWO_RANK trains its family on this rank's own batches
(rank r takes batch `step * world + r`: the ranks route tokens to different experts) and
writes the losses, the step-0 full gradients and the gathered state dict to OUT_DIR/rank<r>.pt.
"""
from __future__ import annotations

import os
import sys

import torch

import patrickstar
from dp_worker import error_result, save_and_exit
from test_hf_families_more import STEPS, TWO_RANK, engine_config, rank_batch


def train(name: str, rank: int, world: int) -> dict:
    family, config = TWO_RANK[name]
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(family, config=engine_config(config))
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(**rank_batch(family, step, rank, world, config)).loss
        model.backward(loss)
        losses.append(loss.item())
        if step == 0:
            grads = {n: model.full_gradient(n) for n, _ in model.module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    model.destroy()
    return {"losses": losses, "grads": grads, "state": state}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for name in names:
        try:
            results[name] = train(name, rank, world)
        except Exception as error:  # the test shows it
            results[name] = error_result(error)
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
