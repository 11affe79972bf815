"""Parameters built in a memory format other than the contiguous one (`model.to(memory_format=
torch.channels_last)` inside model_func): stored contiguous, with a warning saying what differs
from PyTorch.

Note [Memory formats of parameters]
A parameter's values live in its chunk as one contiguous run of elements, and every view of it
(the forward's, the optimizer's, state dicts, checkpoints, the gradient stores, data-parallel
collectives) reads them in that order, so a parameter model_func made channels_last is copied
into its slot in contiguous order: its values are kept, its strides are not. What PyTorch's
channels_last model gives and this one does not: a Conv2d follows the weight's format when the
input is contiguous, so a channels_last model's outputs (and activations) are channels_last in
PyTorch and contiguous here (the values are the same: tested against PyTorch, with the
gradients); `state_dict()` holds contiguous tensors. A channels_last *input* gives channels_last
activations here as in PyTorch (a convolution is channels_last when either operand is), which
is the way to keep that layout (for cuDNN's NHWC kernels on a GPU). Keeping the strides in the
chunk would take a layout per parameter in every one of those views, the C++ gradient stores
included; initialize() warns instead, naming the parameters.
"""
from __future__ import annotations

import torch

__all__ = ["format_name", "memory_format_warning"]

_FORMATS = ((torch.channels_last, "channels_last"), (torch.channels_last_3d, "channels_last_3d"))


def format_name(tensor: torch.Tensor) -> str | None:
    """None for a contiguous tensor, else its memory format's name ("non-contiguous" when it
    is none of torch's named formats)."""
    if tensor.is_contiguous():
        return None
    for memory_format, name in _FORMATS:
        if tensor.dim() == (4 if name == "channels_last" else 5) and \
                tensor.is_contiguous(memory_format=memory_format):
            return name
    return "non-contiguous"


def memory_format_warning(formats: dict[str, str], total: int) -> str | None:
    """The warning for parameters (name -> format name) built in another memory format
    (Note [Memory formats of parameters]); None when there are none."""
    if not formats:
        return None
    name, kind = next(iter(formats.items()))
    return (f"patrickstar.initialize: model_func built {len(formats)} of {total} parameters in "
            f"a memory format other than the contiguous one (e.g. '{name}': {kind}); chunks "
            f"store parameters contiguous, so they keep their values but not that format. "
            f"Outputs have PyTorch's values, but their memory format follows the inputs' (a "
            f"channels_last model's outputs are contiguous here for contiguous inputs): pass "
            f"inputs in the format (x.to(memory_format=torch.channels_last)) for activations "
            f"in it; state_dict() holds contiguous tensors")
