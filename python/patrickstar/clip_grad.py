"""`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` on an engine's parameters.

Note [torch's clip_grad_norm_]
nanoGPT, Hugging Face loops and most PyTorch recipes clip with torch's function. An engine's
gradients live in chunks (`p.grad` is None; under data parallelism a rank holds only its
shard), so torch's function would find no gradient, return 0 and clip nothing: a silent
difference in training. `install()` (run by `initialize()`) wraps torch's function once: when
the parameters given belong to an engine, the call becomes `model.clip_grad_norm_(max_norm)`
(the norm over every rank's gradients, as torch reports it under DDP, and the clip applied by
the coming `optimizer.step()`), provided they are all of that engine's trainable parameters
(its norm is over all of them); a subset, or a mix with other modules' gradients, raises
instead of clipping a different set than asked. Parameters of no engine go to torch's function
untouched (param_owners.py says which engine a parameter belongs to). Likewise
`torch.nn.utils.clip_grad_value_`, which did nothing either: an engine's gradients are clamped
in their chunks, other parameters' by torch; and `torch.nn.utils.clip_grads_with_norm_` (the
second half of torch's clip, after `get_total_norm`), which clips the engine's coming step by
the norm given.
"""
from __future__ import annotations

import functools
import math

import torch

from .param_owners import engine_of

__all__ = ["install"]

_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


def _engine_of_all(params: list, call: str):
    """The engine whose trainable parameters are all of `params`, or None when none of them
    is an engine's; raises for a subset, several engines or gradients outside the engine."""
    engines = {id(e): e for e in (engine_of(p) for p in params) if e is not None}
    if not engines:
        return None
    if len(engines) > 1:
        raise ValueError(f"torch.nn.utils.{call}: the parameters belong to {len(engines)} "
                         f"PatrickStar engines; clip each model on its own "
                         f"(model.clip_grad_norm_(max_norm))")
    engine = next(iter(engines.values()))
    # A parameter without elements stays outside the chunks (init_context.plan_parameters), so
    # `model.parameters()` of such a model holds one; its empty gradient adds nothing to any
    # norm and clipping it changes nothing.
    foreign = [p for p in params if engine_of(p) is None and p.grad is not None
               and p.grad.numel() > 0]
    if foreign:
        raise ValueError(
            f"torch.nn.utils.{call}: {len(foreign)} of the parameters given have "
            f"gradients outside the PatrickStar engine (shapes "
            f"{[tuple(p.shape) for p in foreign[:3]]}); their norm cannot be combined with the "
            f"engine's chunked gradients. Clip the engine with model.clip_grad_norm_(max_norm) "
            f"and the others separately")
    given = {id(p) for p in params}
    missing = [name for name, p in zip(engine.params.names, engine.params.params)
               if p.requires_grad and id(p) not in given]
    if missing:
        raise ValueError(
            f"torch.nn.utils.{call}: {len(missing)} trainable parameters of the "
            f"PatrickStar engine are not among those given (e.g. {missing[:3]}); the engine "
            f"clips by the norm of all its gradients: pass model.parameters() or call "
            f"model.clip_grad_norm_(max_norm)")
    return engine


@functools.wraps(_TORCH_CLIP)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_of_all(params, "clip_grad_norm_")
    if engine is None:
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = engine.clip_grad_norm_(float(max_norm), float(norm_type))
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    return norm


_TORCH_CLIP_WITH_NORM = torch.nn.utils.clip_grads_with_norm_


@functools.wraps(_TORCH_CLIP_WITH_NORM)
def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """The second half of torch's clip_grad_norm_ (torchtitan's recipe: `get_total_norm` of
    the p.grad, then this): an engine clips its coming step by `total_norm`
    (PatrickStarOptimizer.clip_grads_with_norm_); other parameters go to torch's function."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_of_all(params, "clip_grads_with_norm_")
    if engine is None:
        return _TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)
    return engine.clip_grads_with_norm_(float(max_norm), float(total_norm))


_TORCH_CLIP_VALUE = torch.nn.utils.clip_grad_value_


@functools.wraps(_TORCH_CLIP_VALUE)
def clip_grad_value_(parameters, clip_value, foreach=None):
    """Each engine's parameters are clamped in their chunks (PatrickStarEngine
    .clip_grad_value_), the others by torch's function: value clipping is per element, so a
    subset or a mix is meaningful, unlike the norm's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    by_engine: dict[int, tuple[object, list]] = {}
    others = []
    for param in params:
        engine = engine_of(param)
        if engine is None:
            others.append(param)
        else:
            by_engine.setdefault(id(engine), (engine, []))[1].append(param)
    for engine, owned in by_engine.values():
        engine.clip_grad_value_(clip_value, owned)
    if others or not by_engine:
        _TORCH_CLIP_VALUE(others, clip_value, foreach)


def install() -> None:
    """Puts the wrappers where torch's callers look them up (idempotent)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    torch.nn.utils.clip_grad.clip_grad_value_ = clip_grad_value_
