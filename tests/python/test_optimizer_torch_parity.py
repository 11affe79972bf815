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
        with pytest.raises(RuntimeError, match=r"zero_grad\(\) since the last step"):
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


@pytest.mark.parametrize("set_to_none", [True, False])
def test_p_grad_set_to_none_before_the_step_leaves_that_parameter_alone_as_torch(set_to_none):
    """Note [p.grad = None at rest] in resting_params.py: torch's step skips it (weight,
    moments and step count), the chunked gradient was applied anyway. Kept zeros
    (set_to_none=False) set to None are skipped too."""
    reference, ref_optimizer, model, optimizer = pair()
    for step, (x, y) in enumerate(mlp_batches(3)):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            if step == 1:  # torch's zeros but for layers.1.bias: no-op with set_to_none
                net.layers[1].bias.grad = None
                opt.step()
            net(x, y).backward()
            if step == 0:
                net.layers[0].weight.grad = None
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    assert_same_weights(reference, model)
    counts = []
    for opt in (optimizer, ref_optimizer):
        state = opt.state_dict()["state"]
        counts.append([float(state[index]["step"]) for index in sorted(state)])
    assert counts[0] == counts[1] == ([2.0] + [3.0] * 5 if set_to_none else
                                      [2.0, 4.0, 4.0, 3.0, 4.0, 4.0])
    assert [p.grad is None for p in model.parameters()] == [
        p.grad is None for p in reference.parameters()]


def test_p_grad_set_to_zeros_by_hand_steps_as_torchs_zero_gradient():
    """Note [Gradients set by hand at rest] in resting_params.py: zeros set by hand (all of
    them between steps, or one in place of its backward's gradient) are torch's zero gradient,
    which Adam applies; they were lost (no move) and p.grad read shape (0,)."""
    reference, ref_optimizer, model, optimizer = pair()
    for step, (x, y) in enumerate(mlp_batches(3)):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            net(x, y).backward()
            if step == 1:
                net.layers[1].weight.grad = torch.zeros_like(net.layers[1].weight)
            opt.step()
            opt.zero_grad()
            if step == 0:
                for param in net.parameters():
                    param.grad = torch.zeros_like(param)
                opt.step()
    assert_same_weights(reference, model)
    for opt in (optimizer, ref_optimizer):
        state = opt.state_dict()["state"]
        assert [float(state[index]["step"]) for index in sorted(state)] == [4.0] * 6
    model.layers[0].bias.grad = torch.zeros(64)
    assert [None if p.grad is None else tuple(p.grad.shape) for p in model.parameters()] == [
        None, (64,), None, None, None, None]


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
    model.backward(model(x.half(), y) * 1e6)  # overflows fp16
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.overflow and model.skipped_steps == 1
    optimizer.step()  # found no overflow: accelerate's step_was_skipped reads it
    assert not optimizer.overflow and model.skipped_steps == 1


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


# ---- lr schedulers -----------------------------------------------------------------------------

def _hf_cosine(optimizer):
    transformers = pytest.importorskip("transformers")
    return transformers.get_cosine_schedule_with_warmup(optimizer, 2, 10)


L = torch.optim.lr_scheduler
SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda step: 0.9 ** step),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.05, total_steps=10),  # cycles beta1
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(
        o, T_0=3, T_mult=2, eta_min=1e-4),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, 1e-3, 1e-2, step_size_up=2, cycle_momentum=True,
                                     base_momentum=0.8, max_momentum=0.95),  # cycles beta1
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, 0.1, 1.0, 3), L.ExponentialLR(o, 0.8)], milestones=[3]),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, 0.5, 4), L.ExponentialLR(o, 0.9)]),
    "get_cosine_schedule_with_warmup": _hf_cosine,
}


def _train(net, optimizer, scheduler, batches, start=0) -> list:
    """Steps and schedules; the lr and betas after each scheduler step."""
    seen = []
    for index, (x, y) in enumerate(batches, start):
        net(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if isinstance(scheduler, L.ReduceLROnPlateau):
            scheduler.step(1.0 + index % 2)  # worse every other step
        else:
            scheduler.step()
        seen.append([(group["lr"], tuple(group["betas"])) for group in optimizer.param_groups])
    return seen


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_torch_schedulers_drive_the_optimizer_as_torchs_adamw(kind):
    reference, ref_optimizer, model, optimizer = pair()
    make = SCHEDULERS[kind]
    ref_scheduler, scheduler = make(ref_optimizer), make(optimizer)
    batches = list(mlp_batches(8))
    assert _train(model, optimizer, scheduler, batches) == \
        _train(reference, ref_optimizer, ref_scheduler, batches)
    assert_same_weights(reference, model)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("how", ["checkpoint", "state_dicts"])
def test_a_scheduler_resumed_across_an_engine_checkpoint_goes_on_as_torchs(tmp_path, kind, how):
    reference, ref_optimizer, model, optimizer = pair()
    make = SCHEDULERS[kind]
    batches = list(mlp_batches(8))
    expected = _train(reference, ref_optimizer, make(ref_optimizer), batches)
    scheduler = make(optimizer)
    _train(model, optimizer, scheduler, batches[:4])
    if how == "checkpoint":
        model.lr_scheduler = scheduler
        model.save_checkpoint(tmp_path)
    else:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, tmp_path / "saved.pt")
    model.destroy()
    _, _, model, optimizer = pair()
    scheduler = make(optimizer)
    if how == "checkpoint":
        model.lr_scheduler = scheduler
        model.load_checkpoint(tmp_path)
    else:
        saved = torch.load(tmp_path / "saved.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    assert _train(model, optimizer, scheduler, batches[4:], start=4) == expected[4:]
    assert_same_weights(reference, model)


def test_a_step_without_gradients_silences_torchs_scheduler_order_warning_as_in_torch():
    _, ref_optimizer, model, optimizer = pair()  # the model kept: it owns the engine
    for optimizer in (ref_optimizer, optimizer):
        scheduler = L.LambdaLR(optimizer, lambda step: 0.5 ** step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
            scheduler.step()
        assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
        assert optimizer.param_groups[0]["lr"] == 5e-3


# ---- param_groups ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_groups_edited_during_training_train_as_torchs(kind):
    """lr, betas (a tuple or a list), eps, weight_decay and a tensor lr set between steps."""
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = getattr(torch.optim, kind)(reference.parameters(), lr=1e-2,
                                               weight_decay=0.01, foreach=False)
    config = {"optimizer": {"type": kind, "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                     "adam_w_mode": kind == "AdamW"}},
              "default_chunk_size": 4096}
    _, _, model, optimizer = pair(config)
    edits = [("lr", 3e-3), ("betas", (0.8, 0.99)), ("eps", 1e-3), ("weight_decay", 0.5),
             ("betas", [0.5, 0.9]), ("lr", torch.tensor(2e-3)), ("weight_decay", 0)]
    for index, (x, y) in enumerate(mlp_batches(len(edits) + 1)):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            if index:
                key, value = edits[index - 1]
                for group in opt.param_groups:
                    group[key] = value
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert_same_weights(reference, model)


def test_a_tensor_lr_in_the_groups_trains_as_torchs():
    """torch.optim.AdamW takes `lr=torch.tensor(...)`; initialize() refused it ("expected a
    number, got Tensor"), and so did load_state_dict in a saved torch state dict."""
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-2),
                                      weight_decay=0.01, foreach=False)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=CONFIG, param_groups=lambda module: [
        {"params": list(module.parameters()), "lr": torch.tensor(1e-2)}])
    schedulers = [L.LambdaLR(opt, lambda step: 0.8 ** step)
                  for opt in (ref_optimizer, optimizer)]
    for x, y in mlp_batches(4):
        for net, opt, scheduler in zip((reference, model), (ref_optimizer, optimizer),
                                       schedulers):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
    assert_same_weights(reference, model)
    assert float(optimizer.param_groups[0]["lr"]) == float(ref_optimizer.param_groups[0]["lr"])
    optimizer.load_state_dict(ref_optimizer.state_dict())


def test_amsgrad_set_during_training_is_refused_and_nothing_changes():
    reference, ref_optimizer, model, optimizer = pair()
    (x, y), = mlp_batches(1)
    model.backward(model(x, y))
    before = full_state(model, optimizer)
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"\['amsgrad'\] is True.*no amsgrad variant.*"
                                         r"nothing was updated"):
        optimizer.step()
    assert_identical(before, full_state(model, optimizer))
    optimizer.param_groups[0]["amsgrad"] = False
    optimizer.step()


def test_state_dict_has_torchs_structure_and_loads_both_ways():
    reference, ref_optimizer, model, optimizer = pair()
    batches = list(mlp_batches(5))
    for x, y in batches[:3]:
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    ours, theirs = optimizer.state_dict(), ref_optimizer.state_dict()
    assert set(ours) - {"loss_scaler"} == set(theirs) == {"state", "param_groups"}
    for group in theirs["param_groups"]:
        group["foreach"] = None  # the reference's foreach=False; ours says torch's default
    assert ours["param_groups"] == theirs["param_groups"]
    assert list(ours["state"]) == list(theirs["state"])
    for number, entry in theirs["state"].items():
        assert set(ours["state"][number]) == set(entry)
        for key, value in entry.items():
            mine = ours["state"][number][key]
            assert (mine.dtype, mine.shape, mine.device) == (value.dtype, value.shape,
                                                              value.device), key
            torch.testing.assert_close(mine, value, rtol=0, atol=1e-6)
    # The engine's dict into torch's AdamW, and torch's into a new engine.
    torch.manual_seed(0)
    other = MLP()
    other.load_state_dict(model.state_dict())
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.01,
                                        foreach=False)
    other_optimizer.load_state_dict(ours)
    _, _, resumed, resumed_optimizer = pair()
    resumed.load_state_dict(reference.state_dict())
    resumed_optimizer.load_state_dict(theirs)
    for x, y in batches[3:]:
        for net, opt in ((reference, ref_optimizer), (other, other_optimizer),
                         (resumed, resumed_optimizer)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(reference, resumed)
    assert_same_weights(other, resumed)


def _decay_split(module):
    """A torch optimizer's named groups (nanoGPT's split, kept with names)."""
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")],
             "param_names": [n for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")],
             "param_names": [n for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


@pytest.mark.parametrize("form", ["named_parameters", "torch_groups"])
def test_named_parameters_keep_their_names_in_the_groups_as_torchs(form):
    """Note [Named parameters in the groups] in optimizer.py: torch keeps "param_names"; a torch
    optimizer's groups with them were refused ("unknown keys ['param_names']")."""
    torch.manual_seed(0)
    reference = MLP()
    ref_optimizer = torch.optim.AdamW(
        reference.named_parameters() if form == "named_parameters" else _decay_split(reference),
        lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    built = MLP()
    groups = built.named_parameters() if form == "named_parameters" else \
        torch.optim.AdamW(_decay_split(built), lr=1e-2, weight_decay=0.01).param_groups
    model, optimizer = patrickstar.initialize(built, config=CONFIG, param_groups=groups)
    assert [group["param_names"] for group in optimizer.param_groups] == \
        [group["param_names"] for group in ref_optimizer.param_groups]
    for x, y in mlp_batches(3):
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert_same_weights(reference, model)
    ours, theirs = optimizer.state_dict(), ref_optimizer.state_dict()
    assert [group["param_names"] for group in ours["param_groups"]] == \
        [group["param_names"] for group in theirs["param_groups"]]
    optimizer.load_state_dict(theirs)
    ref_optimizer.load_state_dict(ours)


@pytest.mark.parametrize("names", [["layers.0.weight"], "layers.0.weight", [1, 2, 3, 4, 5, 6]])
def test_param_names_that_do_not_name_each_parameter_once_are_refused(names):
    built = MLP()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['param_names'\]: expected"):
        patrickstar.initialize(built, config=CONFIG, param_groups=[
            {"params": list(built.parameters()), "param_names": names}])
