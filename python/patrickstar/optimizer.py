"""The optimizer users get back from `patrickstar.initialize()`.

It is a `torch.optim.Optimizer` (so `torch.optim.lr_scheduler` schedulers drive it through
`param_groups[i]["lr"]`), but its state lives in chunks and `step()` runs the fused C++ Adam /
AdamW kernel tensor by tensor over chunk memory, with each tensor's group hyperparameters and
step count (parameters that got no gradient this step are skipped, as torch does).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch

from .profiling.recorder import optimizer_phase

if TYPE_CHECKING:  # pragma: no cover
    from .engine import PatrickStarEngine

__all__ = ["PatrickStarOptimizer", "build_param_groups"]

_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "name"}


def build_param_groups(module: torch.nn.Module, groups, defaults: dict) -> list[dict]:
    """Validates user param groups (torch's format: dicts with "params" and overrides) or, when
    `groups` is None, one group of every parameter. Every parameter of `module` must be in
    exactly one group; frozen parameters may be left out."""
    all_params = list(module.parameters())
    ids = {id(p) for p in all_params}
    if groups is None:
        groups = [{"params": all_params}]
    if callable(groups):
        groups = groups(module)
    if isinstance(groups, dict) or not isinstance(groups, Iterable):
        raise ValueError("param_groups: expected a list of dicts like torch.optim's, "
                         f"got {type(groups).__name__}")
    result, seen = [], set()
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{index}]: expected a dict with a 'params' key")
        unknown = set(group) - _GROUP_KEYS
        if unknown:
            raise ValueError(f"param_groups[{index}]: unknown keys {sorted(unknown)} "
                             f"(known: {sorted(_GROUP_KEYS)})")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for param in params:
            if id(param) not in ids:
                raise ValueError(f"param_groups[{index}]: a parameter of shape "
                                 f"{tuple(param.shape)} is not a parameter of the model")
            if id(param) in seen:
                raise ValueError(f"param_groups[{index}]: a parameter of shape "
                                 f"{tuple(param.shape)} appears in more than one group")
            seen.add(id(param))
        merged = dict(defaults)
        merged.update({k: v for k, v in group.items() if k != "params"})
        if merged["lr"] < 0 or merged["weight_decay"] < 0 or merged["eps"] <= 0:
            raise ValueError(f"param_groups[{index}]: lr and weight_decay must be >= 0 and eps "
                             f"> 0, got lr={merged['lr']}, weight_decay={merged['weight_decay']}, "
                             f"eps={merged['eps']}")
        merged["params"] = params
        result.append(merged)
    missing = [p for p in all_params if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"param_groups: {len(missing)} trainable parameter(s) are in no group "
                         f"(first has shape {tuple(missing[0].shape)})")
    return result


class PatrickStarOptimizer(torch.optim.Optimizer):
    """Adam/AdamW over chunked state. Built by `patrickstar.initialize()`, not by users."""

    def __init__(self, engine: "PatrickStarEngine", groups: list[dict], decoupled: bool):
        defaults = {k: v for k, v in groups[0].items() if k != "params"}
        super().__init__(groups, defaults)
        self._engine = engine
        self.decoupled_weight_decay = decoupled
        self.skipped_steps = 0  # steps skipped for fp16 overflow

    @property
    def step_counts(self) -> list[int]:
        """Adam's step count of each parameter, by its position in `ChunkedParams`."""
        return self._engine._step_count

    @property
    def has_grad(self) -> list[bool]:
        """Whether each parameter has a gradient this step."""
        return self._engine._has_grad

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scaler.scale

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with optimizer_phase(self._engine.profiler):
            applied = self._engine.optimizer_step(self)
        if not applied:
            self.skipped_steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def state_dict(self):
        return self._engine.optimizer_state_dict(self)

    def load_state_dict(self, state_dict):
        self._engine.load_optimizer_state_dict(self, state_dict)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), capped at 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
