"""Trainable parameters added to an engine's module after initialize().

Note [Parameters added after initialize()]
Fine-tuning scripts change the model's structure once it is built: a new head
(`model.classifier = nn.Linear(h, n_new)`), a new layer (`model.layers.append(...)`,
`add_module`), a new parameter (`register_parameter("gain", nn.Parameter(...))`), LoRA
adapters injected beside the weights. In PyTorch the optimizer is created after that, over
`model.parameters()`. With PatrickStar the optimizer was created by initialize() over the
parameters it laid out in chunks: the new ones computed in the forward and received gradients,
but no optimizer step ever changed them, without a word (the new head stayed at its random
initialization while the loss still moved through the old layers). So a module or parameter
that brings trainable parameters the engine does not own into a module of the engine raises at
once, before torch changes the module (torch's global module and parameter registration hooks
run before the assignment), naming what was added and model_func, where such changes train as
in PyTorch. What keeps the parameters the engine trains is left as torch has it: modules
without parameters (`nn.Identity()`, an activation), buffers, frozen parameters
(`requires_grad=False`, which torch would not train either: unfreezing them later with
`requires_grad_(True)` is refused at the next forward, the first point the engine can see it),
modules that rewrap the engine's own parameters, and removing a layer (`del model.norm`: its
parameters no longer receive gradients and are left alone, as torch's optimizer leaves
parameters whose `.grad` is None).
Replacing one of the engine's parameters is Note [Replacing a parameter after initialize()]
(replaced_params.py).
"""
from __future__ import annotations

import weakref

from torch import nn

from .param_owners import engine_of

__all__ = ["register_modules", "refuse_unfrozen", "install"]

# module -> (weak engine, the module's name under the engine, "module.layers.0"). Weak keys: an
# engine's modules leave the registry with the model.
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HANDLES: list = []
# engine -> [(weak parameter, its name)]: the frozen parameters accepted after initialize().
_FROZEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_modules(engine, root: nn.Module, prefix: str = "") -> None:
    """`root` and its modules, named as under `engine` (the engine itself: "", its module:
    "module")."""
    owner = weakref.ref(engine)
    for name, module in root.named_modules(prefix=prefix):
        _MODULES[module] = (owner, name)


def _owner(module: nn.Module):
    entry = _MODULES.get(module) if isinstance(module, nn.Module) else None
    if entry is None:
        return None, None
    engine = entry[0]()
    return (engine, entry[1]) if engine is not None else (None, None)


def _refuse(what: str, new: list[tuple[str, tuple]]) -> None:
    listed = ", ".join(f"'{name}' {shape}" for name, shape in new[:4])
    more = f" and {len(new) - 4} more" if len(new) > 4 else ""
    raise ValueError(
        f"{what} after patrickstar.initialize() brings trainable parameters the engine does "
        f"not own ({listed}{more}): the engine's optimizer was created by initialize() over "
        f"the parameters in its chunks, so these would compute in the forward but never be "
        f"trained. Make the change inside model_func, on the module it builds (replace the head, "
        f"add the layer or the adapters there before returning the model), where it trains as "
        f"in PyTorch; what is added after initialize() must stay frozen (requires_grad=False)")


def _keep_frozen(engine, named: list[tuple[str, nn.Parameter]]) -> None:
    if named:
        _FROZEN.setdefault(engine, []).extend((weakref.ref(p), name) for name, p in named)


def refuse_unfrozen(engine) -> None:
    """Raises if a parameter added frozen after initialize() (Note [Parameters added after
    initialize()]) that is still in the engine's module requires grad now; run before each
    forward."""
    kept = _FROZEN.get(engine)
    if not kept:
        return
    alive = [(param, ref, name) for ref, name in kept if (param := ref()) is not None]
    kept[:] = [(ref, name) for _, ref, name in alive]
    unfrozen = [(param, name) for param, _, name in alive if param.requires_grad]
    if not unfrozen:
        return
    present = {id(p) for p in engine.parameters()}
    new = [(name, tuple(p.shape)) for p, name in unfrozen if id(p) in present]
    if new:
        _refuse("requires_grad_(True) of parameters added frozen", new)


def _joined(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _check_module(module: nn.Module, name: str, submodule):
    engine, where = _owner(module)
    if engine is None or not isinstance(submodule, nn.Module):
        return None
    added = [(f"{_joined(where, name)}.{pname}", param) for pname, param in
             submodule.named_parameters() if engine_of(param) is not engine]
    new = [(qualified, tuple(param.shape)) for qualified, param in added if param.requires_grad]
    if new:
        _refuse(f"{type(module).__name__}.{name} = {type(submodule).__name__}(...) (as "
                f"'{_joined(where, name)}')", new)
    # Accepted (no parameters, frozen ones or the engine's own): what is added later inside it
    # is checked too, and so is unfreezing what it brought.
    register_modules(engine, submodule, _joined(where, name))
    _keep_frozen(engine, added)
    return None


def _check_parameter(module: nn.Module, name: str, param):
    engine, where = _owner(module)
    if engine is None or param is None or engine_of(param) is not None:
        return None  # replacing one of the engine's own: replaced_params.py
    if not param.requires_grad:
        _keep_frozen(engine, [(_joined(where, name), param)])
        return None
    _refuse(f"{type(module).__name__}.{name} = <new parameter> (as '{_joined(where, name)}')",
            [(_joined(where, name), tuple(param.shape))])
    return None


def install() -> None:
    """Registers the hooks once for the process (idempotent)."""
    if not _HANDLES:
        _HANDLES.append(nn.modules.module.register_module_module_registration_hook(
            _check_module))
        _HANDLES.append(nn.modules.module.register_module_parameter_registration_hook(
            _check_parameter))
