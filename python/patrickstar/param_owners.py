"""Which engine a parameter belongs to, for code that receives plain parameters from torch's
side (torch's clip_grad_norm_, torch optimizers: Note [torch's clip_grad_norm_] in clip_grad.py,
Note [torch optimizers over an engine's parameters] in torch_optimizers.py). The engine
registers its parameters weakly, so the registry never keeps a model alive."""
from __future__ import annotations

import weakref
from typing import Iterable

import torch

__all__ = ["register_engine", "engine_of", "engine_gone", "qualified_name"]

# id(param) -> (weak param, weak engine). Not a WeakKeyDictionary: tensors compare by value.
_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_engine(engine, params: Iterable[torch.nn.Parameter]) -> None:
    owner = weakref.ref(engine)
    for param in params:
        key = id(param)

        def forget(ref, key=key):
            if key in _OWNER and _OWNER[key][0] is ref:
                del _OWNER[key]
        _OWNER[key] = (weakref.ref(param, forget), owner)


def engine_of(param):
    """The live engine `param` belongs to, or None."""
    entry = _OWNER.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def qualified_name(param) -> str | None:
    """`param`'s name in its live engine's model (as `model.module.named_parameters()` gives
    it), or None when it belongs to no live engine: for errors that name the parameter."""
    engine = engine_of(param)
    index = None if engine is None else engine.params.index_of(param)
    return None if index is None else engine.params.names[index]


def engine_gone(param) -> bool:
    """Whether `param` belonged to an engine that has been collected (its values were freed
    with the engine's chunks)."""
    entry = _OWNER.get(id(param))
    return entry is not None and entry[0]() is param and entry[1]() is None
