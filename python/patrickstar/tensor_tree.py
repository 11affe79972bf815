"""The tensors inside a nested value (the arguments and outputs of a module's forward): one walk
that the engine's module hooks (hooks.py) and the forward's inputs (input_cast.py) share."""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["map_tensors"]


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor in it: nested lists, tuples (namedtuples too),
    dicts and Hugging Face ModelOutputs (changed in place); everything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # transformers ModelOutput
        for key in list(value.keys()):
            value[key] = map_tensors(value[key], fn)
        return value
    return value
