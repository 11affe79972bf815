"""DeepSpeed's `fp16.auto_cast`: the forward's floating-point inputs cast to fp16.

Note [fp16 auto_cast]
With fp16 enabled the parameters are fp16, so an fp32 input fails in the first matmul ("mat1
and mat2 must have the same dtype"). DeepSpeed's `"fp16": {"auto_cast": true}` casts the
forward's inputs (tensors in nested lists, tuples and dicts, positional and keyword) to fp16
first. DeepSpeed casts every tensor with a `.half()`, token ids included, which an embedding
then refuses; here only floating-point tensors are cast, so integer ids and masks stay as they
are.
"""
from __future__ import annotations

import torch

__all__ = ["cast_floating_inputs"]


def cast_floating_inputs(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it (nested lists, tuples, dicts) cast to
    `dtype`; everything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)((key, cast_floating_inputs(item, dtype)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        items = [cast_floating_inputs(item, dtype) for item in value]
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    return value
