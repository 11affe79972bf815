"""Classic PyTorch training recipes run on the engine as a user brings them, each against the
same model trained by plain PyTorch (torch.optim.Adam/AdamW, same seeds and data)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar


def initialize_alongside(model_func, optimizer: str = "AdamW", lr: float = 1e-2,
                         weight_decay: float = 0.1):
    """The engine and the plain model with torch's optimizer, built from the same seed."""
    torch.manual_seed(0)
    reference = model_func()
    ref_optimizer = getattr(torch.optim, optimizer)(reference.parameters(), lr=lr,
                                                    weight_decay=weight_decay)
    torch.manual_seed(0)
    model, ours = patrickstar.initialize(model_func, config={
        "optimizer": {"type": optimizer, "params": {"lr": lr, "weight_decay": weight_decay,
                                                    "adam_w_mode": optimizer == "AdamW"}},
        "default_chunk_size": 4096})
    return model, ours, reference, ref_optimizer


def assert_same_weights(model, reference) -> None:
    state = model.state_dict()
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[key], tensor, msg=key)


class Branching(nn.Module):
    """A branch taken only in some steps: its parameters get no gradient in the others."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, take_branch: bool):
        h = torch.relu(self.body(x))
        if take_branch:
            h = h + self.branch(h)
        return self.head(h)


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
@pytest.mark.parametrize("zero_grad", ["optimizer_first", "optimizer", "model", "model.module",
                                       "part", "set_to_none_later"])
def test_zero_grad_keeping_zeros_updates_unused_parameters_as_pytorch(zero_grad, optimizer):
    # zero_grad(set_to_none=False) (torch's default before 2.0) leaves p.grad zeros, so
    # torch's Adam moves a parameter unused in a step by its first moment (and AdamW's
    # decay): the engine skipped it (Note [Gradients zeroed, not dropped] in optimizer.py).
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
    model, ours, reference, ref_optimizer = initialize_alongside(Branching, optimizer)

    def zero(engine, opt, module, step):
        set_to_none = zero_grad == "set_to_none_later" and step >= 3
        if zero_grad in ("optimizer_first", "optimizer", "set_to_none_later"):
            opt.zero_grad(set_to_none=set_to_none)
        elif zero_grad == "model":
            engine.zero_grad(set_to_none=False)
        elif zero_grad == "model.module":
            module.zero_grad(set_to_none=False)
        else:  # the branch keeps zeros, the rest is dropped
            module.branch.zero_grad(set_to_none=False)
            module.body.zero_grad()
            module.head.zero_grad()

    for step in range(6):
        for engine, opt, module in ((model, ours, model.module), (reference, ref_optimizer,
                                                                  reference)):
            if zero_grad == "optimizer_first":
                zero(engine, opt, module, step)
            loss = (engine(x, step in (0, 4)) - y).pow(2).mean()
            loss.backward()
            opt.step()
            if zero_grad != "optimizer_first":
                zero(engine, opt, module, step)
    assert_same_weights(model, reference)
