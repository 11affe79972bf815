"""fp16 dynamic loss scaling in training, against DeepSpeed's DynamicLossScaler rules."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.loss_scaler import LossScaleAtMinimum


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))).float(), y)


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, for the hysteresis and minimum rules (its
    growth comes one step later than ours: Note [When the scale grows]; the windows here are
    long enough that no growth happens)."""

    def __init__(self, scale, min_scale, hysteresis, consecutive):
        self.scale, self.min_scale = scale, min_scale
        self.delayed_shift = self.hysteresis = hysteresis
        self.consecutive = consecutive

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis -= 1
        elif self.consecutive:
            self.hysteresis = self.delayed_shift


def batches(steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=generator).half(),
             torch.randint(0, 4, (4,), generator=generator)) for _ in range(steps)]


def make(**fp16):
    torch.manual_seed(0)
    config = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 100,
                       "hysteresis": 2, "min_loss_scale": 2, **fp16},
              "default_chunk_size": 4096}
    return patrickstar.initialize(MLP, config=config)


def train_step(model, opt, x, y, overflow):
    loss = model(x, y)
    model.backward(loss * float("inf") if overflow else loss)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("consecutive", [False, True])
def test_scale_and_skips_follow_deepspeed_and_stop_at_the_minimum(consecutive):
    model, opt = make(consecutive_hysteresis=consecutive)
    reference = DeepSpeedScaler(16.0, 2.0, 2, consecutive)
    pattern = [True, False, True, False, True, True, False, True, False, True, True, True, True]
    applied = 0
    for step, ((x, y), overflow) in enumerate(zip(batches(len(pattern)), pattern)):
        try:
            reference.update(overflow)
        except RuntimeError:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            skipped = model.skipped_steps
            with pytest.raises(LossScaleAtMinimum, match=r"fp16.min_loss_scale = 2\b"):
                train_step(model, opt, x, y, overflow)
            # The step was skipped and counted; the engine trains on afterwards.
            assert model.skipped_steps == skipped + 1 and not model.was_step_applied()
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, before[name]), name
            break
        train_step(model, opt, x, y, overflow)
        applied += not overflow
        assert opt.loss_scale == reference.scale, step
        assert model.was_step_applied() == (not overflow), step  # PatrickStar's own loop
        assert opt.overflow == overflow, step  # DeepSpeed's optimizer attribute
        assert model.skipped_steps == step + 1 - applied
        # A skipped step does not advance Adam's step count (its bias correction).
        assert all(state["step"] == applied for state in opt.state.values()), step
    else:
        pytest.fail("the overflows never reached the minimum scale")
    x, y = batches(1, seed=1)[0]
    train_step(model, opt, x, y, overflow=False)
    assert model.was_step_applied() and opt.loss_scale == 2


def test_raise_error_at_min_scale_false_keeps_skipping():
    """Lightning scripts set DeepSpeed's `optimizer.loss_scaler.raise_error_at_min_scale`."""
    model, opt = make(hysteresis=1, initial_scale_power=1)
    opt.loss_scaler.raise_error_at_min_scale = False
    for x, y in batches(3):
        train_step(model, opt, x, y, overflow=True)
    assert opt.loss_scale == 2 and model.skipped_steps == 3


def test_raise_error_at_min_scale_is_kept_across_a_checkpoint_load(tmp_path):
    model, opt = make()
    train_step(model, opt, *batches(1)[0], overflow=False)
    model.save_checkpoint(tmp_path, tag="t")
    other, other_opt = make()
    other_opt.loss_scaler.raise_error_at_min_scale = False
    other.load_checkpoint(tmp_path, "t")
    assert other_opt.loss_scaler.raise_error_at_min_scale is False
    assert other_opt.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
