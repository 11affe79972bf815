"""A config without an 'optimizer' section (Note [A config without an optimizer] in
initializer.py): the engine trains torch.optim.Adam's defaults, as before, and initialize() now
says so on stderr instead of silently; a config with the section hears nothing."""
from __future__ import annotations

import torch
from torch import nn

import patrickstar
from patrickstar import initializer


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_no_optimizer_section_trains_torch_adam_defaults_and_says_so(capfd, monkeypatch):
    monkeypatch.setattr(initializer, "_logged_default_optimizer", False)  # once per process
    torch.manual_seed(0)
    reference = MLP()
    torch_opt = torch.optim.Adam(reference.parameters())
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(MLP, config={"default_chunk_size": 1024})
    err = capfd.readouterr().err
    assert "config has no 'optimizer' section: training Adam with lr 0.001" in err
    assert "DeepSpeed would return no optimizer" in err and "lr 0.01" in err
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=generator)
        expected = reference(x).square().mean()
        torch_opt.zero_grad()
        expected.backward()
        torch_opt.step()
        loss = model(x).square().mean()
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected)
    for name, param in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param)


def test_an_optimizer_section_is_not_remarked(capfd):
    patrickstar.initialize(MLP, config={"default_chunk_size": 1024,
                                        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert "'optimizer' section" not in capfd.readouterr().err


def test_the_default_optimizer_is_remarked_once_per_process(capfd, monkeypatch):
    """A loop building engines (a sweep, a test suite) heard the paragraph at every
    initialize(): 20 engines, 20 warnings."""
    monkeypatch.setattr(initializer, "_logged_default_optimizer", False)
    for _ in range(3):
        model, _ = patrickstar.initialize(MLP, config={"default_chunk_size": 1024})
        model.destroy()
    assert capfd.readouterr().err.count("config has no 'optimizer' section") == 1
