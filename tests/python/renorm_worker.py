"""One rank of test_embedding_renorm.py's data-parallel test: trains an nn.Embedding(max_norm=1)
model through the engine on this rank's half of each batch, then evaluates a batch split
unevenly (3 rows on rank 0, 1 on rank 1), and writes the losses and the state dicts to
OUT_DIR/rank<r>.pt.

    renorm_worker.py OUT_DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import patrickstar
from dp_worker import error_result, save_and_exit
from test_embedding_renorm import EVAL_IDX, IDX, Lookup, config


def run(rank: int) -> dict:
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(Lookup, config=config(default_chunk_size=256))
    losses = []
    for _ in range(3):
        loss = model(IDX[rank * 2:(rank + 1) * 2])
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        model(EVAL_IDX[:3] if rank == 0 else EVAL_IDX[3:])
    return {"losses": losses, "trained": trained, "evaluated": model.state_dict()}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = run(rank)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result = error_result(error)
    save_and_exit(out_dir, rank, result)


if __name__ == "__main__":
    main()
