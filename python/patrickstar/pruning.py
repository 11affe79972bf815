"""torch.nn.utils.prune on an engine's parameters after initialize().

Note [Pruning an engine's parameters]
Pruning itself works on the engine's parameters as in PyTorch: `prune.l1_unstructured(layer,
"weight", amount=...)` registers the engine's parameter as `weight_orig` beside a mask buffer,
and its forward pre-hook computes `weight = weight_orig * mask` where the parameter holds its
values. Two calls did not:
- `prune.remove(layer, "weight")` makes the pruning permanent with `weight_orig.data = masked`
  outside any forward. Between uses an engine's parameter holds an empty placeholder (its
  values live in chunks), so the write was not applied and the next forward raised about a lost
  write: the pruned weights were gone. The removal now runs inside the engine's
  `summon_full_params(writeback=True)`, which lends the parameter's values and writes back what
  the removal assigned, as PyTorch keeps it.
- `prune.global_unstructured(...)` flattens the parameters with `parameters_to_vector` with
  autograd on, which is refused for an engine's parameters (Note in convert_parameters.py: a
  vector autograd could differentiate cannot be made from chunked values). The mask needs no
  gradient, so for an engine's parameters the call runs under torch.no_grad(), which gives
  PyTorch's masks.
Pruning reads the parameter with autograd on (`torch.ones_like(orig)`, `orig * mask`), which
warned that a value read at rest carries no gradient (Note [Parameters at rest]), meant for
penalties: the mask needs none, and the forward pre-hook recomputes the weight inside each
forward, so `BasePruningMethod.apply` runs under torch.no_grad() for an engine's parameter too.
`install()` (run by `initialize()`) wraps the three where torch looks them up; other modules
reach torch unchanged.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch.nn.utils import prune

from .param_owners import engine_of

__all__ = ["install"]


def _wrapped_once(wrap):
    """`wrap(fn)`, marked, unless `fn` is already such a wrapper: install() may run again."""
    @functools.wraps(wrap)
    def once(fn):
        if getattr(fn, "_patrickstar_wrapped", False):
            return fn
        wrapper = wrap(fn)
        wrapper._patrickstar_wrapped = True
        return wrapper
    return once


@_wrapped_once
def _wrap_remove(remove):
    @functools.wraps(remove)
    def wrapper(self, module):
        name = getattr(self, "_tensor_name", None)
        orig = module._parameters.get(f"{name}_orig") if isinstance(name, str) else None
        engine = None if orig is None else engine_of(orig)
        if engine is None:
            return remove(self, module)
        with engine.summon_full_params(writeback=True):
            return remove(self, module)
    return wrapper


@_wrapped_once
def _wrap_apply(apply):
    @functools.wraps(apply)
    def wrapper(cls, module, name, *args, **kwargs):
        params = module._parameters if isinstance(module, torch.nn.Module) else {}
        param = params.get(name, params.get(f"{name}_orig"))  # pruned again: a container
        if param is None or engine_of(param) is None:
            return apply(cls, module, name, *args, **kwargs)
        with torch.no_grad():
            return apply(cls, module, name, *args, **kwargs)
    return wrapper


@_wrapped_once
def _wrap_global(global_unstructured):
    @functools.wraps(global_unstructured)
    def wrapper(parameters, *args, **kwargs):
        if not isinstance(parameters, Iterable):  # torch's error
            return global_unstructured(parameters, *args, **kwargs)
        parameters = list(parameters)  # torch's iterates it twice
        if any(engine_of(module._parameters.get(f"{name}_orig", module._parameters.get(name)))
               is not None for module, name in parameters):
            with torch.no_grad():
                return global_unstructured(parameters, *args, **kwargs)
        return global_unstructured(parameters, *args, **kwargs)
    return wrapper


def install() -> None:
    """Puts the wrappers where torch looks them up (idempotent)."""
    prune.BasePruningMethod.remove = _wrap_remove(prune.BasePruningMethod.remove)
    prune.BasePruningMethod.apply = classmethod(_wrap_apply(
        vars(prune.BasePruningMethod)["apply"].__func__))
    prune.global_unstructured = _wrap_global(prune.global_unstructured)
