"""Parameters that call back on their first use by any torch function.

Note [Restoring on first use]
A parameter whose `.data` is an empty placeholder for now (its values elsewhere: a chunk slot
released while the model is built, Note [Initialization under a host budget] in
init_context.py; a value `model.apply(fn)` lends only if `fn` touches it, module_apply.py) can
be given a class: a subclass of its own whose `__torch_function__` calls `restore()` on the
first torch function or method that sees it (`normal_`, `copy_`, `.data`, `.shape`, `F.linear`,
...), which turns it back into its own class over real data before the call runs. `defer` and
`undefer` install and remove that class; `restore()` must call `undefer` first.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["defer", "undefer", "is_deferred"]

_DEFERRED_CLASSES: dict[type, type] = {}


def _deferred_class(cls: type) -> type:
    deferred = _DEFERRED_CLASSES.get(cls)
    if deferred is None:
        def __torch_function__(klass, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for value in torch.utils._pytree.tree_leaves((args, kwargs)):
                if is_deferred(value):
                    value._ps_restore()
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

        deferred = type(f"Deferred{cls.__name__}", (cls,),
                        {"__torch_function__": classmethod(__torch_function__)})
        _DEFERRED_CLASSES[cls] = deferred
    return deferred


def is_deferred(value) -> bool:
    return type(value) in _DEFERRED_CLASSES.values()


def defer(param: nn.Parameter, restore: Callable[[], None]) -> type:
    """Gives `param` the class that calls `restore()` on its first use; returns its own class."""
    original = type(param)
    param.__class__ = _deferred_class(original)
    param._ps_restore = restore
    return original


def undefer(param: nn.Parameter, original: type) -> None:
    del param._ps_restore
    param.__class__ = original
