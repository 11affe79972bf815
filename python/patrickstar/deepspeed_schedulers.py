"""DeepSpeed's config-built learning-rate schedulers: a `"scheduler": {"type": ..., "params":
{...}}` section of a ported ds_config becomes `model.lr_scheduler`, with DeepSpeed's types
(WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), parameter names, defaults and
curves (deepspeed/runtime/lr_schedules.py, reimplemented here, not imported: DeepSpeed is not a
dependency).

Note [Config schedulers follow DeepSpeed's stepping]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Like DeepSpeed's, each scheduler is a plain object (not a torch LRScheduler) whose position is
`last_batch_iteration`, -1 before the first step. Building it writes the learning rate of
position -1 into the optimizer's groups (WarmupLR: warmup_min_lr; WarmupCosineLR: 0; OneCycle:
cycle_min_lr and cycle_min_mom; LRRangeTest: lr_range_test_min_lr), so the first optimizer step
runs at it, and each `step()` after an optimizer step moves to the next position and writes
that one's rate.
`model.step()` steps it after each applied optimizer step (Note [model.step() steps
model.lr_scheduler] in deepspeed_loop.py), which is where DeepSpeed's engine steps it. Its state
is `{"last_batch_iteration": n}` as DeepSpeed's; the rates in the groups come back with the
optimizer's own state on resume, so a resumed run continues the same sequence.

DeepSpeed quirks kept on purpose, so a ported schedule is the same schedule:
- WarmupLR's `warmup_max_lr` defaults to the optimizer's lr, WarmupDecayLR's to 0.001.
- `warmup_num_steps` below 2 counts as 2 (the log warm-up divides by log(warmup_num_steps)).
- OneCycle with `cycle_momentum` (its default) sets each group's betas to (momentum, 0.99),
  replacing the configured beta2, as DeepSpeed does for Adam.
Where DeepSpeed only logs (an unknown `warmup_type` falls back to "log") we refuse: a misspelt
type would silently change the curve.
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Mapping

__all__ = ["SCHEDULER_TYPES", "parse_scheduler_params", "build_scheduler"]

_REQUIRED = object()  # a parameter without a default

# Per-group parameters take a number or one per param group.
_PER_GROUP = {"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
              "cycle_max_mom", "lr_range_test_min_lr"}
_POSITIVE_INTS = {"warmup_num_steps", "total_num_steps", "cycle_first_step_size",
                  "lr_range_test_step_size"}
_NONNEGATIVE_INTS = {"cycle_second_step_size", "cycle_first_stair_count",
                     "cycle_second_stair_count", "decay_step_size"}
_BOOLS = {"cycle_momentum", "lr_range_test_staircase"}
_RATIOS = {"warmup_min_ratio", "cos_min_ratio"}  # in [0, 1]
_MOMENTA = {"cycle_min_mom", "cycle_max_mom"}  # Adam's beta1: in [0, 1)


def _fail(key: str, value: Any, expected: str) -> None:
    if value == "auto":
        raise ValueError(
            f"config key '{key}': \"auto\" is filled in by Hugging Face's Trainer before it "
            f"reaches DeepSpeed; PatrickStar-C++ gets the config as written, so give the number")
    raise ValueError(f"config key '{key}': expected {expected}, got {type(value).__name__} "
                     f"{value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _checked(key: str, name: str, value: Any) -> Any:
    """One parameter's value, validated (per-group lists element by element)."""
    if name in _PER_GROUP and isinstance(value, (list, tuple)):
        if not value:
            _fail(key, value, "a number or one number per parameter group")
        return tuple(_checked(f"{key}[{i}]", name, item) for i, item in enumerate(value))
    if name == "warmup_max_lr" and value is None:
        return None  # WarmupLR: the optimizer's lr
    if name in _BOOLS:
        if not isinstance(value, bool):
            _fail(key, value, "true or false")
        return value
    if name == "warmup_type":
        if value not in ("log", "linear"):
            _fail(key, value, "\"log\" or \"linear\"")
        return value
    if name in _POSITIVE_INTS | _NONNEGATIVE_INTS | {"last_batch_iteration"}:
        if name in ("cycle_second_step_size", "cycle_second_stair_count") and value is None:
            return None  # the first half's value
        if not _is_number(value) or float(value) != int(value):
            _fail(key, value, "an integer")
        value = int(value)
        low = 1 if name in _POSITIVE_INTS else -1 if name == "last_batch_iteration" else 0
        if value < low:
            raise ValueError(f"config key '{key}': must be >= {low}, got {value}")
        return value
    if not _is_number(value):
        _fail(key, value, "a number")
    value = float(value)
    if name in _RATIOS and not 0.0 <= value <= 1.0:
        raise ValueError(f"config key '{key}': must be in [0, 1], got {value}")
    if name in _MOMENTA and not 0.0 <= value < 1.0:
        raise ValueError(f"config key '{key}': must be in [0, 1) (Adam's beta1), got {value}")
    if value < 0:  # rates and learning rates; a negative one would reach Adam as a sign flip
        raise ValueError(f"config key '{key}': must be >= 0, got {value}")
    return value


def parse_scheduler_params(kind: Any, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """DeepSpeed's `scheduler.type` and `scheduler.params`, validated, with its defaults filled
    in; raises ValueError naming the key."""
    if kind not in SCHEDULER_TYPES:
        raise ValueError(
            f"config key 'scheduler.type': {kind!r} is not one of DeepSpeed's schedulers "
            f"PatrickStar-C++ builds ({', '.join(SCHEDULER_TYPES)}); for another scheduler "
            f"(a torch.optim.lr_scheduler one) remove the section and pass "
            f"initialize(..., lr_scheduler=lambda optimizer: ...)")
    known = SCHEDULER_TYPES[kind]
    for name in params:
        if name not in known:
            raise ValueError(f"unknown config key 'scheduler.params.{name}' for {kind} (known "
                             f"keys here: {', '.join(sorted(known))})")
    result = {}
    for name, default in known.items():
        if name not in params:
            if default is _REQUIRED:
                raise ValueError(f"config key 'scheduler.params.{name}': required by {kind}")
            result[name] = default
        else:
            result[name] = _checked(f"scheduler.params.{name}", name, params[name])
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and \
            result["total_num_steps"] < max(2, result["warmup_num_steps"]):
        # DeepSpeed warns too: the schedule is at its end value right after the warm-up.
        warnings.warn(f"patrickstar: scheduler {kind}: total_num_steps "
                      f"{result['total_num_steps']} is less than warmup_num_steps "
                      f"{result['warmup_num_steps']}", UserWarning, stacklevel=3)
    return kind, result


def _per_group(optimizer, name: str, value) -> list:
    groups = len(optimizer.param_groups)
    if isinstance(value, tuple):
        if len(value) != groups:
            raise ValueError(f"config key 'scheduler.params.{name}': {len(value)} values for "
                             f"{groups} optimizer parameter group(s)")
        return list(value)
    return [value] * groups


def _write_lrs(optimizer, lrs) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return list(lrs)


class _Schedule:
    """What DeepSpeed's schedulers share: the position, step(), the state dict."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def _start(self) -> None:
        if self.last_batch_iteration == -1:  # a resumed position keeps the groups' rates
            self._apply()

    def _apply(self) -> None:
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): not stepped yet")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


def _warmup_fraction(position: int, steps: int, kind: str) -> float:
    """How far the warm-up is at `position` (< steps): log(position+1)/log(steps) or linear."""
    if kind == "log":
        return math.log(position + 1) / math.log(steps)
    return position / steps


class WarmupLR(_Schedule):
    """min -> max over warmup_num_steps (log or linear), then max."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = tuple(group["lr"] for group in optimizer.param_groups)
        self.min_lrs = _per_group(optimizer, "warmup_min_lr", warmup_min_lr)
        self.max_lrs = _per_group(optimizer, "warmup_max_lr", warmup_max_lr)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self._start()

    def _after_warmup(self) -> float:
        return 1.0

    def get_lr(self) -> list[float]:
        position = self.last_batch_iteration
        if position < 0:
            return list(self.min_lrs)
        if position < self.warmup_num_steps:
            gamma = _warmup_fraction(position, self.warmup_num_steps, self.warmup_type)
        else:
            gamma = self._after_warmup()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from max to min reaching it at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _after_warmup(self) -> float:
        left = self.total_num_steps - self.last_batch_iteration
        return max(0.0, left / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's lr: warmup_min_ratio -> 1 over the warm-up, then a half cosine
    down to cos_min_ratio at total_num_steps (held there after)."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        position = self.last_batch_iteration
        if position < 0:
            return 0.0
        if position < self.warmup_num_steps:
            fraction = _warmup_fraction(position, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        done = position - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """One triangle from cycle_min_lr up to cycle_max_lr (first half) and back (second half),
    optionally in stairs, then a 1/(1 + rate * t) decay; momentum (Adam's beta1) moves the
    other way between cycle_max_mom and cycle_min_mom."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, "cycle_min_lr", cycle_min_lr)
        self.max_lrs = _per_group(optimizer, "cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        # No decay without a decay interval, or at a zero rate: the cycle's end values stay.
        self.lr_decays = decay_step_size != 0 and decay_lr_rate != 0
        self.mom_decays = decay_step_size != 0 and decay_mom_rate != 0
        self.cycle_momentum = cycle_momentum
        self.min_moms = _per_group(optimizer, "cycle_min_mom", cycle_min_mom)
        self.max_moms = _per_group(optimizer, "cycle_max_mom", cycle_max_mom)
        # DeepSpeed starts at cycle_min_lr and cycle_min_mom, not at the triangle's position
        # -1 (which would be cycle_max_mom): the first step runs at the lowest momentum.
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(optimizer, self.min_lrs)
            if cycle_momentum:
                self._write_moms(self.min_moms)

    def _write_moms(self, moms) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, 0.99)  # DeepSpeed's beta2 under OneCycle

    def _scale(self) -> float:
        """Where in the triangle the next batch is: 0 at cycle_min, 1 at the peak."""
        batch = self.last_batch_iteration + 1
        x = batch / self.total_size - math.floor(batch / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs from the integer offset into the cycle, not from `scale`: at a half's
            # boundary the float scale can fall a hair below a stair and floor a whole one off.
            into = batch % self.total_size
            if into <= self.first_step_size:
                position = into * stairs / self.first_step_size
            else:
                position = (self.total_size - into) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if not self.lr_decays:
            return list(self.min_lrs)
        return [low / (1 + self.decay_lr_rate * self._decay_interval()) for low in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if not self.mom_decays:
            return list(self.max_moms)
        return [high * (1 + self.decay_mom_rate * self._decay_interval())
                for high in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_moms(self.get_mom())


class LRRangeTest(_Schedule):
    """min_lr * (1 + step_rate * (position + 1) / step_size), the interval floored with
    staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, "lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()  # position -1: min_lr itself

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lr]


_CLASSES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
            "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}

# type -> {param: default}, from the constructors (DeepSpeed's parameter names and defaults;
# `last_batch_iteration` is every type's); _REQUIRED marks a parameter without a default.
SCHEDULER_TYPES: dict[str, dict[str, Any]] = {
    kind: {name: _REQUIRED if parameter.default is inspect.Parameter.empty else parameter.default
           for name, parameter in inspect.signature(cls).parameters.items()
           if name != "optimizer"}
    for kind, cls in _CLASSES.items()}


def build_scheduler(kind: str, params: Mapping[str, Any], optimizer):
    """The scheduler of a parsed config section, on `optimizer` (it sets the groups' rates)."""
    return _CLASSES[kind](optimizer, **params)
