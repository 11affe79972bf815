"""Views of chunk memory that outlive their module's access: tensors autograd saves, forwards
that do not come through the engine, and outputs that are parameters.

Note [Saved views of parameters]
Autograd saves leaves by reference, but many ops save a *view* made in forward: `F.linear` saves
`weight.t()`, whose storage is the chunk memory the weight was a view of at that moment. When the
chunk moves between forward and backward (eviction, prefetch) that memory is freed and reused by
another chunk, so the backward would read another tensor's bytes. The engine therefore runs the
forward under `saved_tensors_hooks`: a saved tensor whose storage is a parameter's chunk view is
packed as (parameter, offset, sizes, strides) and rebuilt in backward over wherever the
parameter's chunk lives then (re-accessing it if no hook did). DeepSpeed ZeRO-3 patches
`F.linear` for the same reason; the hooks cover every op, not just linear. A forward of the user's
module that does not come through `model(...)` (`model.module(x)`, or a method reached through
the engine that calls `self(...)`, such as `model.training_loss(batch)`) gets the same hooks from
a pre-hook on the module (`CallHooks`), and so does a submodule called directly (a forward written
outside the module: `model.module.blocks[0](x)`) from its pre-forward hook, unless saved-tensor
hooks are active already (the engine's forward, or torch.utils.checkpoint's, which must keep what
it is given): without them such forwards trained silently away from PyTorch under a device
budget. A backward with create_graph=True (a gradient penalty) saves what its own ops read for
the second backward outside these hooks, so there an unpacked view is handed out as a copy
(autograd keeps the link to the parameter).

Note [Outputs that are parameters]
A module may return one of its parameters or a view of one (`return self.pe[:T]`, a learned
position table; `return self.scale`): that tensor's memory is the chunk, released right after
the module's forward, and under a device budget the chunk moves while the caller still holds the
view (the next modules' accesses evict it), so the forward read another chunk's bytes, silently.
Such an output is handed on as a copy made before the release; autograd links the copy to the
parameter as it did the view. Any output whose storage is a parameter's chunk view is copied
(the parameter slots tell, as for saved tensors), so a view taken through `.data`
(`return self.weight.data[:T]`) is caught too.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .hooks import GONE_ENGINE_BACKWARD, saved_tensor_hooks_active

__all__ = ["SavedParameterViews"]


class _SavedParamView:
    """A saved tensor that is a view of a parameter's chunk memory."""

    __slots__ = ("index", "offset", "size", "stride")

    def __init__(self, index: int, offset: int, size, stride):
        self.index = index
        self.offset = offset
        self.size = size
        self.stride = stride


class SavedParameterViews:
    """Owns the saved-tensor hooks of the engine's parameters. Handed the parameter slots (which
    tell a chunk view's parameter and count accesses), the parameters, the activation store for
    every other saved tensor, and `join_backward` (the engine's: a re-access inside a backward
    joins it, Note [loss.backward()] in backward_pass.py)."""

    def __init__(self, slots, params: list[nn.Parameter], activations,
                 join_backward: Callable[[], None]):
        self._slots = slots
        self._params = params
        self._activations = activations
        self._join_backward = join_backward
        self._direct_calls: list = []  # entered hooks (or None) of forwards not through model()

    def close(self) -> None:
        """The engine was destroyed: drop the slots (they hold the chunk manager)."""
        self._slots = self._params = self._activations = None

    # Eager under torch.compile, as the engine's module hooks (Note [The engine's hooks under
    # torch.compile] in hooks.py): traced, the activation count's dict put a guard on its
    # length (`len(self._refs) == 34`), so every forward recompiled until the limit.
    @torch.compiler.disable
    def pack(self, tensor: torch.Tensor):
        index = self._slots.saved_index(tensor)
        if index < 0:
            return self._activations.pack(tensor)
        return _SavedParamView(index, tensor.storage_offset(), tensor.size(), tensor.stride())

    @torch.compiler.disable
    def unpack(self, packed):
        if self._activations is None:  # close(): a loss kept past `del model`
            raise RuntimeError(GONE_ENGINE_BACKWARD)
        if not isinstance(packed, _SavedParamView):
            return self._activations.unpack(packed)
        if self._slots.access_count(packed.index) == 0:
            # No hook accessed it for this backward (a parameter used outside its module's
            # forward); backward() releases it when it ends.
            self._join_backward()
            self._slots.access([packed.index])
        data = self._params[packed.index].data
        view = data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset)
        return view.clone() if torch.is_grad_enabled() else view  # create_graph: a copy

    def hooks(self):
        """The context that packs and unpacks saved tensors."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def enter_direct_call(self) -> None:
        """A forward of the user's module that bypasses the engine begins."""
        hooks = None
        if torch.is_grad_enabled() and not saved_tensor_hooks_active():
            hooks = self.hooks()
            hooks.__enter__()
        self._direct_calls.append(hooks)

    def leave_direct_call(self) -> None:
        hooks = self._direct_calls.pop() if self._direct_calls else None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def in_direct_call(self) -> bool:
        """Whether a direct call of the user's module is still running (an outer one)."""
        return bool(self._direct_calls)

    def leave_direct_calls(self) -> None:
        """Hooks that direct calls raising past their post-forward hook left entered."""
        while self._direct_calls:
            self.leave_direct_call()

    def own_output(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, returned by a module, or a copy if its memory is a parameter's chunk view
        (Note [Outputs that are parameters])."""
        if self._slots is not None and self._slots.saved_index(tensor) >= 0:
            return tensor.clone()
        return tensor
