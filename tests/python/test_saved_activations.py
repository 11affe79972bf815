"""Activations autograd saves in the engine's forward (activations.py, the CPU measure of
non-model data) live as long as their graph, as in plain PyTorch: a training-mode forward whose
loss is dropped without a backward frees its saved tensors and its count (Note [Saved
activations without their graph])."""
from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch import nn

import patrickstar


class SavesItsOutput(nn.Module):
    """sigmoid and tanh save their outputs for backward: the case that made a cycle."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.outputs: list[weakref.ref] = []

    def forward(self, x):
        hidden = torch.sigmoid(self.a(x))
        self.outputs.append(weakref.ref(hidden))
        return torch.tanh(self.b(hidden)).square().mean()


def _engine(config=None):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(SavesItsOutput, config={"default_chunk_size": 8192,
                                                              **(config or {})})


def test_a_dropped_training_forward_frees_its_saved_tensors_as_in_pytorch():
    torch.manual_seed(0)
    plain = SavesItsOutput()
    loss = plain(torch.randn(32, 64))
    del loss
    gc.collect()
    assert plain.outputs[0]() is None  # PyTorch frees the graph with its last reference

    model, _ = _engine()
    for _ in range(3):
        loss = model(torch.randn(32, 64))
        assert model.non_model_bytes() > 0
        del loss
        gc.collect()
        assert model.non_model_bytes() == 0
    assert all(ref() is None for ref in model.module.outputs)
    model.destroy()

