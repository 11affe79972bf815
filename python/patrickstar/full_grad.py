"""DeepSpeed's `deepspeed.utils.safe_get_full_grad(param)` for an engine's parameters.

An engine's gradients live in chunks, so `p.grad` stays None (as under ZeRO-3); code that logs
per-parameter gradient norms reads them through this (or `model.full_gradient(name)`)."""
from __future__ import annotations

import torch

from .param_owners import engine_of

__all__ = ["safe_get_full_grad"]


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient of `param` as `p.grad` would hold it in PyTorch, or None (Note in
    PatrickStarEngine.full_gradient: a collective under data parallelism)."""
    engine = engine_of(param)
    if engine is None and isinstance(param, torch.Tensor) and param.numel() == 0:
        # A parameter without elements stays outside the chunks: its p.grad is torch's (Note
        # [Gradients of parameters without elements] in engine.py).
        return param.grad
    if engine is None:
        raise ValueError(f"safe_get_full_grad: the tensor given (shape {tuple(param.shape)}) is "
                         f"not a parameter of a live PatrickStar engine; read its .grad")
    return engine.full_gradient(param)
