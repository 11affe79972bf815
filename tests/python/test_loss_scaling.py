"""fp16 dynamic loss scaling in training, against DeepSpeed's DynamicLossScaler rules."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.loss_scaler import DynamicLossScaler, LossScaleAtMinimum


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))).float(), y)


class DeepSpeedScaler:
    """The schedule of DeepSpeed's DynamicLossScaler.update_scale (the scaler of its ZeRO
    stages), counters named as there: growth when `(cur_iter - last_overflow_iter) %
    scale_window == 0`, hysteresis spent per overflow, refilled on growth (or every clean step
    with consecutive_hysteresis), an error at the minimum scale."""

    def __init__(self, scale, min_scale, hysteresis, consecutive, window=10**9, factor=2.0):
        self.scale, self.min_scale, self.window, self.factor = scale, min_scale, window, factor
        self.delayed_shift = self.hysteresis = hysteresis
        self.consecutive = consecutive
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError("Current loss scale already at minimum")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive:
                self.hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.delayed_shift
                self.scale *= self.factor
        self.cur_iter += 1


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


def test_scaler_schedule_is_deepspeeds():
    """Growth, backoff, hysteresis and the minimum on random overflow patterns: the scale after
    every step equals DeepSpeed's (Note [When the scale grows])."""
    for seed in range(300):
        compare_with_deepspeed(random.Random(seed))


def compare_with_deepspeed(rng):
    window, hysteresis = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3])
    consecutive, p_overflow = rng.random() < 0.5, rng.choice([0.05, 0.2, 0.5, 0.8])
    min_scale, scale = rng.choice([1.0, 4.0]), 2.0 ** rng.randint(2, 8)
    ours = DynamicLossScaler(scale=scale, scale_window=window, hysteresis=hysteresis,
                             min_scale=min_scale, consecutive_hysteresis=consecutive)
    reference = DeepSpeedScaler(scale, min_scale, hysteresis, consecutive, window)
    for step in range(60):
        overflow = rng.random() < p_overflow
        try:
            reference.update(overflow)
        except RuntimeError:
            with pytest.raises(LossScaleAtMinimum):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == reference.scale, (step, overflow)


def test_growth_in_training_is_deepspeeds():
    """The engine updates the scale once per optimizer step: with loss_scale_window 3 the scale
    of each step equals DeepSpeed's, growth included (the first growth after 3 clean steps)."""
    model, opt = make(loss_scale_window=3, hysteresis=1, min_loss_scale=1)
    reference = DeepSpeedScaler(16.0, 1.0, 1, False, window=3)
    pattern = [False, False, False, False, True, False, False, False, False, False, False, True,
               True, False, False, False]
    scales = []
    for (x, y), overflow in zip(batches(len(pattern)), pattern):
        train_step(model, opt, x, y, overflow)
        reference.update(overflow)
        scales.append((opt.loss_scale, reference.scale))
    assert [a for a, _ in scales] == [b for _, b in scales]
    assert scales[2][0] == 32.0  # grown after the third clean step, as DeepSpeed
