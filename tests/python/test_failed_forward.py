"""A forward that raised partway (a shape error in a notebook, a bad batch) leaves the engine as
plain PyTorch leaves a module: usable at once, also by calls that are not forwards (Note [A
forward that raised] in engine.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 1024}


def build():
    return nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("call", ["engine", "module"])
def test_state_dict_save_and_training_after_a_forward_that_raised_match_pytorch(call, tmp_path):
    """The pattern `try: loss = model(batch) ... except: model.save_checkpoint(dir); raise`:
    before, the module whose forward raised kept its parameters in COMPUTE, so state_dict() and
    save_checkpoint() raised 'illegal state transition COMPUTE -> COMPUTE' and the next
    training step 'HOLD -> HOLD_AFTER_BWD'."""
    torch.manual_seed(0)
    reference = build()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(build, config=CONFIG)
    bad, good = torch.randn(3, 7), torch.randn(3, 16)
    forward = model if call == "engine" else model.module
    with pytest.raises(RuntimeError) as plain:
        reference(bad)
    with pytest.raises(RuntimeError) as caught:
        forward(bad)
    assert str(caught.value) == str(plain.value)
    state = model.module.state_dict()
    for key, tensor in reference.state_dict().items():
        assert torch.equal(state[key], tensor)
    assert model.save_checkpoint(str(tmp_path))
    for _ in range(2):
        reference(good).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model.backward(model(good).square().sum())
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, rtol=1e-5, atol=1e-6)
    model.destroy()
