"""Forwards of the engine's module under torch's tracers and function transforms that cannot see
chunked parameters: refused at once, naming the plain copy to use.

Note [Tracing the engine's module]
A parameter's `.data` is its chunk view only between its module's access and release; the rest of
the time it is an empty placeholder (Note [Parameter data swapping] in docs/design.md), and every
forward runs under the engine's saved-tensor hooks (Note [Saved views of parameters] in
saved_views.py). Four of torch's tools cannot work on that:
  * torch.jit.trace records the parameters as constants of its graph: the graph ran on the
    placeholders and its sanity check failed with "The following operation failed in the
    TorchScript interpreter" (or, unchecked, the traced module failed when called);
  * torch.export (non-strict) runs the forward on fake parameters, which the engine's access
    read as chunk memory: "Cannot access data pointer of Tensor (e.g. FakeTensor ...)", and the
    failed access left the engine broken ("its data is not allocated yet" at the next training
    forward);
  * torch.func.grad (and vjp, jacrev, hessian, which run under the same transform) refuses any
    saved-tensor hooks: "don't yet support saved tensor hooks. Please open an issue";
  * torch.func.jvp (and jacfwd) runs the forward on dual tensors, on which the engine's hooks
    failed: "Attempted to access the data pointer on an invalid python storage".
None of them is needed on the engine itself: `copy.deepcopy(model.module)` is a plain module with
the current weights (module_copies.py), which each of them takes. So a forward of the engine or
of its module under one of them raises before the engine touches any parameter, saying so.
torch.func.vmap and functional_call work (tested as on a plain module) and are left alone; so is
torch.compile, whose graphs break at the engine's hooks (Note [The engine's hooks under
torch.compile] in hooks.py). A submodule called directly under a tracer
(`torch.jit.trace(model.module.layer, x)`) is not checked: the check is at the two entries of a
whole forward, not in every module's hook.

Note [Scripting the engine's module]
torch.jit.script compiles a module's forward and turns its parameters into attributes of the
script module: here the empty placeholders, with the engine's hooks left behind. On the engine
it failed on the engine's own forward ("Compiled functions can't take variable number of
arguments", pointing into engine.py), on `model.module` with "SyntaxError: unmatched ')'"
from a hook's source; neither said what to do. torch.jit.script asks every module of the tree
for `__prepare_scriptable__()` before it compiles anything, so the engine has one and each of
the user's modules that holds chunked parameters gets one as an instance attribute (a `Shadow`,
which copies leave out: Note [Copies of the user's module] in module_copies.py), which raises,
naming the ways that work: eager, torch.compile, or scripting `copy.deepcopy(model.module)`.
"""
from __future__ import annotations

import torch
from torch import nn

from .module_methods import Shadow

__all__ = ["refuse_scripting", "refuse_script_call", "refuse_traced_call"]


def _tracer() -> str | None:
    """The tracer or transform running now that cannot take chunked parameters, if any."""
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if torch.compiler.is_exporting():
        return "torch.export"
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is not None:
        kind = interpreter.key()
        if kind == torch._C._functorch.TransformType.Grad:
            return "torch.func.grad (or vjp, jacrev, hessian)"
        if kind == torch._C._functorch.TransformType.Jvp:
            return "torch.func.jvp (or jacfwd)"
    return None


def refuse_traced_call(call: str) -> None:
    """Raises if `call` (the forward starting, "model(...)" or "model.module(...)") runs under
    a tracer of Note [Tracing the engine's module]."""
    tracer = _tracer()
    if tracer is None:
        return
    raise RuntimeError(
        f"{tracer} of {call}: the engine's parameters live in chunks and are swapped in only "
        "around each module's forward, under saved-tensor hooks, which this cannot follow. "
        "Use a plain copy with the current weights instead: copy.deepcopy(model.module) "
        "(e.g. torch.jit.trace(copy.deepcopy(model.module), example_inputs))")


def refuse_script_call(what: str) -> None:
    """torch.jit.script of `what` (the engine or one of the user's modules holding chunked
    parameters): Note [Scripting the engine's module]."""
    raise RuntimeError(
        f"torch.jit.script({what}): TorchScript cannot compile a module whose parameters live in "
        "PatrickStar chunks (they are swapped in only around each module's forward by the "
        "engine's hooks, which TorchScript cannot run). Train the engine eagerly, or use "
        "torch.compile(model), which works on it; to script or export the trained model, script "
        "a plain copy with the current weights: torch.jit.script(copy.deepcopy(model.module))")


def refuse_scripting(root: nn.Module) -> None:
    """Gives every module under `root` that holds parameters a `__prepare_scriptable__` that
    raises (Note [Scripting the engine's module])."""
    for name, module in root.named_modules():
        if next(module.parameters(), None) is not None:
            what = "model.module" + (f".{name}" if name else "")
            module.__dict__["__prepare_scriptable__"] = Shadow(refuse_script_call, what)
