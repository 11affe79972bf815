"""`model.apply(fn)` and `model.summon_full_params()` on the engine: the parameters the code
touches hold their values while it runs.

Note [Applying a function to the modules]
Between uses an engine's parameters hold empty placeholders (Note [Parameter data swapping] in
engine.py), so `fn` (Hugging Face's `_init_weights`, `nn.init` on a new head) would write into
nothing; such a write now raises at the next access (Note [Writes to a released parameter] in
bindings/parameter_slots.cc). `PatrickStarEngine.apply(fn)` visits the modules as
`nn.Module.apply` does, children first. For each call `fn(module)` every parameter of the
module's subtree that is not in use is deferred (Note [Restoring on first use]): the first torch
function that touches it lends it a copy of its values in the compute dtype. So a parent whose
`fn` initializes its children's weights (Hugging Face's GPT-2 scales `attn.c_proj.weight` from
the attention module) works, and parameters `fn` never touches cost nothing. After the call, a
lent value that differs from what was lent, compared by content (`p.data.normal_()` writes
through an alias whose version counter is not the parameter's), or that was replaced, is loaded
back (`load_parameter`: compute copy, master, compensation zeroed); an unchanged one is not, so
a read-only `fn` leaves an fp32 master untouched.
In one process each call's changes are loaded right after it. Under data parallelism reading a
parameter is a collective (the groups are gathered first, as for state_dict) and a load writes
only the owners' chunks, so the changes stay pending (a parameter touched again is lent its
pending value) until apply ends; then they are loaded and every rank drops its gathered copies,
which would be stale. Every rank must call apply with the same `fn`.
`model.summon_full_params(writeback=True)` (FSDP's name) lends the same way for a block of code
(`torch.optim.swa_utils.AveragedModel.update_parameters(model)`, reading or editing weights by
hand); no forward may run inside it (an access finds a lent parameter's data in place of its
placeholder and raises).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from .restore_on_use import defer, is_deferred, undefer

__all__ = ["ModuleApply"]


class ModuleApply:
    """One `apply(fn)` over `engine`'s module. The engine gives `params` (index_of, names,
    shapes), `read_parameter`, `load_parameter`, `parameter_in_use`, `restore_placeholders` and
    `dp.parameters_changed`."""

    def __init__(self, engine, pending_until_end: bool):
        self._engine = engine
        self._pending_until_end = pending_until_end
        self._pending: dict[int, torch.Tensor] = {}
        self._reshaped: list[str] = []  # changes refused (another shape), raised at the end

    def run(self, module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        """`fn` on `module`'s subtree, children first; changes of another shape are refused by
        `raise_refused()`, after the rest is applied."""
        try:
            self._visit(module, fn)
        finally:
            self._load_pending()

    def raise_refused(self) -> None:
        reshaped, self._reshaped = self._reshaped, []
        if reshaped:
            raise ValueError(f"model.apply()/summon_full_params(): {'; '.join(reshaped)} in the "
                             f"chunks: those keep their old values (the other changes were "
                             f"applied)")

    def _visit(self, module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        for child in module.children():
            self._visit(child, fn)
        self.call(module, fn)

    def call(self, module: nn.Module, fn: Callable[[nn.Module], object]):
        """`fn(module)`, the parameters of `module`'s subtree lent on first touch; returns what
        `fn` returns."""
        try:
            with self._lending(module):
                return fn(module)
        finally:  # what fn changed before it raised is kept, as in PyTorch
            if not self._pending_until_end:
                self._load_pending()

    def run_once(self, module: nn.Module, fn: Callable[[nn.Module], object]):
        """`fn(module)` alone (not on the children first), as `call`, with every change loaded
        by the end; changes of another shape are refused by `raise_refused()`."""
        try:
            return self.call(module, fn)
        finally:
            self._load_pending()

    @contextlib.contextmanager
    def lent(self, module: nn.Module, writeback: bool):
        """The parameters of `module`'s subtree lent on first touch inside the block (FSDP's
        `summon_full_params`); their changes loaded at its end when `writeback`, else
        dropped."""
        try:
            with self._lending(module):
                yield
        finally:
            if not writeback:
                self._pending.clear()
            self._load_pending()
        self.raise_refused()

    @contextlib.contextmanager
    def _lending(self, module: nn.Module):
        engine = self._engine
        deferred: dict[int, tuple[nn.Parameter, type]] = {}
        lent: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # index -> (param, as lent)

        def lend(index: int) -> None:
            param, original = deferred.pop(index)
            undefer(param, original)
            pending = self._pending.get(index)
            value = engine.read_parameter(index) if pending is None else pending.clone()
            lent[index] = (param, value.clone())
            with torch._C.DisableTorchFunctionSubclass():
                param.data = value

        for param in module.parameters():
            index = engine.params.index_of(param)
            if (index is None or index in deferred or is_deferred(param)
                    or engine.parameter_in_use(index)):
                continue
            deferred[index] = (param, defer(param, functools.partial(lend, index)))
        try:
            yield
        finally:
            for param, original in deferred.values():
                undefer(param, original)
            for index, (param, as_lent) in lent.items():
                value = param.data
                if value.shape != as_lent.shape or not torch.equal(value, as_lent):
                    self._pending[index] = value
            engine.restore_placeholders(list(lent))

    def _load_pending(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        engine = self._engine
        try:
            for index, value in pending.items():
                shape = tuple(engine.params.shapes[index])
                if tuple(value.shape) != shape:
                    self._reshaped.append(f"'module.{engine.params.names[index]}' was given "
                                          f"shape {tuple(value.shape)}, it has {shape}")
                else:
                    engine.load_parameter(index, value)
        finally:
            engine.dp.parameters_changed()  # gathered copies of what the owners loaded
