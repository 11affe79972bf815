"""optimizer.params.eps 0, which torch.optim.AdamW(eps=0) accepts, trains as torch's AdamW for
every state dtype and precision: the same weights while the second moments are positive, and
torch's NaN (0 / 0) where an element's gradients were all exactly zero."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar

# (state_dtype, precision section, tolerance against fp32 torch.optim.AdamW)
CASES = [("fp32", {}, 1e-6), ("bf16", {}, 2e-4), ("int8", {}, 3e-3),
         ("fp32", {"bf16": {"enabled": True}}, 3e-3),
         ("fp32", {"bf16": {"enabled": True, "master_weights": False}}, 5e-3)]


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(count, zero_column):
    generator = torch.Generator().manual_seed(1)
    result = [torch.randn(4, 8, generator=generator) for _ in range(count)]
    if zero_column:  # column 0 of the first weight then gets exactly zero gradients
        for x in result:
            x[:, 0] = 0
    return result


def train(state_dtype, precision, data):
    config = {"default_chunk_size": 1024, **precision,
              "optimizer": {"type": "AdamW",
                            "params": {"lr": 1e-2, "eps": 0, "state_dtype": state_dtype}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(net, config=config)
    dtype = torch.bfloat16 if precision else torch.float32
    for x in data:
        model.backward(model(x.to(dtype)).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    assert all(group["eps"] == 0 for group in optimizer.param_groups)
    return {name: value.float() for name, value in model.state_dict().items()}


def reference(data):
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0)
    for x in data:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("state_dtype, precision, tolerance", CASES)
def test_eps_zero_trains_as_torchs_adamw(state_dtype, precision, tolerance):
    data = batches(3, zero_column=False)
    ours, expected = train(state_dtype, precision, data), reference(data)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=tolerance, msg=name)


@pytest.mark.parametrize("state_dtype, precision, tolerance", CASES)
def test_eps_zero_gives_torchs_nan_where_the_gradients_were_zero(state_dtype, precision,
                                                                   tolerance):
    data = batches(1, zero_column=True)
    ours, expected = train(state_dtype, precision, data), reference(data)
    for name, value in expected.items():
        assert torch.equal(ours[name].isnan(), value.isnan()), name
        torch.testing.assert_close(ours[name].nan_to_num(), value.nan_to_num(), rtol=0,
                                   atol=tolerance, msg=name)
    assert ours["0.weight"][:, 0].isnan().all()


def test_eps_zero_in_param_groups_is_accepted_and_a_negative_one_refused():
    def initialize(eps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return patrickstar.initialize(net, config={"default_chunk_size": 1024},
                                          param_groups=lambda model: [
                                              {"params": list(model.parameters()), "eps": eps}])
    assert initialize(0.0)[1].param_groups[0]["eps"] == 0.0
    with pytest.raises(ValueError, match="eps must be >= 0.*eps=-1"):
        initialize(-1.0)
