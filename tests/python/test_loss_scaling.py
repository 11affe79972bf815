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


def _state_tensors(opt):
    return {(index, key): value.clone() for index, entry in opt.state_dict()["state"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("bad, error", [
    ("notadict", r"'loss_scaler': expected a dict .*got str 'notadict'"),
    ({"cur_scale": 8.0}, r"unknown keys \['cur_scale'\]"),
    ({"scale": "abc"}, r"'scale' must be a number, got str 'abc'"),
    ({"scale": -1.0}, r"'scale' must be finite and > 0, got -1.0"),
    ({"scale": 8.0, "scale_window": 0}, r"'scale_window' must be a whole number >= 1, got 0"),
    ({"scale": 8.0, "overflows": 1.5}, r"'overflows' must be a whole number >= 0, got 1.5")])
def test_a_bad_saved_loss_scaler_is_refused_before_anything_is_loaded(bad, error):
    """Note [A loss scaler's saved state]: the optimizer's moments stay those before the load."""
    model, opt = make()
    train_step(model, opt, *batches(1)[0], overflow=False)
    saved = opt.state_dict()
    saved["loss_scaler"] = bad
    other, other_opt = make()
    train_step(other, other_opt, *batches(1, seed=3)[0], overflow=False)
    before, scaler_before = _state_tensors(other_opt), other_opt.loss_scaler.state_dict()
    with pytest.raises((TypeError, ValueError), match=error):
        other_opt.load_state_dict(saved)
    after = _state_tensors(other_opt)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert other_opt.loss_scaler.state_dict() == scaler_before


def _bf16_engine():
    torch.manual_seed(0)
    return patrickstar.initialize(MLP, config={"bf16": {"enabled": True},
                                               "default_chunk_size": 4096})


def test_a_loss_scale_saved_in_another_precision_is_not_loaded():
    """An fp16 run's dynamic scale loaded into a bf16 engine set its constant scale 1 to 65536,
    and a bf16 run's scale 1 would become an fp16 run's dynamic scale: each keeps its own,
    while the moments load."""
    fp16, fp16_opt = make(initial_scale_power=16)
    train_step(fp16, fp16_opt, *batches(1)[0], overflow=False)
    bf16, bf16_opt = _bf16_engine()
    x, y = batches(1)[0]
    loss = bf16(x.bfloat16(), y)
    bf16.backward(loss)
    bf16_opt.step()
    bf16_opt.zero_grad()
    from_fp16 = fp16_opt.state_dict()
    from_bf16 = bf16_opt.state_dict()

    other_bf16, other_bf16_opt = _bf16_engine()
    other_bf16_opt.load_state_dict(from_fp16)
    assert other_bf16_opt.loss_scaler.scale == 1.0
    loaded = other_bf16_opt.state_dict()["state"]
    for index, entry in from_fp16["state"].items():
        assert torch.equal(loaded[index]["exp_avg"], entry["exp_avg"])

    other_fp16, other_fp16_opt = make(initial_scale_power=16)
    other_fp16_opt.load_state_dict(from_bf16)
    assert other_fp16_opt.loss_scaler.scale == 2.0**16
    assert other_fp16_opt.state_dict()["state"][0]["step"] == 1
