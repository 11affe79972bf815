"""`optimizer.state` read out of the chunks, and add_param_group refused (optimizer.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP


def test_state_matches_torch_adamw():
    data = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(3)]
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096})
    assert len(optimizer.state) == 0 and optimizer.state[next(model.parameters())] == {}
    for x, y in data:
        reference(x, y).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(optimizer.state) == len(list(reference.parameters()))
    for param, ref_param in zip(model.parameters(), reference.parameters()):
        state, ref_state = optimizer.state[param], ref_optimizer.state[ref_param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == float(ref_state["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-8)
    assert list(optimizer.state) == list(model.parameters())
    with pytest.raises(TypeError, match="read-only"):
        optimizer.state[next(model.parameters())] = {}


def test_add_param_group_after_initialize_is_refused():
    model, optimizer = patrickstar.initialize(MLP, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 4096})
    with pytest.raises(ValueError, match=r"param_groups=\.\.\."):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(optimizer.param_groups) == 1


def test_pickling_the_optimizer_names_what_to_save():
    import io
    _, optimizer = patrickstar.initialize(MLP, config={"default_chunk_size": 4096})
    with pytest.raises(TypeError, match=r"optimizer.state_dict\(\)"):
        torch.save(optimizer, io.BytesIO())
