"""Reading gradients that live in chunks (`p.grad` is None): `model.full_gradient(p)` and
DeepSpeed's spelling `patrickstar.safe_get_full_grad(p)`, against PyTorch's `p.grad`."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar


def net():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def make(**config):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(net, config={"default_chunk_size": 1024, **config})


def batches(n):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=generator) for _ in range(n)]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [False, True])
def test_full_gradients_are_pytorchs_p_grad(accumulation, clip):
    model, opt = make(gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    reference = net()
    for x in batches(accumulation):
        model.backward(model(x).square().mean())
        (reference(x).square().mean() / accumulation).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is None
        torch.testing.assert_close(patrickstar.safe_get_full_grad(param), ref.grad,
                                   rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(model.full_gradient(name), ref.grad, rtol=1e-5, atol=1e-7)
    opt.step()
    opt.zero_grad()
    assert all(model.full_gradient(p) is None for p in model.parameters())


def test_fp16_gradients_come_without_the_loss_scale():
    model, _ = make(fp16={"enabled": True, "initial_scale_power": 10})
    torch.manual_seed(0)
    reference = net()
    x = batches(1)[0]
    model.backward(model(x.half()).float().square().mean())
    reference(x).square().mean().backward()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(model.full_gradient(param), ref.grad, rtol=2e-2, atol=2e-3)


def test_a_foreign_tensor_or_unknown_name_is_refused():
    model, _ = make()
    with pytest.raises(ValueError, match="not a parameter of a live PatrickStar engine"):
        patrickstar.safe_get_full_grad(nn.Parameter(torch.ones(3)))
    with pytest.raises(KeyError, match="no parameter 'nope'.*e.g. '0.weight'"):
        model.full_gradient("nope")
