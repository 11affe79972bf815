"""One rank of test_peft_recipes.py's data-parallel test: a PEFT model built in model_func and
trained on this rank's half of each batch, its adapter saved on rank 0 alone.

    peft_worker.py OUT_DIR RECIPE [RECIPE...]

Writes OUT_DIR/rank<r>.pt (dp_worker.save_and_exit).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import patrickstar
from dp_worker import error_result, save_and_exit
from test_peft_recipes import CONFIG, STEPS_DP, VOCAB, batches_dp, _peft_model


def run(out: str, recipe: str, rank: int, world: int) -> dict:
    model, opt = patrickstar.initialize(lambda: _peft_model(recipe), config=CONFIG)
    losses = []
    for ids in batches_dp():
        mine = ids.chunk(world)[rank]
        loss = model(input_ids=mine, labels=mine).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    state = model.module.state_dict()  # every rank, as DDP users read it
    adapter_dir = os.path.join(out, f"adapter_{recipe}")
    if rank == 0:  # the usual `if is_main_process: model.save_pretrained(...)`
        model.module.save_pretrained(adapter_dir)
    dist.barrier()
    with torch.no_grad():
        logits = model(input_ids=batches_dp()[0][:1]).logits
    model.destroy()
    return {"losses": losses, "state": state, "adapter_dir": adapter_dir, "logits": logits}


def main() -> None:
    out, recipes = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for recipe in recipes:
        try:
            results[recipe] = run(out, recipe, rank, world)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[recipe] = error_result(error)
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
