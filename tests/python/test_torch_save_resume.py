"""The plain PyTorch checkpoint idiom: `torch.save({"model": model.state_dict(), "optimizer":
optimizer.state_dict()}, path)`, then in a new engine `load_state_dict` both and go on. As
with torch.optim over fp32 parameters, the losses after the resume equal an uninterrupted
run's bit for bit, in every precision: the optimizer's state dict carries what 16-bit
`model.state_dict()` values cannot (Note [Master weights in the optimizer's state dict] in
optimizer.py)."""
from __future__ import annotations

import gc
import io

import pytest
import torch

import patrickstar
from test_initialize import MLP

BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "default_chunk_size": 4096}
CONFIGS = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2}},
    "bf16": {"bf16": {"enabled": True}},
    "bf16-int8-state": {"bf16": {"enabled": True}, "state_dtype": "int8"},
    "bf16-no-master": {"bf16": {"enabled": True, "master_weights": False}},
    "bf16-no-master-int8-state": {"bf16": {"enabled": True, "master_weights": False},
                                  "state_dtype": "int8"},
}


def config(name: str) -> dict:
    result = {**BASE, "optimizer": {"type": "AdamW", "params": dict(BASE["optimizer"]["params"])}}
    for key, value in CONFIGS[name].items():
        if key == "state_dtype":
            result["optimizer"]["params"]["state_dtype"] = value
        else:
            result[key] = value
    return result


def build(name: str):
    torch.manual_seed(0)
    return patrickstar.initialize(MLP, config=config(name))


def batch(step: int, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 32, generator=generator).to(dtype),
            torch.randint(0, 10, (8,), generator=generator))


def train(model, optimizer, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*batch(step, model.compute_dtype))
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def saved(model, optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    return buffer.getvalue()


def resumed(name: str, checkpoint: bytes, steps, optimizer_first: bool = False):
    model, optimizer = build(name)
    state = torch.load(io.BytesIO(checkpoint), map_location="cpu")
    if optimizer_first:
        optimizer.load_state_dict(state["optimizer"])
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scale = optimizer.loss_scale
    losses = train(model, optimizer, steps)
    final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    return losses, scale, final


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_save_of_both_state_dicts_resumes_bit_for_bit(name):
    model, optimizer = build(name)
    train(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    scale = optimizer.loss_scale
    expected = train(model, optimizer, range(4, 12))
    expected_final = torch.load(io.BytesIO(saved(model, optimizer)))
    del model, optimizer
    gc.collect()
    losses, loaded_scale, final = resumed(name, checkpoint, range(4, 12))
    assert loaded_scale == scale
    assert losses == expected
    # 16-bit losses and weights round away small differences; the fp32 moments do not.
    assert_same_state(final, expected_final)


def assert_same_state(ours: dict, expected: dict) -> None:
    for key, value in expected["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for index, entry in expected["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["optimizer"]["state"][index][key], value), (index, key)
