"""Loss scaling for fp16 training, with PatrickStar's / DeepSpeed's semantics.

Dynamic scaling: every step whose gradients hold an inf or NaN is skipped. Each overflow spends
one unit of `hysteresis`; once only one is left, an overflow divides the scale by `scale_factor`
(never below `min_scale`). After `scale_window` steps in a row without overflow the scale is
multiplied by `scale_factor` and the hysteresis budget is refilled (with
`consecutive_hysteresis`, DeepSpeed's key, every step without overflow refills it).

Note [Overflow at the minimum loss scale]
An overflow with the scale already at `min_scale` and no hysteresis left cannot be answered by
a lower scale: the gradients are inf/NaN at any scale (a NaN in the data or the loss, a
diverged model), and every later step would be skipped too, so training would go on without
changing a weight. Before, the scaler stayed at `min_scale` and the loop skipped steps silently
forever. DeepSpeed's DynamicLossScaler raises there ("Current loss scale already at minimum"),
so this one does too, naming the config keys; `raise_error_at_min_scale = False` on the scaler
(DeepSpeed's attribute, which Lightning scripts set) keeps skipping instead.

Note [When the scale grows]
The scale grows after `scale_window` clean steps since the start or the last overflow, then
every `scale_window` clean steps: the schedule of DeepSpeed's DynamicLossScaler (the scaler of
its ZeRO stages and the only one with hysteresis), whose `(cur_iter - last_overflow_iter) %
scale_window == 0` counts the same steps as `steps_since_overflow` here, and of upstream
PatrickStar and torch.amp.GradScaler (growth_interval). DeepSpeed's ZeRO-0 FP16_Optimizer has
its own older rule (`stable_interval = iter - last_overflow_iter - 1`, no hysteresis): it grows
one step later, after 1001 clean steps for a window of 1000; that is not the scaler matched
here. test_loss_scaling.py compares the scale sequence with DeepSpeed's rule step by step.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers

__all__ = ["LossScaler", "StaticLossScaler", "DynamicLossScaler", "LossScaleAtMinimum",
           "make_loss_scaler"]


class LossScaleAtMinimum(RuntimeError):
    """fp16 gradients overflowed with the dynamic loss scale already at its minimum (Note
    [Overflow at the minimum loss scale])."""


class LossScaler:
    """Interface: `scale` multiplies the loss before backward; `update(overflow)` after it."""

    scale: float = 1.0

    def update(self, overflow: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    # Note [A loss scaler's saved state]
    # optimizer.load_state_dict restores the scaler from the dict's "loss_scaler" entry. That
    # entry was read without a check: a dict of a dynamic (fp16) scaler loaded into a bf16 or
    # fp32 engine set its constant scale to 65536, a static scaler's {"scale": 1.0} would set
    # an fp16 run's dynamic scale to 1 (its gradients then underflow), a negative or zero scale
    # loaded, a string or a dict of unknown keys loaded as nothing, and a value that failed to
    # convert raised after the optimizer's state had been written (half of one state dict,
    # half of another). Now `checked_state` checks the entry before anything is written, and
    # names the key and value: a dict, of known keys, numbers where numbers go, scales finite
    # and positive. A static scaler's scale is its configuration (1 without fp16,
    # fp16.loss_scale with it), not training state, so it loads none; a dynamic scaler loads
    # only a dynamic scaler's state, and keeps its own where the dict is a static one's (a
    # switch from bf16 or a static scale to dynamic fp16 at a resume).
    def checked_state(self, state) -> dict:
        """The values `load_state_dict(state)` sets, after checking `state` (a saved
        "loss_scaler" entry): raises TypeError / ValueError naming the key and value, so a
        caller can check before it writes anything (Note [A loss scaler's saved state])."""
        where = "optimizer state dict 'loss_scaler'"
        if not isinstance(state, collections.abc.Mapping):
            raise TypeError(f"{where}: expected a dict (a loss scaler's state_dict()), got "
                            f"{type(state).__name__} {state!r}")
        unknown = sorted(str(key) for key in state if key not in _STATE_TYPES)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (a loss scaler's state has "
                             f"{sorted(_STATE_TYPES)})")
        values = {}
        for key, value in state.items():
            kind = _STATE_TYPES[key]
            if kind is bool and isinstance(value, bool):
                values[key] = value
            elif isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{where}: {key!r} must be a number, got "
                                 f"{type(value).__name__} {value!r}")
            elif kind is float:  # the scale, its factor and its minimum
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"{where}: {key!r} must be finite and > 0, got {value!r}")
                values[key] = float(value)
            else:
                least = 1 if key in ("scale_window", "hysteresis") else 0
                if not math.isfinite(value) or value != int(value) or value < least:
                    raise ValueError(f"{where}: {key!r} must be a whole number >= {least}, got "
                                     f"{value!r}")
                values[key] = int(value)
        return values

    def load_state_dict(self, state: dict) -> None:
        self.checked_state(state)  # a static scale is configuration: nothing to load

    # Upstream PatrickStar's and DeepSpeed's names for `scale`.
    @property
    def loss_scale(self) -> float:
        return self.scale

    @property
    def cur_scale(self) -> float:
        return self.scale


class StaticLossScaler(LossScaler):
    """A fixed scale (fp16.loss_scale > 0; 1.0 for fp32 and bf16). Overflowing steps are still
    skipped by the optimizer, but the scale does not change."""

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        del overflow


@dataclasses.dataclass
class DynamicLossScaler(LossScaler):
    scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True  # Note [Overflow at the minimum loss scale]
    # Progress counters.
    steps_since_overflow: int = 0
    hysteresis_left: int = dataclasses.field(default=-1)
    overflows: int = 0
    overflows_in_a_row: int = 0

    def __post_init__(self):
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            if (self.hysteresis_left <= 1 and self.scale <= self.min_scale
                    and self.raise_error_at_min_scale):
                raise LossScaleAtMinimum(
                    f"fp16 gradients overflowed (inf/NaN) with the loss scale already at "
                    f"config fp16.min_loss_scale = {self.min_scale:g} and no fp16.hysteresis "
                    f"left ({self.overflows_in_a_row + 1} overflowing steps in a row): the scale "
                    f"cannot go lower, so every step would be skipped. As DeepSpeed does, "
                    f"training stops here; this step was skipped. The gradients are not finite "
                    f"at any scale: look for a NaN/inf in the inputs or the loss, lower "
                    f"fp16.min_loss_scale, or train in bf16 (bf16.enabled). To keep skipping "
                    f"such steps instead, set optimizer.loss_scaler.raise_error_at_min_scale = "
                    f"False")
            self.overflows += 1
            self.overflows_in_a_row += 1
            self.steps_since_overflow = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            return
        self.overflows_in_a_row = 0
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.steps_since_overflow += 1
        if self.steps_since_overflow % self.scale_window == 0:  # Note [When the scale grows]
            self.scale *= self.scale_factor
            self.hysteresis_left = self.hysteresis

    # The script's choice, not training state: a checkpoint neither saves nor restores it, so
    # `raise_error_at_min_scale = False` set before load_checkpoint() stays.
    _NOT_STATE = ("raise_error_at_min_scale",)

    def state_dict(self) -> dict:
        state = dataclasses.asdict(self)
        for name in self._NOT_STATE:
            del state[name]
        return state

    def load_state_dict(self, state: dict) -> None:
        values = self.checked_state(state)
        if set(values) <= {"scale"}:
            return  # a static scaler's state (Note [A loss scaler's saved state])
        for name, value in values.items():
            setattr(self, name, value)


# The keys a saved scaler's state may hold and their types: a dynamic scaler's state_dict()'s
# (a static one saves "scale" alone). Note [A loss scaler's saved state]
_STATE_TYPES = {name: type(value) for name, value in DynamicLossScaler().state_dict().items()}


def make_loss_scaler(config) -> LossScaler:
    """The scaler for a `patrickstar.config.Config`."""
    fp16 = config.fp16
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if not fp16.dynamic:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(scale=2.0**fp16.initial_scale_power,
                             scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                             min_scale=fp16.min_loss_scale,
                             consecutive_hysteresis=fp16.consecutive_hysteresis)
