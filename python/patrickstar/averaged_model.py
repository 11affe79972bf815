"""`torch.optim.swa_utils.AveragedModel.update_parameters(model)` over an engine's parameters.

Note [Averaging an engine's weights]
An EMA or SWA of the weights kept with torch's `AveragedModel` (`AveragedModel(model,
multi_avg_fn=get_ema_multi_avg_fn(0.999))`, then `ema.update_parameters(model)` after each
step) reads `p.detach()` of every parameter of `model`. Between uses an engine's parameters
hold empty placeholders, so the recipe as users write it failed at the first update with
torch's "The size of tensor a (32) must match the size of tensor b (0)", naming nothing (the
copy made by `AveragedModel(model)` is fine: deepcopy gives real weights, module_copies.py).
`install()` (run by `initialize()`) wraps the method once, as convert_parameters.py wraps
`parameters_to_vector`: when `model` has parameters of an engine that hold their placeholders,
the update runs inside that engine's `summon_full_params(writeback=False)`, which lends each
parameter its values on first touch and drops them after (update_parameters only reads
`model`). Inside a block of the user's own `summon_full_params` every parameter is lent or
deferred already, so the call goes to torch's method unchanged: a second lending would put the
placeholders back under the outer block. Under data parallelism summon_full_params is a
collective, so every rank updates its average, as each DDP rank does. A model with parameters
of no engine goes through torch's method untouched.
"""
from __future__ import annotations

import functools

import torch
from torch.optim.swa_utils import AveragedModel

from .param_owners import engine_of
from .restore_on_use import is_deferred

__all__ = ["install"]

_TORCH_UPDATE = AveragedModel.update_parameters


def _holding_placeholders(model) -> list:
    """The engines whose parameters in `model` hold placeholders now."""
    engines = {}
    for param in model.parameters():
        engine = engine_of(param)
        if engine is None or id(engine) in engines or is_deferred(param):
            continue
        index = engine.params.index_of(param)
        if index is None or engine.parameter_in_use(index):
            continue
        with torch._C.DisableTorchFunctionSubclass():  # its data, not what it answers at rest
            held = tuple(param.data.shape)
        if held != tuple(engine.params.shapes[index]):  # not lent by a summon
            engines[id(engine)] = engine
    return list(engines.values())


@functools.wraps(_TORCH_UPDATE)
def update_parameters(self, model):
    engines = _holding_placeholders(model)
    if not engines:
        return _TORCH_UPDATE(self, model)
    if len(engines) > 1:
        raise ValueError(f"AveragedModel.update_parameters: the model's parameters belong to "
                         f"{len(engines)} PatrickStar engines; average each engine's module on "
                         f"its own")
    with engines[0].summon_full_params(writeback=False):
        return _TORCH_UPDATE(self, model)


def install() -> None:
    """Puts the wrapper on torch's class (idempotent)."""
    AveragedModel.update_parameters = update_parameters
