"""One rank of test_hf_training.py's data-parallel Trainer run: Hugging Face's Trainer saves its
checkpoints (model and optimizer state) on the main process only, and `trainer.save_model()`
after train() reads the model there alone (Note [Reads on one rank are served] in
data_parallel.py); the barrier after it keeps rank 1 there to serve it.

    trainer_dp_worker.py OUT_DIR [no-barrier]
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

import patrickstar
from test_hf_training import _llama, _train_losses, _trainer


def main() -> None:
    out, rank = sys.argv[1], int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    model, optimizer = patrickstar.initialize(lambda: _llama(tie=False), config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "parallel": {"collective_timeout": 120}})
    trainer = _trainer(model, optimizer, os.path.join(out, "run"), 4, save_steps=2)
    trainer.train()
    every = {name: value.clone() for name, value in model.state_dict().items()}
    torch.save({"every": every, "losses": _train_losses(trainer)},
               os.path.join(out, f"rank{rank}.pt"))
    if sys.argv[2:] == ["no-barrier"]:  # rank 1 ends its script: nobody serves rank 0
        try:
            trainer.save_model(os.path.join(out, "final"))
        except Exception as error:  # noqa: BLE001 (reported to the test)
            with open(os.path.join(out, f"error{rank}"), "w") as report:
                report.write(f"{error}\n{getattr(error, '__notes__', '')}")
        return
    trainer.save_model(os.path.join(out, "final"))
    trainer.accelerator.wait_for_everyone()  # rank 1 serves rank 0's read here
    if rank == 0:
        with open(os.path.join(out, "saved"), "w") as done:
            done.write("final model saved\n")


if __name__ == "__main__":
    main()
