"""One rank of test_hf_trainer_features.py's data-parallel `load_best_model_at_end` run: rank 0
alone writes every checkpoint (its state-dict reads served by rank 1), then every rank loads the
best one back into its engine.

    trainer_features_dp_worker.py OUT_DIR
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import transformers

import patrickstar
from test_hf_trainer_features import _args, _llama, _logged, _Tokens


def main() -> None:
    out, rank = sys.argv[1], int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    model, optimizer = patrickstar.initialize(_llama, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "parallel": {"collective_timeout": 120}})
    # The highest eval_loss is "best": checkpoint-1, not the last
    args = _args(os.path.join(out, "run"), per_device_train_batch_size=4, eval_strategy="steps",
                 eval_steps=1, save_strategy="steps", save_steps=1, max_steps=3,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 greater_is_better=True, save_total_limit=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                   eval_dataset=_Tokens(16), optimizers=(optimizer, None))
    trainer.train()
    every = {name: value.clone() for name, value in model.state_dict().items()}
    torch.save({"every": every, "losses": _logged(trainer, "loss"),
                "best": trainer.state.best_model_checkpoint},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
