"""torch's tracers and function transforms over the engine's module: torch.func.vmap and
functional_call run as on a plain module; torch.jit.trace, torch.export, torch.func.grad (and
vjp, jacrev, hessian) and torch.func.jvp (and jacfwd) cannot work on chunked parameters and raise
naming the plain copy to use (Note [Tracing the engine's module] in traced_calls.py), leaving the
engine training as before; so does torch.jit.script (Note [Scripting the engine's module])."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import patrickstar


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)))


def build():
    torch.manual_seed(0)
    reference = Small()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(Small, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 256})
    return model, optimizer, reference


def assert_trains_as_pytorch(model, optimizer, reference):
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 8, generator=data)
        loss = model(x).pow(2).mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(x).pow(2).mean()
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss, ref_loss)
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor)


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def jit_trace(module):
    return torch.jit.trace(module, (X,))


def export(module):
    return torch.export.export(module, (X,))


def func_grad(module):
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    return torch.func.grad(
        lambda p: torch.func.functional_call(module, p, (X,)).pow(2).mean())(params)


def jacrev(module):
    return torch.func.jacrev(module)(X)


def jvp(module):
    return torch.func.jvp(module, (X,), (torch.ones_like(X),))


def jacfwd(module):
    return torch.func.jacfwd(module)(X[0])


@pytest.mark.parametrize("trace, what", [(jit_trace, "torch.jit.trace"),
                                         (export, "torch.export"),
                                         (func_grad, "torch.func.grad"),
                                         (jacrev, "torch.func.grad"),
                                         (jvp, "torch.func.jvp"),
                                         (jacfwd, "torch.func.jvp")])
@pytest.mark.parametrize("through", ["module", "engine"])
def test_tracers_raise_naming_the_plain_copy_and_training_goes_on(trace, what, through):
    model, optimizer, reference = build()
    with pytest.raises(RuntimeError, match=rf"{what}.*copy\.deepcopy\(model\.module\)"):
        trace(model.module if through == "module" else model)
    assert_trains_as_pytorch(model, optimizer, reference)


@pytest.mark.parametrize("target", ["engine", "module", "submodule"])
def test_jit_script_raises_naming_the_alternatives_and_the_copy_scripts(target):
    # Note [Scripting the engine's module]: before, the engine failed inside its own forward's
    # signature and model.module with "SyntaxError: unmatched ')'".
    model, optimizer, reference = build()
    scripted = {"engine": model, "module": model.module, "submodule": model.module.proj}[target]
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script\(model.*torch\.compile.*"
                                           r"copy\.deepcopy\(model\.module\)"):
        torch.jit.script(scripted)
    assert_trains_as_pytorch(model, optimizer, reference)
    plain = copy.deepcopy(model.module)
    torch.testing.assert_close(torch.jit.script(plain)(X), plain(X))


def test_the_plain_copy_traces_and_transforms_as_pytorch():
    model, _, reference = build()
    plain = copy.deepcopy(model.module)
    torch.testing.assert_close(jit_trace(plain)(X), reference(X))
    torch.testing.assert_close(export(plain).module()(X), reference(X))
    ours, theirs = func_grad(plain), func_grad(reference)
    for key, grad in theirs.items():
        torch.testing.assert_close(ours[key], grad)


def test_vmap_and_functional_call_run_as_on_a_plain_module():
    model, optimizer, reference = build()
    rows = X.unsqueeze(1)
    torch.testing.assert_close(torch.func.vmap(model.module)(rows), torch.func.vmap(reference)(rows))
    doubled = {k: v.detach() * 2 for k, v in reference.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(model.module, doubled, (X,)),
                               torch.func.functional_call(reference, doubled, (X,)))
    assert_trains_as_pytorch(model, optimizer, reference)
