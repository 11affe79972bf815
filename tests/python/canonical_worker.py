"""One rank of test_canonical_scripts.py's data-parallel word_language_model: rank 0 alone
saves the best model with `torch.save(model.module, f)` in the middle of training, as main.py
does (`if rank == 0` in a torchrun port), while rank 1 goes on to its next forward, which
serves the read (Note [Copies of the user's module] in module_copies.py); so is its
`parameters_to_vector(model.parameters())` there (convert_parameters.py).

    canonical_worker.py OUT_DIR
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

import patrickstar
from test_canonical_scripts import RNNModel


def main() -> None:
    out, rank = sys.argv[1], int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: RNNModel("LSTM", 20, 8, 8, 2, 0.0, True), config={
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "parallel": {"collective_timeout": 60}})
    saved = vector = None
    for step, (data, targets) in enumerate(batches()):
        train_step(model, optimizer, data, targets)
        if rank == 0 and step == 1:
            path = os.path.join(out, "model.pt")
            with open(path, "wb") as f:
                torch.save(model.module, f)
            with open(path, "rb") as f:
                saved = torch.load(f, weights_only=False).state_dict()
            with torch.no_grad():  # a weight log on the main process
                vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.save({"saved": saved, "vector": vector}, os.path.join(out, f"rank{rank}.pt"))


def batches():
    """The same batch on every rank: the ranks then train as one process on it."""
    for step in range(3):
        yield (torch.randint(0, 20, (5, 2), generator=torch.Generator().manual_seed(step)),
               torch.randint(0, 20, (10,), generator=torch.Generator().manual_seed(9)))


def train_step(model, optimizer, data, targets) -> None:
    output, _ = model(data, model.init_hidden(2))
    nn.NLLLoss()(output, targets).backward()
    optimizer.step()
    optimizer.zero_grad()


if __name__ == "__main__":
    main()
