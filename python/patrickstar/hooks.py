"""Module hooks that access a module's parameters before it runs and release them after, in
forward and in backward, and tick the memory tracer's moments.

Note [Backward hooks through autograd functions]
PyTorch's module backward hooks fire only when the module's inputs require grad, which the first
layer's (token ids) never do. Like DeepSpeed and PatrickStar, the forward hooks instead thread the
module's tensors through two identity autograd functions: the outputs pass `_BackwardCall` with the
pre-backward callback, whose backward runs just before the module's own backward (access its
parameters), and the inputs pass it with the post-backward callback, which runs just after it
(release them). A module whose inputs need no
grad never gets its post-backward call; the engine releases every parameter still in use when
backward ends.

Note [User hooks around the engine's]
torch runs a module's forward pre-hooks, then its forward hooks, in registration order. The
engine's are registered at initialize(): a user's forward hook registered after it ran after the
engine's release, and a user's pre-hook registered in model_func before the engine's access, so
a hook reading `module.weight` (a weight logger, a hook computing with the weight) read the
empty placeholder: shape (0,), sums of 0, silently. The engine's pre-hook is therefore
registered first (`prepend=True`: hooks from model_func already exist), and each pre-forward
moves the engine's forward hooks behind any hook registered after them (a cheap walk of a
module's few hooks), so a user's hook runs between the access and the release, whenever it was
registered. torch reads the forward hooks only after the forward, so the move takes effect for
the call under way. Global module hooks: Note [Global module hooks].

Note [Global module hooks]
torch runs the global forward pre-hooks (`torch.nn.modules.module.register_module_forward_pre_hook`:
a weight logger or activation statistics for every module) before any module's own pre-hooks,
the engine's access among them, so they read the empty placeholder: shape (0,), norms of 0,
silently. (Global forward hooks run before a module's own forward hooks, the engine's release
among them, so they see the values already.) When a global pre-hook exists, the engines put
one global pre-hook of their own first among them (`order_global_pre_hooks`, at registration
through the wrapper `install()` puts on torch's function, at initialize(), and at each engine
module's pre-forward for hooks added past the wrapper): it makes the engine module's whole
pre-forward there (access, tick, the inputs threaded through `_BackwardCall`), and the module's
own pre-forward hook, which torch calls next, skips it (`_early_forward`). Without global
pre-hooks nothing is registered, so a module call pays only the engine's own hooks; once the
user's are all removed, the engines' leaves too.

Note [User full backward pre-hooks]
torch wraps a module's outputs for its full backward hooks after every forward hook, the
engine's included, so in backward a user's `register_full_backward_pre_hook` ran before the
engine's pre-backward access (an autograd function on the outputs, inside torch's wrapper) and
read the placeholder, silently. A module with such hooks therefore also gets the engine's own
full backward pre-hook, first in its dict (at initialize() for hooks added in model_func; at
the user's registration afterwards, through backward_pre_hooks.py's wrapper): it makes the
access, and the module's next pre-backward call skips one access (`_early` counts them per
module; what a backward leaves is forgotten when it ends). Only such modules get it: a full
backward hook makes torch wrap the module's inputs and outputs, which forbids in-place
changes of its outputs.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Callable, ContextManager

import torch
from torch.nn.modules import module as torch_module

from .tensor_tree import map_tensors

__all__ = ["CallHooks", "ModuleHooks", "install", "order_global_pre_hooks",
           "saved_tensor_hooks_active"]


# Note [The engine's hooks under torch.compile]
# `torch.compile(model)` traces the modules' forwards, and with them the hooks torch calls around
# each module. The engine's hooks move chunks, count accesses and tick the tracer: work with side
# effects on Python and C++ state that dynamo cannot capture, and whose guards (which module,
# which dict entry) differ for every module, so it recompiled each hook per module until its
# recompile limit (8) and then fell back to eager for the whole frame, with a page of warnings.
# They run eagerly instead (a graph break at each hook); the modules' own forwards between them
# are still compiled. So do the saved-tensor hooks (SavedParameterViews.pack/unpack in
# saved_views.py), which count activations in a dict whose length dynamo guarded on.
_eager = torch.compiler.disable


# Note [Identity outputs the caller may change in place]
# Models change module outputs and inputs in place: Falcon's decoder does `mlp_output +=
# attention_output` on what its MLP returns, `nn.Sequential(nn.Linear(...), nn.ReLU(inplace=True))`
# and torchvision's ResNet blocks (`out += identity; relu(out)` after a BatchNorm) change a
# module's output, and a module may add to its input (`x += bias`). Plain autograd allows all of
# them. `_BackwardCall` returned `tensor.view_as(tensor)`, and a view made inside a custom
# Function may not be changed in place ("Output 0 of _BackwardCall is a view and is being
# modified inplace"), so such models crashed at their first forward. It returns
# `tensor.detach()` instead, as DeepSpeed's PreBackwardFunction does: autograd does not count a
# detached tensor as a view, so it becomes an ordinary output of the Function (the in-place
# op's backward runs before `_BackwardCall`'s, as in PyTorch before the module's); it shares
# the storage and the version counter with `tensor`, so an in-place change is the same change
# to the same memory as without the engine, and autograd still catches a change to a tensor
# some backward saved (an op that saved its output, such as exp, still raises).
class _BackwardCall(torch.autograd.Function):
    """Identity in forward; in backward calls `callback(module)` before passing the grad on."""

    @staticmethod
    def forward(ctx, callback, module, tensor):
        ctx.callback = callback
        ctx.module = module
        return tensor.detach()  # Note [Identity outputs the caller may change in place]

    @staticmethod
    def backward(ctx, grad):
        ctx.callback(ctx.module)
        return None, None, grad


# RemovableHandle ids of every engine's module hooks (unique across modules and engines): the
# hooks a user's are moved in front of (Note [User hooks around the engine's]).
_ENGINE_HOOK_IDS: set[int] = set()


def _move_engine_hooks_last(hooks) -> None:
    """Moves the engine's hooks in `hooks` (a module's OrderedDict of forward hooks) behind the
    others, keeping each side's order, when another follows one of them."""
    ours = False
    for key in hooks:
        if key in _ENGINE_HOOK_IDS:
            ours = True
        elif ours:
            break
    else:
        return
    for key in [key for key in hooks if key in _ENGINE_HOOK_IDS]:
        hooks.move_to_end(key)


class HookSet:
    """The handles of hooks an engine installed: removable together, and known by id (copies
    of the user's module leave them out: module_copies.py)."""

    def __init__(self):
        self._handles = []

    def _add(self, handle) -> None:
        self._handles.append(handle)
        _ENGINE_HOOK_IDS.add(handle.id)

    @property
    def hook_ids(self) -> set[int]:
        return {handle.id for handle in self._handles}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
            _ENGINE_HOOK_IDS.discard(handle.id)
        self._handles.clear()


# Note [Global module hooks]: each engine module's ModuleHooks, weakly (an engine's modules
# leave with its hooks), and the engines' one global pre-hook while the user has some.
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TORCH_REGISTER_GLOBAL_PRE = torch_module.register_module_forward_pre_hook
_global_pre_handle = None


@_eager
def _global_pre_forward(module, inputs):
    if len(torch_module._global_forward_pre_hooks) == 1:  # the user's are gone
        order_global_pre_hooks()  # removes this hook (torch runs a copy of the dict's hooks)
    owner = _OWNERS.get(module)
    hooks = owner() if owner is not None else None
    return None if hooks is None else hooks.early_pre_forward(module, inputs)


def order_global_pre_hooks() -> None:
    """Puts the engines' global pre-hook first among torch's global forward pre-hooks when the
    user has any and an engine lives; removes it when it is alone (Note [Global module
    hooks])."""
    global _global_pre_handle
    hooks = torch_module._global_forward_pre_hooks
    ours = _global_pre_handle.id if _global_pre_handle is not None else None
    if ours is not None and ours in hooks:
        if len(hooks) == 1 or not _OWNERS:
            _global_pre_handle.remove()
            _global_pre_handle = None
        elif next(iter(hooks)) != ours:
            hooks.move_to_end(ours, last=False)
        return
    if hooks and _OWNERS:
        _global_pre_handle = _TORCH_REGISTER_GLOBAL_PRE(_global_pre_forward)
        hooks.move_to_end(_global_pre_handle.id, last=False)


@functools.wraps(_TORCH_REGISTER_GLOBAL_PRE)
def register_module_forward_pre_hook(hook):
    handle = _TORCH_REGISTER_GLOBAL_PRE(hook)
    order_global_pre_hooks()
    return handle


def install() -> None:
    """Puts the wrapper where `torch.nn.modules.module.register_module_forward_pre_hook` is
    looked up (idempotent)."""
    torch_module.register_module_forward_pre_hook = register_module_forward_pre_hook


# What a backward through a forward of an engine that is gone says: from its module hooks' nodes
# while the destroyed engine object is still held (Note [A backward after destroy()]), from
# its saved-tensor hooks once it is collected (SavedParameterViews.unpack).
GONE_ENGINE_BACKWARD = (
    "backward through a forward of a PatrickStar engine that was deleted or destroyed since "
    "(`del model` or model.destroy()): its chunks and the tensors the forward saved for "
    "backward were freed with it. Run the backward before deleting the engine, or run the "
    "forward again on a live engine")


class ModuleHooks(HookSet):
    """Installs forward hooks on `modules`; calls `access(module)` before a module runs (forward
    and backward) and `release(module, phase)` after, with phase "fwd" or "bwd"; `tick(event)`
    at each of those moments. The engine passes the modules that own parameters directly: a
    container or a parameter-free layer (ModuleList, Dropout, an activation) changes no chunk's
    state, so hooking it would only add moments without accesses and an autograd node per
    tensor it passes on (a third of a small GPT's modules)."""

    def __init__(self, modules, access: Callable[[torch.nn.Module, str], None],
                 release: Callable[[torch.nn.Module, str], None],
                 tick: Callable[[str], None],
                 own_output: Callable[[torch.Tensor], torch.Tensor],
                 saved_tensor_hooks: Callable[[], ContextManager] | None = None):
        """`own_output(tensor)` is applied to each output tensor before the release: a tensor
        whose memory is a parameter's chunk view comes back as a copy (Note [Outputs that are
        parameters] in saved_views.py). `saved_tensor_hooks()` makes the
        engine's saved-tensor hooks, entered around a module's forward with grad enabled when
        none are in effect (a submodule called directly, not through the engine: Note [Saved
        views of parameters] in saved_views.py)."""
        super().__init__()
        self._access = access
        self._release = release
        self._tick = tick
        self._own_output = own_output
        self._saved_tensor_hooks = saved_tensor_hooks
        self._entered: list = []  # (module, context) entered by a pre-forward, innermost last
        self._modules = set(modules)
        self._early_hooks: dict[torch.nn.Module, int] = {}  # Note [User full backward pre-hooks]
        self._early: dict[torch.nn.Module, int] = {}
        self._early_forward: set = set()  # Note [Global module hooks]
        self._removed = False  # Note [A backward after destroy()]
        for module in modules:  # Note [User hooks around the engine's]
            self._add(module.register_forward_pre_hook(self._pre_forward, prepend=True))
            self._add(module.register_forward_hook(self._post_forward))
            if module._backward_pre_hooks:  # added in model_func
                self.put_first_in_backward(module)
        owner = weakref.ref(self)
        for module in modules:
            _OWNERS[module] = owner
        order_global_pre_hooks()

    def remove(self) -> None:
        self._removed = True
        for module in self._modules:
            if _OWNERS.get(module) is not None and _OWNERS[module]() is self:
                del _OWNERS[module]
        super().remove()
        order_global_pre_hooks()

    def put_first_in_backward(self, module) -> None:
        """Note [User full backward pre-hooks]: the engine's access runs before the user's full
        backward pre-hooks of `module` (a no-op for a module without parameters of its own)."""
        if module not in self._modules:
            return
        hook_id = self._early_hooks.get(module)
        if hook_id is None:
            handle = module.register_full_backward_pre_hook(self._early_pre_backward,
                                                            prepend=True)
            self._add(handle)
            self._early_hooks[module] = handle.id
        elif next(iter(module._backward_pre_hooks)) != hook_id:
            module._backward_pre_hooks.move_to_end(hook_id, last=False)

    @_eager
    def _early_pre_backward(self, module, grad_output):
        self.pre_backward(module)
        self._early[module] = self._early.get(module, 0) + 1

    def end_backward(self) -> None:
        """Forgets early accesses whose pre-backward call did not come (all are released)."""
        self._early.clear()

    # Forward ----------------------------------------------------------------------------------
    @_eager
    def _pre_forward(self, module, inputs):
        _move_engine_hooks_last(module._forward_hooks)  # Note [User hooks around the engine's]
        if torch_module._global_forward_pre_hooks:  # Note [Global module hooks]
            if module in self._early_forward:
                self._early_forward.discard(module)
                return None  # made by the global pre-hook, which torch ran first
            order_global_pre_hooks()  # for hooks registered past the wrapper
        return self._enter(module, inputs)

    @_eager
    def early_pre_forward(self, module, inputs):
        """The pre-forward of `module` from the engines' global pre-hook, ahead of the user's
        global ones (Note [Global module hooks])."""
        result = self._enter(module, inputs)
        self._early_forward.add(module)
        return result

    def _enter(self, module, inputs):
        self._tick("pre_forward")
        self._access(module, "fwd")
        if torch.is_grad_enabled():
            if self._saved_tensor_hooks is not None and not saved_tensor_hooks_active():
                context = self._saved_tensor_hooks()
                context.__enter__()
                self._entered.append((module, context))
            return map_tensors(inputs, lambda t: _BackwardCall.apply(self.post_backward, module, t)
                                if t.requires_grad else t)
        return None

    def leave_saved_tensor_hooks(self) -> None:
        """Leaves the hooks entered by forwards that raised before their post-forward hook."""
        self._early_forward.clear()
        while self._entered:
            self._entered.pop()[1].__exit__(None, None, None)

    @_eager
    def _post_forward(self, module, inputs, output):
        if self._entered and self._entered[-1][0] is module:
            self._entered.pop()[1].__exit__(None, None, None)
        copies = []

        def own(tensor):
            copy = self._own_output(tensor)  # None: the engine is gone
            if copy is None or copy is tensor:
                return tensor
            copies.append(copy)
            return copy

        output = map_tensors(output, own)
        self._release(module, "fwd")
        self._tick("post_forward")
        if torch.is_grad_enabled():
            return map_tensors(output, lambda t: _BackwardCall.apply(self.pre_backward, module, t)
                                if t.requires_grad else t)
        return output if copies else None

    # Backward (called from the autograd functions) --------------------------------------------
    # Note [A backward after destroy()]
    # The autograd nodes a forward put behind each module's outputs (_BackwardCall) hold these
    # methods, and a graph may outlive the engine: `loss = model(x); model.destroy();
    # loss.backward()`. Once the engine is collected its calls do nothing and the saved-tensor
    # hooks name it; while the destroyed engine object is still held (`model` kept after
    # destroy()), the call reached its freed chunk manager and failed with AttributeError
    # "'NoneType' object has no attribute 'tick'". The engine removes its hooks when destroyed,
    # so a backward through hooks removed says what happened instead.
    def pre_backward(self, module):
        if self._removed:
            raise RuntimeError(GONE_ENGINE_BACKWARD)
        early = self._early.get(module, 0)
        if early:  # made by _early_pre_backward (Note [User full backward pre-hooks])
            self._early[module] = early - 1
            return
        self._tick("pre_backward")
        self._access(module, "bwd")

    def post_backward(self, module):
        if self._removed:
            raise RuntimeError(GONE_ENGINE_BACKWARD)
        self._release(module, "bwd")
        self._tick("post_backward")


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (the engine's, torch.utils.checkpoint's) are in effect."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class CallHooks(HookSet):
    """Calls `enter()` before each of `modules` runs and `leave(raised)` after it, also when it
    raises (the engine's saved-tensor hooks around a forward that did not come through the
    engine: Note [Saved views of parameters] in saved_views.py)."""

    def __init__(self, modules, enter: Callable[[], None], leave: Callable[[bool], None]):
        super().__init__()
        for module in modules:
            self._add(module.register_forward_pre_hook(
                _eager(lambda _module, _inputs: enter()), prepend=True))
            self._add(module.register_forward_hook(
                _eager(lambda _module, _inputs, output: leave(_raised(output))),
                always_call=True))


def _raised(output) -> bool:
    """Whether an always_call forward hook runs for a forward that raised: torch calls it from
    its `except` clause with no output. (A module returning None inside the user's own `except`
    clause looks the same; what the caller does then is harmless after a clean forward.)"""
    return output is None and sys.exc_info()[1] is not None
