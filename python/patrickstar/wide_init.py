"""torch.nn.init's initializers on parameters whose chunk slot is narrower than the dtype they
were built in, run in that built dtype.

Note [Initializers in the built dtype]
A parameter lands in its chunk slot as it is registered, and the module's own initialization
then writes into the slot (Note [Two-pass initialization] in init_context.py). With fp32 (or
16-bit with an fp32 master) the slot is as wide as the fp32 parameter model_func built, so the
initializers draw the numbers a plain `model_func()` draws. With `bf16.master_weights: false`
the slot is bf16 (so is a frozen parameter's in fp16/bf16: Note [Frozen parameters in 16 bits]
in engine.py), and an initializer run on it computes in 16 bits, which is not what PyTorch's
`model_func().bfloat16()` holds:
  * `uniform_` in bf16 maps a draw that rounds up to the bound `b` to `-b` (torch keeps its
    interval half-open), so nn.Linear's and nn.Conv's default `kaiming_uniform_` and bias
    `uniform_` put about one weight in a thousand at the far end of the range;
  * `orthogonal_` runs a QR decomposition, which torch's CPU build has no 16-bit kernel for:
    model_func raised NotImplementedError ("geqrf_cpu" not implemented for 'BFloat16').
So while model_func runs, each public in-place initializer of torch.nn.init, called on such a
parameter, runs on a copy in the dtype the parameter was built in, which is then rounded into
the slot, as `.bfloat16()` rounds (one parameter's copy at a time: the memory bound of the
build holds). It draws the same random numbers as the plain build, so the weights are exactly
those of `model_func().bfloat16()` (`.half()` in fp16). Tensor methods called on the
parameter's `.data` directly (`w.data.uniform_(-a, a)`) still compute in the slot's dtype
(`normal_` gives the same values there; `uniform_` differs as above).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch

__all__ = ["initializers_in_built_dtype"]

# The in-place initializers of torch.nn.init that take the tensor first.
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_")


def _in_built_dtype(initializer: Callable, built_dtype: Callable) -> Callable:
    @functools.wraps(initializer)
    def run(tensor, *args, **kwargs):
        dtype = built_dtype(tensor)
        if dtype is None:
            return initializer(tensor, *args, **kwargs)
        with torch.no_grad():
            wide = tensor.detach().to(dtype)
            initializer(wide, *args, **kwargs)
            tensor.copy_(wide)
        return tensor
    return run


@contextlib.contextmanager
def initializers_in_built_dtype(built_dtype: Callable[[torch.Tensor], torch.dtype | None]
                                ) -> Iterator[None]:
    """Note [Initializers in the built dtype]. `built_dtype(tensor)`: the dtype to run an
    initializer on `tensor` in, or None to run it on the tensor as it is."""
    init = torch.nn.init
    originals = {name: getattr(init, name) for name in _INITIALIZERS if hasattr(init, name)}
    for name, initializer in originals.items():
        setattr(init, name, _in_built_dtype(initializer, built_dtype))
    try:
        yield
    finally:
        for name, initializer in originals.items():
            setattr(init, name, initializer)
