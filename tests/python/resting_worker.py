"""One rank of test_resting_params.py's data-parallel test: reads of parameters outside the
forward on every rank (Note [Parameters at rest]), after two steps; with `rank0`, a value read
on rank 0 only after a step (a logging read under `if rank == 0`, served by the other rank)
instead.

    resting_worker.py OUT_DIR [rank0]
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
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    rank0_only = sys.argv[2:] == ["rank0"]
    warnings.simplefilter("ignore")
    result = {}
    try:
        torch.manual_seed(0)
        model, opt = patrickstar.initialize(MLP, config={
            "default_chunk_size": 4096,
            "parallel": {"collective_timeout": 60 if rank0_only else 20},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
        ema = [p.clone() for p in model.parameters()]
        for x, y in mlp_batches(2):
            model.backward(model(x.chunk(2)[rank], y.chunk(2)[rank]))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.5).add_(p, alpha=0.5)
        if rank0_only:
            x, y = next(iter(mlp_batches(1)))
            model.backward(model(x.chunk(2)[rank], y.chunk(2)[rank]))
            opt.step()
            if rank == 0:  # served by rank 1's forward (Note [Reads on one rank are served])
                result["lonely_norm"] = model.module.layers[0].weight.norm()
            model(x.chunk(2)[rank], y.chunk(2)[rank])  # rank 1 went on training
            with torch.no_grad():  # between that forward and its backward: logging
                result["every_norm"] = model.module.layers[0].weight.norm()  # on every rank
            save_and_exit(out, rank, result)
        result["numel"] = sum(p.numel() for p in model.parameters())
        result["norms"] = [p.norm().item() for p in model.parameters()]
        result["ema"] = ema
        result["state"] = model.state_dict()
        x, y = next(iter(mlp_batches(1)))
        result["loss"] = model(x.chunk(2)[rank], y.chunk(2)[rank]).item()  # trains on
    except BaseException as error:  # noqa: BLE001 (reported to the test)
        result.update(error_result(error))
    save_and_exit(out, rank, result)


if __name__ == "__main__":
    main()
