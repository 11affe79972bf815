"""optimizer.params.state_dtype (issue 21): Adam's moments stored in bf16 chunks train like
torch.optim.AdamW, checkpoint and restore exactly, halve the moments' bytes in estimate_memory and
the layout, and bad values name the key. ("int8" has kernels but no engine storage yet.)"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import patrickstar

BASE = {"default_chunk_size": 1 << 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))


def batches(count: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=generator),
             torch.randint(0, 10, (32,), generator=generator)) for _ in range(count)]


def config(state_dtype: str) -> dict:
    result = copy.deepcopy(BASE)
    result["optimizer"]["params"]["state_dtype"] = state_dtype
    return result


def train(model, optimizer, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_moments_train_like_torch_adamw():
    data = batches(150)
    reference = make_model()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    ref_losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        ref_losses.append(loss.item())
    model, optimizer = patrickstar.initialize(make_model, config=config("bf16"))
    losses = train(model, optimizer, data)
    for step, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(ours - ref) <= 0.01 * abs(ref), (step, ours, ref)
    assert losses[-1] < losses[0]
    state = optimizer.state_dict()["state"]
    assert state and all(entry["exp_avg"].dtype == torch.bfloat16 and
                         entry["exp_avg_sq"].dtype == torch.bfloat16 for entry in state.values())
    model.destroy()


def test_bf16_moments_halve_the_moment_bytes():
    fp32 = patrickstar.estimate_memory(make_model, config=config("fp32"))["modes"]["fp32"]
    bf16 = patrickstar.estimate_memory(make_model, config=config("bf16"))["modes"]["fp32"]
    for kind in ("momentum", "variance"):
        assert bf16["by_kind"][kind] * 2 == fp32["by_kind"][kind], kind
    assert bf16["by_kind"]["compute"] == fp32["by_kind"]["compute"]


def test_a_checkpoint_of_bf16_moments_restores_the_same_training(tmp_path):
    data = batches(20)
    model, optimizer = patrickstar.initialize(make_model, config=config("bf16"))
    uninterrupted = train(model, optimizer, data)
    model.destroy()

    model, optimizer = patrickstar.initialize(make_model, config=config("bf16"))
    first = train(model, optimizer, data[:10])
    model.save_checkpoint(str(tmp_path))
    model.destroy()
    model, optimizer = patrickstar.initialize(make_model, config=config("bf16"))
    model.load_checkpoint(str(tmp_path))
    second = train(model, optimizer, data[10:])
    model.destroy()
    assert first + second == uninterrupted


@pytest.mark.parametrize("value, message", [
    ("int8", "'optimizer.params.state_dtype': 'int8' is not available in the engine yet"),
    ("fp16", "'optimizer.params.state_dtype': expected 'fp32' or 'bf16', got 'fp16'"),
])
def test_bad_state_dtypes_name_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        patrickstar.initialize(make_model, config=config(value))


def test_checkpoints_load_across_state_dtypes(tmp_path):
    # The moments are converted on load, fp32 into bf16 chunks and back. The layouts differ (a
    # chunk's dtype is part of it), so without allow_reshard the load says so.
    data = batches(6)
    model, optimizer = patrickstar.initialize(make_model, config=config("fp32"))
    train(model, optimizer, data[:3])
    model.save_checkpoint(str(tmp_path / "fp32"))
    fp32_state = optimizer.state_dict()["state"]
    model.destroy()
    model, optimizer = patrickstar.initialize(make_model, config=config("bf16"))
    with pytest.raises(Exception, match="allow_reshard=True"):
        model.load_checkpoint(str(tmp_path / "fp32"))
    model.load_checkpoint(str(tmp_path / "fp32"), allow_reshard=True)
    for index, entry in optimizer.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(entry[key], fp32_state[index][key].bfloat16())
    losses = train(model, optimizer, data[3:])
    assert all(loss == loss for loss in losses)
    model.save_checkpoint(str(tmp_path / "bf16"))
    model.destroy()
    model, optimizer = patrickstar.initialize(make_model, config=config("fp32"))
    model.load_checkpoint(str(tmp_path / "bf16"), allow_reshard=True)
    assert next(iter(optimizer.state_dict()["state"].values()))["exp_avg"].dtype == torch.float32
    model.destroy()
