"""Boundary sizes of the low-precision options that test_boundary_sizes.py's one-parameter-per-
module bag does not reach: a GPT-2-sized vocabulary (50257, odd, not a multiple of the 8-bit
state's 2048-element block nor of a 16-lane vector) on an embedding tied to the head, whose
gradient is the sum of its two uses, with a head bias of the same odd size; each with every
state dtype, fp32 weights or bf16 weights without a master, against the plain-PyTorch
reference of test_boundary_sizes.py; resumed through a checkpoint and through the optimizer's
state dict, bit for bit."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from test_boundary_sizes import (RESUME_AT, STATE_DTYPES, STEPS, WEIGHTS, assert_equal_states,
                                 assert_matches, config, cpu_state, initialize, reference_of,
                                 weights_of)

VOCAB, WIDTH = 50257, 8
CHUNK = 1 << 16  # smaller than the tied embedding (an oversize chunk), larger than the bias


class TiedLM(nn.Module):
    """An embedding and a head sharing one weight (GPT-2's), the head with a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.wte(ids))


def tied_loss(model, ids, targets, dtype):
    return nn.functional.cross_entropy(model(ids).float().view(-1, VOCAB), targets.view(-1))


def tied_batches(steps: int = STEPS):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (2, 6), generator=generator),
             torch.randint(0, VOCAB, (2, 6), generator=generator)) for _ in range(steps)]


def tied_train(model, optimizer, data) -> list[float]:
    losses = []
    for ids, targets in data:
        loss = tied_loss(model, ids, targets, None)
        model.backward(loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_a_tied_odd_vocabulary_trains_like_the_reference_and_resumes_exactly(
        tmp_path, state_dtype, weights):
    cfg, data = config(state_dtype, weights, default_chunk_size=CHUNK), tied_batches()
    model, optimizer = initialize(TiedLM, cfg)
    assert [n for n, _ in model.module.named_parameters()] == ["wte.weight", "head.bias"]
    losses = tied_train(model, optimizer, data)
    held, final = weights_of(model), cpu_state(model)
    model.destroy()
    _, ref_held = reference_of(TiedLM(), data, tied_loss, state_dtype, weights)
    assert_matches(held, ref_held, state_dtype, weights)

    model, optimizer = initialize(TiedLM, cfg)
    first = tied_train(model, optimizer, data[:RESUME_AT])
    model.save_checkpoint(str(tmp_path), tag="t")
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    model.destroy()
    for how in ("checkpoint", "state dicts"):
        model, optimizer = initialize(TiedLM, cfg)
        if how == "checkpoint":
            model.load_checkpoint(str(tmp_path), "t")
        else:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
        second = tied_train(model, optimizer, data[RESUME_AT:])
        resumed = cpu_state(model)
        model.destroy()
        assert first + second == losses, how
        assert_equal_states(resumed, final, how)
        # The tied keys share one tensor, as in PyTorch's state dict.
        assert resumed["wte.weight"].data_ptr() != 0 and torch.equal(resumed["wte.weight"],
                                                                     resumed["head.weight"])
