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


@pytest.mark.parametrize("extra, weight_keys", [
    ({"bf16": {"enabled": True}}, {"master_param"}),
    ({"bf16": {"enabled": True, "master_weights": False}, "state_dtype": "int8"},
     {"param_compensation", "compensated_param", "exp_avg_scale", "exp_avg_sq_scale"})],
    ids=["bf16", "bf16-no-master-int8-state"])
def test_each_parameters_state_is_its_state_dict_entry(extra, weight_keys):
    # As in torch, where state_dict() is built from optimizer.state: the same keys and values
    # (Note [The state view lists the state dict's keys] in optimizer.py).
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": 4096}
    if "state_dtype" in extra:
        config["optimizer"]["params"]["state_dtype"] = extra["state_dtype"]
    config.update({key: value for key, value in extra.items() if key != "state_dtype"})
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    for _ in range(2):
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        model(x.bfloat16(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = optimizer.state_dict()["state"]
    for number, param in enumerate(model.parameters()):
        state = optimizer.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} | weight_keys
        assert state.keys() == saved[number].keys()
        for key, value in state.items():
            assert torch.equal(value, saved[number][key]), (number, key)
    model.destroy()


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
