"""nanoGPT's train.py flow under torchrun, ported to the engine as a user would (test_data_parallel's
nanoGPT test): ranks seeded apart, gradient accumulation divided by the world size, the
evaluation and the checkpoint under `if master_process:` (Note [Reads on one rank are served] in
data_parallel.py), loss.backward() per micro-step, clip_grad_norm_, the learning rate set in the
param groups each iteration.

    nanogpt_ddp_worker.py OUT_DIR
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches

CONFIG = GPTConfig(vocab_size=128, max_seq_len=32, hidden=64, layers=2, heads=4)
EVAL_BATCHES = 3


def eval_batches():
    return list(synthetic_batches(CONFIG, 8, EVAL_BATCHES, seed=100))


def main() -> None:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = rank == 0
    gradient_accumulation_steps = 4 // world
    torch.manual_seed(1337 + rank)
    model, optimizer = patrickstar.initialize(lambda: GPT(CONFIG), config={
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}},
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "default_chunk_size": 1 << 16, "parallel": {"collective_timeout": 120}})
    data = list(synthetic_batches(CONFIG, 8, 40, seed=rank))

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        losses = torch.tensor([model(x, y).item() for x, y in eval_batches()])
        model.train()
        return losses.mean().item()

    result = {"eval": {}}
    batch = 0
    for iter_num in range(10):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (iter_num + 1) / 3)
        if iter_num % 4 == 0 and master_process:
            result["eval"][iter_num] = estimate_loss()
            if iter_num > 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iter_num": iter_num}, os.path.join(out, "ckpt.pt"))
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            x, y = data[batch % len(data)]
            batch += 1
            (model(x, y) / gradient_accumulation_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
