"""The values of the engine's parameters read out of their chunks and written into them: what
`state_dict()`, `load_state_dict()` and every caller reading or loading whole weights (the
module's own state dict hooks, `model.apply`, deepcopy, parameters_to_vector) go through.

The engine owns the parameters and their chunks; a ParameterValues is handed the objects it
reads and writes through (the guard, the chunked parameters, the data-parallel side, the
parameter slots) and owns only the rules of a load: torch's errors before anything
is written, and which chunk kinds new weights replace (Note [Loading the weights the model
has]).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from . import _C

__all__ = ["ParameterValues"]

K = _C.ChunkKind


# Note [A state dict's values, checked as torch checks them]
# torch's `_load_from_state_dict` names a value that is not a tensor ("While copying the
# parameter named ..., expected torch.Tensor or Tensor-like object from checkpoint but received
# <class 'NoneType'>"), and loads a one-element 1-dim tensor into a 0-dim parameter (its
# "backward compatibility" with checkpoints of torch 0.3). The engine's own loads (its
# load_state_dict and the hooks of the module's) check values here, in torch's words: a None
# was taken for a missing key and then failed with "'NoneType' object has no attribute
# 'dtype'", a list was "a param with shape None", and a 0-dim scale saved as shape (1,) loaded
# in PyTorch but was a size mismatch here.
def checked_value(key: str, source, shape: tuple) -> tuple[torch.Tensor | None, str | None]:
    """(the value to load for parameter `key` of `shape`, None) or (None, torch's error)."""
    if not torch.overrides.is_tensor_like(source):
        return None, (f'While copying the parameter named "{key}", expected torch.Tensor or '
                      f'Tensor-like object from checkpoint but received {type(source)}')
    if len(shape) == 0 and tuple(source.shape) == (1,):
        source = source[0]
    if tuple(source.shape) != tuple(shape):
        return None, (f"size mismatch for {key}: copying a param with shape {source.shape} "
                      f"from checkpoint, the shape in current model is {torch.Size(shape)}.")
    return source, None


class ParameterValues:
    def __init__(self, guard, params, dp, slots, compute_dtype: torch.dtype):
        self._guard = guard
        self._params = params
        self._dp = dp
        self._slots = slots
        self._compute_dtype = compute_dtype

    def read(self, index: int, what: str = "state_dict()",
             agree_as: int | None = None) -> torch.Tensor:
        """Parameter `index` in the compute dtype (a collective under data parallelism); `what`
        is the call an error names; `agree_as`: DataParallel.gather_all's."""
        self._guard.check_alive(what)
        self._slots.check_unchanged([index])  # Note [Writes to a released parameter]
        self._gather_for_state_dict(agree_as)
        return self._params.read(index, K.COMPUTE_PARAM)

    def _gather_for_state_dict(self, agree_as: int | None = None) -> None:
        try:
            self._dp.gather_all(agree_as)  # a collective: every rank calls state_dict()
        except _C.ChunkRuntimeError as error:
            error.add_note("state_dict() under data parallelism gathers every rank's shards: "
                           "the other ranks serve a read on one rank at their next call (a "
                           "forward, a state-dict read, a torch.distributed collective, their "
                           "engine's end), and a rank whose engine has ended serves for "
                           "END_WAIT_S seconds only: after a late save on one rank call "
                           "torch.distributed.barrier() on every rank, or call "
                           "model.save_checkpoint(dir) on every rank, which writes each rank's "
                           "shards")
            raise

    def load_state_dict(self, module: nn.Module, state_dict, strict: bool):
        """`module.load_state_dict(state_dict, strict)` for the engine's module: plain tensors
        (any float dtype) for every parameter and buffer; torch's errors, in its words, all of
        them before anything is written; torch's `_IncompatibleKeys`."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        own = module.state_dict(keep_vars=True)
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        errors = []
        if strict and missing:
            errors.append("Missing key(s) in state_dict: {}. ".format(
                ", ".join(f'"{name}"' for name in missing)))
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{name}"' for name in unexpected)))
        values = {}
        for name, value in own.items():
            if name in state_dict:
                index = self._params.index_of(value)
                shape = self._params.shapes[index] if index is not None else value.shape
                values[name], error = checked_value(name, state_dict[name], tuple(shape))
                if error is not None:
                    errors.append(error)
        if errors:
            error = RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                type(module).__name__, "\n\t".join(errors)))
            if strict and (missing or unexpected):
                error.add_note("load_state_dict(state_dict, strict=False) loads the keys the "
                               "model has, as upstream PatrickStar's default did")
            raise error
        try:
            with torch.no_grad():
                for name, source in values.items():
                    index = self._params.index_of(own[name])
                    if index is None:
                        own[name].copy_(source)
                    else:
                        self.load(index, source)
        finally:
            self._dp.parameters_changed()  # gathered copies of what the owners loaded are stale
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def load(self, index: int, source: torch.Tensor) -> None:
        """New weights for parameter `index` (its shape, any float dtype)."""
        self._guard.check_alive("load_state_dict()")
        with torch.no_grad():
            # Note [Loading the weights the model has]
            kinds = (K.COMPUTE_PARAM,) if self._holds_already(index, source) else (
                K.COMPUTE_PARAM, K.MASTER_PARAM, K.PARAM_COMPENSATION)
            for kind in kinds:
                if not self._dp.keeps(self._params, index, kind):
                    continue  # none of that kind, or data parallel: the owner loads it
                # New weights carry no rounding error of earlier updates.
                self._params.write(index, kind, torch.zeros_like(source)
                                   if kind == K.PARAM_COMPENSATION else source)

    # Note [Loading the weights the model has]
    # In fp16/bf16 the optimizer keeps a finer copy of each weight than the 16-bit value
    # `state_dict()` gives: the fp32 master, or the Kahan compensation without one. Loading
    # 16-bit weights writes the master from them and zeroes the compensation, as new weights
    # carry no rounding error of earlier updates. But 16-bit weights that are exactly the
    # ones the model holds (the master rounds to them; without a master, the parameter is
    # them) are not new: `model.load_state_dict(model.state_dict())` is a no-op in torch, and
    # the resume idiom may load the optimizer's state dict, which restores the master and
    # compensation (Note [Master weights in the optimizer's state dict] in optimizer.py),
    # before the model's. So such weights leave both as they are; other values, or weights
    # of another dtype (an fp32 state dict into a bf16 engine), replace them. Without a master
    # the optimizer's load writes the bf16 weights its compensations belong to as well (Note
    # [The weights a compensation belongs to] in optimizer.py), so that order keeps them too.
    def _holds_already(self, index: int, source: torch.Tensor) -> bool:
        if source.dtype != self._compute_dtype or self._compute_dtype == torch.float32:
            return False
        for kind in (K.MASTER_PARAM, K.COMPUTE_PARAM):  # the finer copy where there is one
            if self._params.tensor_id(index, kind) is not None:
                if not self._dp.keeps(self._params, index, kind):
                    return False  # data parallel: the owner decides for what it loads
                held = self._params.read(index, kind).to(self._compute_dtype)
                return torch.equal(held, source.reshape(held.shape))
        return False
