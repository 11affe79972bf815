"""The optimizer initialize() returns in a plain PyTorch training loop, against torch's AdamW
with the same seeds: steps without gradients (Note [A step without gradients] in
optimizer.py), lr schedulers, param_groups edited mid-run, state_dict's structure."""
from __future__ import annotations

import warnings

import pytest
import torch

import patrickstar
from test_checkpoint import assert_identical, full_state
from test_initialize import MLP, mlp_batches

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "default_chunk_size": 4096}


def pair(config=CONFIG, **torch_options):
    """(reference, its torch AdamW, engine, its optimizer), the same initial weights."""
    torch.manual_seed(0)
    reference = MLP()
    options = dict(lr=1e-2, weight_decay=0.01, foreach=False)
    options.update(torch_options)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **options)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(MLP, config=config)
    return reference, ref_optimizer, model, optimizer


def assert_same_weights(reference, model, atol=1e-6):
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=atol, msg=name)


def step_counts(optimizer) -> list[float]:
    return [float(entry["step"]) for entry in optimizer.state_dict()["state"].values()]


# ---- Steps without gradients -------------------------------------------------------------------

def test_a_step_before_the_first_backward_is_a_no_op_as_in_pytorch():
    reference, ref_optimizer, model, optimizer = pair()
    before = full_state(model, optimizer)
    assert ref_optimizer.step(lambda: 3.0) == 3.0
    assert optimizer.step(lambda: 3.0) == 3.0
    assert optimizer.step() is None
    assert len(ref_optimizer.state) == len(optimizer.state) == 0
    assert optimizer.state_dict()["state"] == {}
    assert_identical(before, full_state(model, optimizer))
    assert model.global_steps == 0 and model.skipped_steps == 0
    assert not model.was_step_applied()
    for x, y in mlp_batches(2):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(reference, model)
    assert step_counts(optimizer) == [2.0] * 6
    assert model.global_steps == 2


def test_an_accumulation_loop_stepping_before_each_window_trains_as_pytorch():
    """`if i % accum == 0: optimizer.step(); optimizer.zero_grad()` before the backward: the
    first step has no gradients."""
    reference, ref_optimizer, model, optimizer = pair()
    accumulation = 3
    for i, (x, y) in enumerate(mlp_batches(7)):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            if i % accumulation == 0:
                opt.step()
                opt.zero_grad()
            (net(x, y) / accumulation).backward()
    for opt in (ref_optimizer, optimizer):
        opt.step()
    assert_same_weights(reference, model)
    assert step_counts(optimizer) == [3.0] * 6 == [
        float(entry["step"]) for entry in ref_optimizer.state_dict()["state"].values()]
    assert model.global_steps == 3


def test_a_forward_without_backward_then_a_step_changes_nothing_and_training_goes_on():
    """A batch skipped after its forward (`continue` past a bad loss), in train mode."""
    reference, ref_optimizer, model, optimizer = pair()
    batches = list(mlp_batches(4))
    for index, (x, y) in enumerate(batches):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            loss = net(x, y)
            if index != 1:
                loss.backward()
            opt.step()
            opt.zero_grad()
        if index == 1:
            assert model.global_steps == 1
    assert_same_weights(reference, model)
    assert step_counts(optimizer) == [3.0] * 6
    assert model.global_steps == 3


def test_a_step_after_a_dropped_accumulation_changes_nothing():
    reference, ref_optimizer, model, optimizer = pair()
    (x, y), (x2, y2) = mlp_batches(2)
    for net, opt in ((reference, ref_optimizer), (model, optimizer)):
        net(x, y).backward()
        opt.step()
        opt.zero_grad()
        net(x2, y2).backward()
        opt.zero_grad()  # the accumulation is dropped
        opt.step()
    assert_same_weights(reference, model)
    before = full_state(model, optimizer)
    optimizer.step()
    assert_identical(before, full_state(model, optimizer))
    assert step_counts(optimizer) == [1.0] * 6 and model.global_steps == 1


@pytest.mark.parametrize("zeroing", ["optimizer", "model", "none"])
def test_a_second_step_without_zero_grad_is_refused_where_torch_reapplies_gradients(zeroing):
    """torch's p.grad still holds the last step's gradients; the engine's step consumed them
    (README): refused before anything changes, unless zero_grad() came between."""
    _, _, model, optimizer = pair()
    (x, y), = mlp_batches(1)
    model.backward(model(x, y))
    optimizer.step()
    if zeroing == "optimizer":
        optimizer.zero_grad(set_to_none=False)  # zeros: an applied step with zero gradients
        optimizer.step()
        optimizer.zero_grad()
    elif zeroing == "model":
        model.module.zero_grad()
    before = full_state(model, optimizer)
    if zeroing == "none":
        with pytest.raises(RuntimeError, match="zero_grad\(\) since the last step"):
            optimizer.step()
        optimizer.zero_grad()
    optimizer.step()
    assert_identical(before, full_state(model, optimizer))
    model.backward(model(x, y))
    optimizer.step()


def test_a_step_after_zero_grad_set_to_none_false_updates_with_zero_gradients():
    """torch keeps zero p.grad there, and Adam moves those parameters by their moments."""
    reference, ref_optimizer, model, optimizer = pair()
    (x, y), = mlp_batches(1)
    for net, opt in ((reference, ref_optimizer), (model, optimizer)):
        net(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()
    assert_same_weights(reference, model)
    assert step_counts(optimizer) == [2.0] * 6
    assert model.global_steps == 2 and model.was_step_applied()


def test_a_step_without_gradients_leaves_the_fp16_loss_scale_and_counters():
    config = {**CONFIG, "fp16": {"enabled": True, "initial_scale_power": 8,
                                 "loss_scale_window": 1}}
    _, _, model, optimizer = pair(config)
    (x, y), = mlp_batches(1)
    model.backward(model(x.half(), y))
    optimizer.step()
    optimizer.zero_grad()
    scale, steps = optimizer.loss_scale, model.global_steps
    before = full_state(model, optimizer)
    for _ in range(3):
        optimizer.step()
    assert_identical(before, full_state(model, optimizer))
    assert (optimizer.loss_scale, model.global_steps, model.skipped_steps) == (scale, steps, 0)


def test_a_configured_scheduler_may_be_stepped_after_a_step_without_gradients():
    """Torch's habit of an optimizer.step() before the first scheduler.step(): the
    configured scheduler's once-per-step check takes it as a step not applied."""
    config = {**CONFIG, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}}
    _, _, model, optimizer = pair(config)
    optimizer.step()
    model.lr_scheduler.step()
    for x, y in mlp_batches(3):
        model.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
        model.lr_scheduler.step()
    assert model.global_steps == 3


def test_a_step_after_a_failed_backward_still_names_it():
    _, _, model, optimizer = pair()
    (x, y), = mlp_batches(1)

    def fail(grad):
        raise KeyboardInterrupt

    handle = model.module.layers[0].weight.register_hook(fail)
    with pytest.raises(KeyboardInterrupt):
        model.backward(model(x, y))
    handle.remove()
    with pytest.raises(RuntimeError, match="zero_grad"):
        optimizer.step()
