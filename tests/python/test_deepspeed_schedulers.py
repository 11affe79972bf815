"""DeepSpeed's config `scheduler` section builds `model.lr_scheduler` with DeepSpeed's curves:
each type's lr sequence against the formula written out here, training against plain PyTorch
with a LambdaLR of the same schedule, resume through checkpoints, bad params refused by name,
and PatrickStar's own loop (optimizer.step()) told when nothing steps the scheduler."""
from __future__ import annotations

import math

import pytest
import torch

import patrickstar
from test_deepspeed_port import MLP, assert_close, batches, config, torch_run

LR = 1e-2  # the optimizer's lr in config()


def warm(p, n, kind):
    n = max(2, n)
    return math.log(p + 1) / math.log(n) if kind == "log" else p / n


# DeepSpeed's documented formulas (deepspeed/runtime/lr_schedules.py), written out: the lr the
# optimizer holds at scheduler position p (-1 before the first step).
def warmup_lr(p, lo=0.0, hi=LR, n=1000, kind="log"):
    if p < 0:
        return lo
    return lo + (hi - lo) * (warm(p, n, kind) if p < max(2, n) else 1.0)


def warmup_decay_lr(p, total, lo=0.0, hi=0.001, n=1000, kind="log"):
    if p < 0:
        return lo
    n2 = max(2, n)
    gamma = warm(p, n, kind) if p < n2 else max(0.0, (total - p) / max(1.0, total - n2))
    return lo + (hi - lo) * gamma


def warmup_cosine_lr(p, total, r0=0.0, n=1000, cmin=1e-4, kind="log"):
    n2 = max(2, n)
    if p < 0:
        return 0.0
    if p < n2:
        return LR * (r0 + warm(p, n, kind) * (1 - r0))
    progress = min(1.0, (p - n2 + 1) / max(1, total - n2))
    return LR * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle_scale(p, first, second, stairs=0):
    b, total = p + 1, first + second
    x = b / total - math.floor(b / total)
    ratio = first / total
    scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
    if stairs:
        into = b % total
        pos = into * stairs / first if into <= first else (total - into) * stairs / second
        scale = math.floor(pos) / stairs
    return scale


def one_cycle_lr(p, lo, hi, first, second, rate=0.0, decay=0, stairs=0):
    if p < first + second:
        return lo + (hi - lo) * one_cycle_scale(p, first, second, stairs)
    if decay and rate:
        return lo / (1 + rate * (p - first - second + 1) / decay)
    return lo


def one_cycle_mom(p, lo, hi, first, second):
    if p < first + second:
        return hi - (hi - lo) * one_cycle_scale(p, first, second)
    return hi


def range_test_lr(p, lo=1e-3, size=2000, rate=1.0, stair=False):
    interval = (p + 1) / size
    return lo * (1 + rate * (math.floor(interval) if stair else interval))


SCHEDULES = [
    ("WarmupLR", {"warmup_num_steps": 10}, lambda p: warmup_lr(p, n=10)),
    ("WarmupLR", {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2, "warmup_num_steps": 8,
                  "warmup_type": "linear"},
     lambda p: warmup_lr(p, 1e-3, 2e-2, 8, "linear")),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_num_steps": 6, "warmup_max_lr": 2e-2},
     lambda p: warmup_decay_lr(p, 25, hi=2e-2, n=6)),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 1},  # counts as 2
     lambda p: warmup_decay_lr(p, 40, n=1)),
    ("WarmupCosineLR", {"total_num_steps": 24, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"},
     lambda p: warmup_cosine_lr(p, 24, 0.1, 5, 0.05, "linear")),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 7,
                  "cycle_second_step_size": 9, "decay_lr_rate": 0.5, "decay_step_size": 3,
                  "cycle_momentum": False},
     lambda p: one_cycle_lr(p, 1e-3, 1e-2, 7, 9, 0.5, 3)),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 8,
                  "cycle_first_stair_count": 4, "cycle_momentum": False},
     lambda p: one_cycle_lr(p, 1e-3, 1e-2, 8, 8, stairs=4)),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 4,
                     "lr_range_test_step_rate": 0.5},
     lambda p: range_test_lr(p, 1e-3, 4, 0.5)),
    ("LRRangeTest", {"lr_range_test_step_size": 5, "lr_range_test_staircase": True},
     lambda p: range_test_lr(p, size=5, stair=True)),
]
IDS = [f"{kind}-{i}" for i, (kind, _, _) in enumerate(SCHEDULES)]


def scheduled(kind, params, **extra):
    return config(accumulation=1, scheduler={"type": kind, "params": params}, **extra)


@pytest.mark.parametrize("kind,params,reference", SCHEDULES, ids=IDS)
def test_lr_sequence_is_deepspeeds_formula(kind, params, reference):
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, scheduled(kind, params))
    assert type(model.lr_scheduler).__name__ == kind
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(30):
        model.lr_scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    expected = [reference(p) for p in range(-1, 30)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert model.lr_scheduler.get_last_lr()[0] == pytest.approx(expected[-1], rel=1e-12)
    model.destroy()


def test_one_cycle_cycles_adams_beta1_with_deepspeeds_beta2():
    """DeepSpeed's OneCycle sets betas to (momentum, 0.99), replacing the configured beta2."""
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, scheduled("OneCycle", {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5,
        "cycle_second_step_size": 4, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}))
    betas = [optimizer.param_groups[0]["betas"]]
    for _ in range(12):
        model.lr_scheduler.step()
        betas.append(optimizer.param_groups[0]["betas"])
    assert betas[0] == (0.85, 0.99)  # before the first step: cycle_min_mom
    assert [b[0] for b in betas[1:]] == pytest.approx(
        [one_cycle_mom(p, 0.85, 0.95, 5, 4) for p in range(12)], rel=1e-12)
    assert all(b[1] == 0.99 for b in betas)
    model.destroy()


@pytest.mark.parametrize("kind,params,reference", SCHEDULES[::2], ids=IDS[::2])
def test_training_equals_pytorch_with_lambda_lr_of_the_same_schedule(kind, params, reference):
    """model.step() steps the configured scheduler after each optimizer step, as DeepSpeed's
    engine: losses equal PyTorch's AdamW driven by LambdaLR(ref(k - 1) / lr)."""
    data = batches(12)
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
        opt, lambda k: reference(k - 1) / LR)
    ref_losses, _, ref_lrs = torch_run(data, 2, 0.5, schedule)
    cfg = config(scheduler={"type": kind, "params": params})
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, cfg)
    losses, lrs = [], []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.item())
        model.backward(loss)
        boundary = model.is_gradient_accumulation_boundary()
        model.step()
        if boundary:
            lrs.append(model.get_lr()[0])
    assert_close(losses, ref_losses)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12, abs=1e-15)
    model.destroy()


@pytest.mark.parametrize("kind,params", [
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3}),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3,
                  "cycle_min_mom": 0.8, "cycle_max_mom": 0.9})])
def test_resume_through_checkpoints_continues_the_schedule_exactly(tmp_path, kind, params):
    data = batches(8)

    def run(model, chunk):
        out = []
        for x, y in chunk:
            loss = model(x, y)
            model.backward(loss)
            model.step()
            out.append((loss.item(), model.get_lr()[0], model.optimizer.param_groups[0]["betas"]))
        return out

    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, scheduled(kind, params))
    first = run(model, data[:4])
    model.save_checkpoint(tmp_path)
    straight = run(model, data[4:])
    model.destroy()
    torch.manual_seed(1)  # other initial weights: the checkpoint must bring everything back
    model, _ = patrickstar.initialize(MLP, scheduled(kind, params))
    model.load_checkpoint(tmp_path)
    assert model.lr_scheduler.last_batch_iteration == 3
    assert model.get_lr()[0] == first[-1][1]
    resumed = run(model, data[4:])
    assert resumed == straight  # bit for bit: losses, rates and betas
    model.destroy()


def test_patrickstar_loop_must_step_a_configured_scheduler_once_per_optimizer_step():
    """optimizer.step() called directly does not step the configured scheduler (the user does,
    as in PyTorch); forgetting it, or stepping it twice, raises at the next optimizer.step()
    instead of training at a constant (or doubled) schedule."""
    data = batches(6)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        MLP, scheduled("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}))
    lrs = []
    for x, y in data[:3]:
        model.backward(model(x, y))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        model.lr_scheduler.step()
    assert lrs == pytest.approx([warmup_lr(p, n=4, kind="linear") for p in (-1, 0, 1)])
    model.backward(model(*data[3]))
    optimizer.step()  # and no scheduler step
    model.backward(model(*data[4]))
    with pytest.raises(RuntimeError, match="was not stepped after the last optimizer.step"):
        optimizer.step()
    model.lr_scheduler.step()
    model.lr_scheduler.step()
    with pytest.raises(RuntimeError, match="stepped 2 times since the last optimizer.step"):
        optimizer.step()
    model.destroy()


@pytest.mark.parametrize("scheduler,says", [
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}},
     "unknown config key 'scheduler.params.warmup_steps' for WarmupLR"),
    ({"type": "CosineAnnealing"}, "'scheduler.type': 'CosineAnnealing' is not one of"),
    ({"params": {}}, "'scheduler.type': required"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
     "'scheduler.params.total_num_steps': required by WarmupDecayLR"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     "'scheduler.params.warmup_num_steps': must be >= 1, got 0"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}},
     "'scheduler.params.warmup_num_steps': expected an integer, got float 2.5"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
     "'scheduler.params.warmup_type': expected \"log\" or \"linear\", got str 'cosine'"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
     "'scheduler.params.warmup_max_lr': \"auto\" is filled in by Hugging Face's Trainer"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -1e-3}},
     "'scheduler.params.warmup_min_lr': must be >= 0, got -0.001"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 1.5}},
     "'scheduler.params.cos_min_ratio': must be in \\[0, 1\\], got 1.5"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                     "cycle_max_mom": 1.0}},
     "'scheduler.params.cycle_max_mom': must be in \\[0, 1\\)"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3}},
     "'scheduler.params.cycle_max_lr': required by OneCycle"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": 1}},
     "'scheduler.params.lr_range_test_staircase': expected true or false, got int 1"),
    ({"type": "WarmupLR", "bogus": 1}, "unknown config key 'scheduler.bogus'"),
])
def test_bad_scheduler_params_are_refused_naming_key_and_value(scheduler, says):
    with pytest.raises(ValueError, match=says):
        patrickstar.load_config({"scheduler": scheduler})


def test_per_group_values_must_match_the_groups_and_one_scheduler_source_only():
    bad = scheduled("WarmupLR", {"warmup_max_lr": [1e-2, 2e-2, 3e-2]})
    with pytest.raises(ValueError, match="'scheduler.params.warmup_max_lr': 3 values for 1 "
                                         "optimizer parameter group"):
        patrickstar.initialize(MLP, bad)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        MLP, scheduled("WarmupLR", {"warmup_min_lr": [1e-4, 2e-4], "warmup_max_lr": [1e-2, 2e-2],
                                    "warmup_num_steps": 3}),
        param_groups=lambda m: [{"params": m.layers[0].parameters()},
                                {"params": [*m.layers[1].parameters(),
                                            *m.layers[2].parameters()]}])
    assert [g["lr"] for g in optimizer.param_groups] == [1e-4, 2e-4]
    model.destroy()
    with pytest.raises(TypeError, match="lr_scheduler=.*'scheduler' section both"):
        patrickstar.initialize(MLP, scheduled("WarmupLR", {}), lr_scheduler=lambda opt: None)
