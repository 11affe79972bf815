"""Activation checkpointing's recomputed forwards under a device budget (Note [Recomputed
forwards] in engine.py): the same training as PyTorch, reentrant or not, while chunks move."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches

CHUNK = 1024  # elements: each block's two layers sit in chunks of their own


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return nn.functional.cross_entropy(self.head(x), y)


def batches(steps):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=generator, requires_grad=True),
             torch.randint(0, 4, (8,), generator=generator)) for _ in range(steps)]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_under_a_device_budget_match_pytorch(reentrant):
    # Before: reentrant recomputation saved F.linear's weight.t() over chunk memory that moved
    # before the block's backward read it (parameters drifted by 0.05 after 5 steps);
    # non-reentrant recomputation stopped inside `down` and never released it (out of memory).
    data = batches(5)
    torch.manual_seed(0)
    reference = Checkpointed(reentrant)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: Checkpointed(reentrant),
        config={"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0}},
                "default_chunk_size": CHUNK, "memory": {"device_budget": 4 * CHUNK * 4}})
    for x, y in data:
        loss = reference(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours = model(x, y)
        model.backward(ours)
        optimizer.step()
        optimizer.zero_grad()
        assert ours.item() == pytest.approx(loss.item(), rel=1e-5)
    assert model.memory_stats()[0]["evictions"] > 0
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("autograd", [False, True])
def test_example_gpt_activation_checkpointing_under_a_device_budget(autograd):
    """The example GPT's activation_checkpointing (non-reentrant) trains under a device budget as
    without checkpointing (it ran out of memory: every recomputed block stayed pinned)."""
    def run(checkpointing):
        cfg = GPTConfig(vocab_size=128, max_seq_len=16, hidden=32, layers=3, heads=2,
                        activation_checkpointing=checkpointing)
        torch.manual_seed(0)
        model, optimizer = patrickstar.initialize(lambda: GPT(cfg), config={
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "default_chunk_size": 4096,
            "memory": {"device_budget": 6 * 4096 * 4}})
        losses = []
        for x, y in synthetic_batches(cfg, batch=4, steps=4):
            loss = model(x, y)
            loss.backward() if autograd else model.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert model.memory_stats()[0]["evictions"] > 0
        return losses, model.state_dict()

    plain, checkpointed = run(False), run(True)
    assert checkpointed[0] == plain[0]
    for name, tensor in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], tensor, rtol=0, atol=0)
