"""Loss scaling for fp16 training, with PatrickStar's / DeepSpeed's semantics.

Dynamic scaling: every step whose gradients hold an inf or NaN is skipped. Each overflow spends
one unit of `hysteresis`; once only one is left, an overflow divides the scale by `scale_factor`
(never below `min_scale`). After `scale_window` steps in a row without overflow the scale is
multiplied by `scale_factor` and the hysteresis budget is refilled.
"""
from __future__ import annotations

import dataclasses

__all__ = ["LossScaler", "StaticLossScaler", "DynamicLossScaler", "make_loss_scaler"]


class LossScaler:
    """Interface: `scale` multiplies the loss before backward; `update(overflow)` after it."""

    scale: float = 1.0

    def update(self, overflow: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])

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
    # Progress counters.
    steps_since_overflow: int = 0
    hysteresis_left: int = dataclasses.field(default=-1)
    overflows: int = 0

    def __post_init__(self):
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self.steps_since_overflow = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            return
        self.steps_since_overflow += 1
        if self.steps_since_overflow % self.scale_window == 0:
            self.scale *= self.scale_factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for field in dataclasses.fields(self):
            if field.name in state:
                setattr(self, field.name, type(getattr(self, field.name))(state[field.name]))


def make_loss_scaler(config) -> LossScaler:
    """The scaler for a `patrickstar.config.Config`."""
    fp16 = config.fp16
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if not fp16.dynamic:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(scale=2.0**fp16.initial_scale_power,
                             scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                             min_scale=fp16.min_loss_scale)
