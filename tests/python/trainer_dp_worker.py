"""One rank of test_hf_training.py's data-parallel Trainer run: Hugging Face's Trainer saves its
checkpoints (model and optimizer state) on the main process only, and `trainer.save_model()`
after train() reads the model there alone while rank 1's script ends (Note [Reads on one rank
are served] in data_parallel.py: rank 1's engine serves it at its end). With `late`, rank 0
reads after rank 1's end stopped waiting (END_WAIT_S made 1 s): an error naming the barrier.

    trainer_dp_worker.py OUT_DIR [late]
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
    late = sys.argv[2:] == ["late"]
    # (late: no checkpoint, whose read leaves every group gathered for the final one)
    trainer = _trainer(model, optimizer, os.path.join(out, "run"), 4,
                       save_steps=None if late else 2)
    trainer.train()
    if late:
        import time

        from patrickstar import data_parallel
        data_parallel.END_WAIT_S = 1.0
        if rank == 1:
            model.destroy()  # its end: it serves for 1 s, then leaves
        if rank == 0:
            time.sleep(3)  # rank 1's end has given up waiting by then
            try:
                trainer.save_model(os.path.join(out, "final"))
            except Exception as error:  # noqa: BLE001 (reported to the test)
                with open(os.path.join(out, f"error{rank}"), "w") as report:
                    report.write(f"{error}\n{getattr(error, '__notes__', '')}")
        return
    every = {name: value.clone() for name, value in model.state_dict().items()}
    torch.save({"every": every, "losses": _train_losses(trainer)},
               os.path.join(out, f"rank{rank}.pt"))
    trainer.save_model(os.path.join(out, "final"))  # rank 1 ends its script here
    if rank == 0:
        with open(os.path.join(out, "saved"), "w") as done:
            done.write("final model saved\n")


if __name__ == "__main__":
    main()
