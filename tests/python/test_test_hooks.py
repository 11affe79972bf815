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


def test_checkpoint_crash_hook_is_announced(monkeypatch, capfd, tmp_path):
    model, opt = patrickstar.initialize(lambda: torch.nn.Linear(4, 4),
                                        config={"default_chunk_size": 1024})
    model.backward(model(torch.randn(2, 4)).sum())
    opt.step()
    model.save_checkpoint(tmp_path, tag="quiet")
    assert "CRASH_AT" not in capfd.readouterr().err
    monkeypatch.setenv("PATRICKSTAR_CHECKPOINT_CRASH_AT", "no_such_stage")
    model.save_checkpoint(tmp_path, tag="loud")
    err = capfd.readouterr().err
    assert "PATRICKSTAR_CHECKPOINT_CRASH_AT=no_such_stage is set" in err
    assert "kills its own process" in err
    model.destroy()
