"""A user's `module.register_full_backward_pre_hook(hook)` on an engine's module, after
initialize(): the engine's access is put before it (Note [User full backward pre-hooks] in
hooks.py). torch's registration is wrapped once, when the first engine is made, as
clip_grad.py and module_zero_grad.py wrap theirs."""
from __future__ import annotations

import functools

from torch import nn

from .param_owners import engine_of

__all__ = ["install"]

_TORCH_REGISTER = nn.Module.register_full_backward_pre_hook
_ordering = False  # the engine's own registration comes through here too


@functools.wraps(_TORCH_REGISTER)
def register_full_backward_pre_hook(self: nn.Module, hook, prepend: bool = False):
    global _ordering
    handle = _TORCH_REGISTER(self, hook, prepend=prepend)
    if _ordering:
        return handle
    engine = next((e for e in map(engine_of, self.parameters(recurse=False)) if e is not None),
                  None)
    if engine is not None:
        _ordering = True
        try:
            engine.order_backward_pre_hooks(self)
        finally:
            _ordering = False
    return handle


def install() -> None:
    """Puts the wrapper where every module looks it up (idempotent)."""
    nn.Module.register_full_backward_pre_hook = register_full_backward_pre_hook
