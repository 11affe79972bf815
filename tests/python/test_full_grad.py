"""Reading gradients that live in chunks (`p.grad` is None): `model.full_gradient(p)` and
DeepSpeed's spelling `patrickstar.safe_get_full_grad(p)`, against PyTorch's `p.grad`; and the
zeros `p.grad` reads after zero_grad(set_to_none=False), as torch's."""
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


def grads(params):
    """What each p.grad holds: None, or (shape, dtype, sum of magnitudes)."""
    return [None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype,
                                         float(p.grad.abs().sum())) for p in params]


@pytest.mark.parametrize("zeroing", ["optimizer", "engine", "module"])
@pytest.mark.parametrize("bf16", [False, True])
def test_p_grad_reads_torchs_zeros_after_zero_grad_set_to_none_false(zeroing, bf16):
    """Note [p.grad after zero_grad(set_to_none=False)] in resting_params.py: torch's zeros
    from that zero_grad until the next backward, None after set_to_none=True (and after a
    backward: the gradients are in chunks, read by safe_get_full_grad)."""
    model, opt = make(**({"bf16": {"enabled": True}} if bf16 else {}))
    torch.manual_seed(0)
    reference = net().to(torch.bfloat16 if bf16 else torch.float32)
    ref_opt = torch.optim.AdamW(reference.parameters())
    zero_grad = {"optimizer": opt.zero_grad, "engine": model.zero_grad,
                 "module": model.module.zero_grad}[zeroing]
    x = batches(1)[0].to(torch.bfloat16 if bf16 else torch.float32)
    zero_grad(set_to_none=False)  # no gradient yet: torch's p.grad stays None
    ref_opt.zero_grad(set_to_none=False)
    assert grads(model.parameters()) == grads(reference.parameters()) == [None] * 4
    model.backward(model(x).float().square().mean())
    reference(x).float().square().mean().backward()
    opt.step()
    ref_opt.step()
    zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    expected = grads(reference.parameters())
    assert None not in expected and grads(model.parameters()) == expected
    opt.step()  # a step without a backward keeps them, as torch's
    ref_opt.step()
    assert grads(model.parameters()) == expected
    model.zero_grad(set_to_none=False)  # torch's Module.zero_grad zeroes them in place again
    weight = model.module[0].weight
    weight.grad.zero_()
    weight.grad.mul_(0.5).clamp_(-1, 1)
    weight.grad.detach_()  # not a view, as torch's p.grad
    assert grads(model.parameters()) == expected
    with pytest.raises(RuntimeError, match=r"add_\(\) on p.grad of PatrickStar parameter "
                                           r"'module.0.weight' after zero_grad\(set_to_none="):
        weight.grad.add_(1.0)
    assert grads(model.parameters()) == expected
    assert all(not bool(patrickstar.safe_get_full_grad(p).count_nonzero())
               for p in model.parameters())
    model.backward(model(x).float().square().mean())
    assert grads(model.parameters()) == [None] * 4  # in chunks now (torch: the gradients)
    opt.step()
    zero_grad(set_to_none=False)
    assert grads(model.parameters()) == expected
    zero_grad()  # set_to_none=True, as torch
    ref_opt.zero_grad()
    assert grads(model.parameters()) == grads(reference.parameters()) == [None] * 4


def test_p_grad_zeros_are_kept_for_the_parameters_torch_keeps_them_for():
    """A part zeroed with set_to_none=True reads None while the rest reads zeros; a parameter
    that never had a gradient stays None (torch: never made)."""
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    ref_opt = torch.optim.AdamW(reference.parameters())
    for m in (model.module, reference):
        m[2].bias.requires_grad_(False)
    x = batches(1)[0]
    model.backward(model(x).square().mean())
    reference(x).square().mean().backward()
    for m, o in ((model, opt), (reference, ref_opt)):
        o.step()
        o.zero_grad(set_to_none=False)
    model.module[0].zero_grad(set_to_none=True)
    reference[0].zero_grad(set_to_none=True)
    assert grads(model.parameters()) == grads(reference.parameters())
    assert [g is None for g in grads(reference.parameters())] == [True, True, False, True]


def test_a_gradient_scaling_loop_over_p_grad_warns_naming_the_engines_ways(monkeypatch):
    # `for p in model.parameters(): if p.grad is not None: p.grad.div_(world)` (a hand-written
    # all-reduce's average, or a rescale) finds p.grad None and silently does nothing (Note [p.grad
    # after a backward] in resting_params.py). Before: the warning named only full_gradient and
    # clip_grad_norm_, not how to scale. The ways it names train as torch's loop does.
    from patrickstar import resting_params
    monkeypatch.setattr(resting_params, "_warned_gradient_in_chunks", False)
    model, opt = make(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}})
    torch.manual_seed(0)
    reference = net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x, = batches(1)
    model(x).square().mean().backward()
    with pytest.warns(UserWarning, match=r"p\.grad of PatrickStar parameter 'module\.0\.weight' "
                                         r"is None after the backward.*div_.*changes nothing.*"
                                         r"Scale gradients through the loss.*register_hook.*"
                                         r"clip_grad_value_"):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(4)
    opt.zero_grad()
    for p in model.parameters():  # the hook the warning names
        p.register_hook(lambda g: g / 4)
    reference(x).square().mean().backward()
    for p in reference.parameters():
        if p.grad is not None:
            p.grad.div_(4)
    model(x).square().mean().backward()
    ref_opt.step()
    opt.step()
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=key)
