"""One rank of test_buffers_data_parallel.py: trains a BatchNorm model through the engine and
through torch's DDP on this rank's half of each batch, and writes both runs' buffers and an
evaluation output to OUT_DIR/rank<r>.pt.

    buffers_worker.py OUT_DIR [ACCUMULATION]   micro-steps per step (DDP: no_sync on the first)
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

import patrickstar
from dp_worker import error_result, save_and_exit


class Normalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.proj(x))))


def run(rank: int, accumulation: int) -> dict:
    torch.manual_seed(0)
    reference = Normalized()
    ddp = nn.parallel.DistributedDataParallel(reference)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(Normalized, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 256,
        "gradient_accumulation_steps": accumulation})
    data = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for micro_step in range(4 * accumulation):
        # Each rank's half differs in scale, so its own statistics differ from the other's.
        x = torch.randn(8, 8, generator=data)[rank * 4:(rank + 1) * 4] * (1 + 2 * rank)
        loss = model(x).pow(2).mean()
        model.backward(loss)
        boundary = (micro_step + 1) % accumulation == 0
        with contextlib.nullcontext() if boundary else ddp.no_sync():
            ref_loss = ddp(x).pow(2).mean()
            (ref_loss / accumulation).backward()
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    trained = {k: v.clone() for k, v in model.module.named_buffers()}
    ref_trained = {k: v.clone() for k, v in reference.named_buffers()}
    model.eval()
    reference.eval()
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, ref_out = model(probe), ddp(probe)
    return {"losses": losses, "ref_losses": ref_losses,
            "trained": trained, "ref_trained": ref_trained,
            "buffers": {k: v.clone() for k, v in model.module.named_buffers()},
            "ref_buffers": {k: v.clone() for k, v in reference.named_buffers()},
            "eval": out, "ref_eval": ref_out}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = run(rank, int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result = error_result(error)
    save_and_exit(out_dir, rank, result)


if __name__ == "__main__":
    main()
