"""The forward's inputs: moved to the engine's device, and with DeepSpeed's `fp16.auto_cast`
the floating-point ones cast to fp16.

Note [Inputs to the engine's device]
The engine's parameters live on its device (the GPU of its local rank), so a batch the script
left on the CPU fails in the first op ("Expected all tensors to be on the same device"). FSDP
moves the root forward's tensor inputs to its device first, DeepSpeed's engine does not; a
script written for either works when the engine moves them, so it does (tensors in nested lists,
tuples and dicts, positional and keyword; a tensor already there is passed as it is). On a
CPU build (and on the strict emulated device, where torch computes on the host) the device is
the CPU and nothing moves.

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

from .tensor_tree import map_tensors

__all__ = ["cast_floating_inputs", "inputs_to_device"]


def cast_floating_inputs(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it cast to `dtype`; everything else as it
    is (Note [fp16 auto_cast])."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def inputs_to_device(value, device: torch.device):
    """`value` with every tensor in it on `device` (Note [Inputs to the engine's device])."""
    return map_tensors(value, lambda t: t if t.device == device else t.to(device))
