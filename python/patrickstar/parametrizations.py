"""Parametrizations (`weight_norm`, `spectral_norm`, `orthogonal`, `register_parametrization`)
of an engine's parameters after initialize().

Note [Parametrizations after initialize]
A parametrization replaces `module.weight` by new parameters (`parametrizations.weight.original`,
or `weight_g`/`weight_v` with the old `torch.nn.utils.weight_norm`) computed from the weight's
current value. Inside model_func that works as in PyTorch: the new parameters are what the
engine places into chunks. After initialize() the weight is an engine parameter holding an
empty placeholder between uses, and the new parameters would be plain ones no chunk, hook or
optimizer knows: torch failed with messages about the placeholder ("cannot reshape tensor of 0
elements", "Expected a matrix ... Got a tensor of 1 dimensions", "triu: input tensor must have
at least 2 dimensions") or, for spectral_norm, with a lost-write error at the next forward.
`install()` (run by `initialize()`) wraps the function every new-style parametrization goes
through (`parametrize.register_parametrization`, looked up on its module at each call), the
new-style functions that read the weight before it (`parametrizations.orthogonal` checks its
dimensions first) and the old-style `WeightNorm.apply` / `SpectralNorm.apply`, so each refuses
an engine's parameter first, naming it and model_func. Anything else reaches torch unchanged.
"""
from __future__ import annotations

import functools
import sys

import torch

from .param_owners import qualified_name

__all__ = ["install"]

_parametrize = torch.nn.utils.parametrize
_parametrizations = torch.nn.utils.parametrizations
_old_weight_norm = sys.modules["torch.nn.utils.weight_norm"]
_old_spectral_norm = sys.modules["torch.nn.utils.spectral_norm"]


def _refuse_engine_parameter(what: str, module: torch.nn.Module, name: str) -> None:
    param = module._parameters.get(name) if isinstance(module, torch.nn.Module) else None
    qualified = None if param is None else qualified_name(param)
    if qualified is None:
        return
    raise ValueError(
        f"{what} of 'module.{qualified}' after patrickstar.initialize(): the parameter's values "
        f"live in the engine's chunks (it holds an empty placeholder between uses), and the "
        f"parameters a parametrization puts in its place would be unknown to the engine's "
        f"chunks and optimizer. Apply it inside model_func (e.g. "
        f"`torch.nn.utils.parametrizations.weight_norm(layer)` before returning the model), "
        f"where it trains as in PyTorch")


def _wrap(function, what: str):
    if getattr(function, "_patrickstar_wrapped", False):
        return function

    @functools.wraps(function)
    def wrapper(module, *args, **kwargs):
        # The tensor's name: second positional argument, `tensor_name=` (register_...) or
        # `name=` (the old apply()s).
        name = args[0] if args else kwargs.get("tensor_name", kwargs.get("name", "weight"))
        if isinstance(name, str):
            _refuse_engine_parameter(what, module, name)
        return function(module, *args, **kwargs)
    wrapper._patrickstar_wrapped = True
    return wrapper


def install() -> None:
    """Puts the wrappers where torch's parametrizations look them up (idempotent)."""
    _parametrize.register_parametrization = _wrap(_parametrize.register_parametrization,
                                                  "register_parametrization")
    for name in ("weight_norm", "spectral_norm", "orthogonal"):
        setattr(_parametrizations, name, _wrap(getattr(_parametrizations, name),
                                               f"torch.nn.utils.parametrizations.{name}"))
    _old_weight_norm.WeightNorm.apply = staticmethod(
        _wrap(_old_weight_norm.WeightNorm.apply, "torch.nn.utils.weight_norm"))
    _old_spectral_norm.SpectralNorm.apply = staticmethod(
        _wrap(_old_spectral_norm.SpectralNorm.apply, "torch.nn.utils.spectral_norm"))
