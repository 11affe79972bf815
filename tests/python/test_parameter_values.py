"""ParameterValues (parameter_values.py): which chunk kinds a load writes (Note [Loading the
weights the model has]) and reads of whole weights. torch's load errors are tested in
test_module_state_dict.py (test_engine_load_state_dict_errors_are_torchs), the resume idioms in
test_torch_save_resume.py, writes into released parameters in test_parameter_writes.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import _C

K = _C.ChunkKind
CONFIG = {"default_chunk_size": 4096, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def trained_bf16():
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: nn.Linear(16, 8), config=CONFIG)
    for _ in range(3):
        x = torch.randn(4, 16).bfloat16()
        model.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return model


def master(model, name: str) -> torch.Tensor:
    index = model.params.names.index(name)
    return model.params.read(index, K.MASTER_PARAM)


def test_new_weights_replace_the_master_and_the_held_ones_keep_it():
    model = trained_bf16()
    before = master(model, "weight").clone()
    held = model.state_dict()["weight"]  # bf16, what the master rounds to
    assert not torch.equal(before, held.float())  # the master is finer than its bf16 value
    model.load_parameter(model.params.names.index("weight"), held)
    assert torch.equal(master(model, "weight"), before)  # the same weights: kept
    fp32 = held.float() + 1e-4  # another dtype (an fp32 state dict): new weights
    model.load_parameter(model.params.names.index("weight"), fp32)
    assert torch.equal(master(model, "weight"), fp32)
    assert torch.equal(model.read_parameter(model.params.names.index("weight")),
                       fp32.bfloat16())
    model.destroy()


def test_a_state_dict_load_reads_back_as_torchs():
    model = trained_bf16()
    torch.manual_seed(3)
    plain = nn.Linear(16, 8)
    result = model.load_state_dict({"weight": plain.weight.detach()}, strict=False)
    assert result == plain.load_state_dict({"weight": plain.weight.detach()}, strict=False)
    assert torch.equal(model.state_dict()["weight"], plain.weight.detach().bfloat16())
    assert torch.equal(master(model, "weight"), plain.weight.detach())
    with pytest.raises(RuntimeError, match="size mismatch for bias"):
        model.load_state_dict({"weight": plain.weight.detach(), "bias": torch.zeros(3)})
    model.destroy()
