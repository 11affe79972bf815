"""initialize()'s device-budget check counts what backward pins at once (Note [What backward
pins] in backward_pins.py): a budget one byte short of it is refused at initialize naming the
needed and the given bytes (before, it passed and the first backward raised
ChunkOutOfMemoryError at a gradient store), and the budget it names trains like PyTorch."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import _C
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches

CHUNK = 1 << 16  # elements


class Gate(nn.Module):
    """A parent with a parameter of its own around two children: it stays pinned through their
    backward."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3 * CHUNK // 2) + 0.01 * torch.randn(3 * CHUNK // 2))
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale[:32]


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.gate = Gate()
        self.out = nn.Linear(32, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(self.gate(torch.tanh(self.inp(x)))), y)


def gpt_config():
    # The tied token embedding (2048 x 128) outgrows the chunk and gets one of its own (1 MiB);
    # the position embedding and the final norm share an ordinary one (256 KiB).
    return GPTConfig(vocab_size=2048, max_seq_len=32, hidden=128, layers=0, heads=2)


def gpt_frozen_positions():
    model = GPT(gpt_config())
    model.positions.weight.requires_grad_(False)
    return model


def gpt_batches(steps):
    return list(synthetic_batches(gpt_config(), 2, steps))


def gated_batches(steps):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,),
                                                                    generator=generator))
            for _ in range(steps)]


CASES = {
    # tokens' chunk + positions' chunk + tokens' gradient chunk, at the embeddings' end.
    "embeddings": (lambda: GPT(gpt_config()), gpt_batches,
                   2 * 2048 * 128 * 4 + CHUNK * 4, "the embeddings 'tokens', 'positions'"),
    # A frozen embedding has no backward call and pins nothing: the token embedding's chunk
    # and its gradient chunk.
    "frozen embedding": (gpt_frozen_positions, gpt_batches, 2 * 2048 * 128 * 4,
                         "module 'tokens'"),
    # gate.scale's own chunk (oversize), held while gate.a's backward stores its gradient: + the
    # ordinary chunk gate.a shares with the other Linears + its gradient chunk.
    "ancestor": (Gated, gated_batches, (3 * CHUNK // 2) * 4 + 2 * CHUNK * 4, "module 'gate.a'"),
}


def config(budget):
    return {"default_chunk_size": CHUNK, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "memory": {"device_budget": budget}}


@pytest.mark.parametrize("case", CASES)
def test_a_budget_below_what_backward_pins_is_refused_at_initialize(case):
    build, _, need, where = CASES[case]
    with pytest.raises(_C.ChunkOutOfMemoryError) as raised:
        patrickstar.initialize(build, config=config(need - 1))
    message = str(raised.value)
    assert f"'memory.device_budget' = {need - 1} bytes" in message
    assert f"at {where}" in message
    assert re.search(rf"\): {need} bytes", message), message


@pytest.mark.parametrize("case", CASES)
def test_the_budget_backward_needs_trains_like_pytorch(case):
    build, batches, need, _ = CASES[case]
    torch.manual_seed(0)
    reference = build()
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(build, config=config(need))
    for inputs in batches(3):
        expected = reference(*inputs)
        torch_opt.zero_grad()
        expected.backward()
        torch_opt.step()
        loss = model(*inputs)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    # The device tier: "device" here, "cuda:0" on a GPU or the strict emulated device.
    device = next(t for t in model.memory_stats() if t["name"] not in ("host", "nvme"))
    assert device["peak_chunk_bytes"] == need  # the check's figure is backward's real peak


@pytest.mark.parametrize("call", ["model.backward", "loss.backward"])
def test_a_recomputed_forward_past_the_budget_names_the_key_and_why(call):
    """Note [A backward past what initialize() counted]: activation checkpointing holds a
    recomputed block's chunks beside the gradients, which the module tree does not show, so
    initialize() accepts a budget the first backward runs out of; the error said neither which
    key to raise nor why the check let it through."""
    gpt = GPTConfig(vocab_size=96, max_seq_len=32, hidden=32, layers=2, heads=4,
                    activation_checkpointing=True)
    config = {"default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "memory": {"device_budget": 5 * 4096 * 4}}
    model, _ = patrickstar.initialize(lambda: GPT(gpt), config=config)
    ids, targets = next(iter(synthetic_batches(gpt, 2, 1)))
    loss = model(ids, targets)
    with pytest.raises(_C.ChunkOutOfMemoryError) as raised:
        model.backward(loss) if call == "model.backward" else loss.backward()
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"'memory.device_budget' (= {5 * 4096 * 4} bytes)" in notes, notes
    assert "activation checkpointing" in notes, notes
    model.destroy()
