"""Test hooks that act through the environment say so loudly when they are armed (issue 20,
item 7): a forgotten variable must not make a production run fail on purpose in silence."""
from __future__ import annotations

import warnings

import torch

import patrickstar


def test_fault_injection_environment_is_announced(monkeypatch, capfd):
    monkeypatch.setenv("PATRICKSTAR_FAULT_INJECT", "copy:after=1000000")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(lambda: torch.nn.Linear(4, 4),
                                          config={"default_chunk_size": 1024})
    err = capfd.readouterr().err
    assert "PATRICKSTAR_FAULT_INJECT=copy:after=1000000 is set" in err
    assert "fail on purpose" in err
    model.destroy()
    monkeypatch.delenv("PATRICKSTAR_FAULT_INJECT")
    model, _ = patrickstar.initialize(lambda: torch.nn.Linear(4, 4),
                                      config={"default_chunk_size": 1024})
    assert "PATRICKSTAR_FAULT_INJECT" not in capfd.readouterr().err
    model.destroy()
