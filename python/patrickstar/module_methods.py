"""Hugging Face's and nanoGPT's methods that read, tie or rebuild parameters, on the user's
modules after initialize().

Note [Methods of the user's modules]
Between uses an engine's parameters hold empty placeholders (Note [Parameter data swapping] in
engine.py), so a few well-known methods of the user's modules did the wrong thing when called
after initialize():
  * shape readers (`num_parameters`, `get_memory_footprint`, `floating_point_ops`; nanoGPT's
    `get_num_params`, `estimate_mfu`) sum `p.numel()`: 0, without a word;
  * `tie_weights` (a no-op on a model whose ties are in place, which scripts call after
    building or loading) re-pads a masked-LM head's output bias, `bias.data =
    pad(bias.data, ...)` (BERT, RoBERTa, DistilBERT): a new tensor assigned to a placeholder,
    which the next forward took for a lost write and raised on;
  * rebuilders (`resize_token_embeddings`, `init_weights`, nanoGPT's `crop_block_size`, ...)
    replace parameters the chunks hold, or write into placeholders;
  * `nn.Module.apply(fn)` of `model.module` or a submodule (re-initializing a new head:
    `model.module.head.apply(init)`) ran `fn` on placeholders, so `nn.init` refused to write
    into them and pointed at `model.apply(fn)`, which lends the values.
The engine used to fix these only for calls through it (`model.num_parameters()`), while
`model.module.num_parameters()` (DeepSpeed users' spelling) and a submodule's
(`model.module.bert.num_parameters()`) still counted placeholders. `ModuleMethods` gives every
module of the tree whose class has such a method an instance attribute of that name (instance
attributes shadow class functions), so the engine, `model.module` and any submodule answer
alike: shape readers run while the parameters hold stand-ins of their real shapes
(`engine.real_shapes()`), `tie_weights` runs with the parameters lent their values
(`summon_full_params`, so an equal re-padded bias is no change), `apply` is the engine's
`model.apply(fn)` over that module's subtree (every module has it), and rebuilders raise, naming
model_func. A tie that would put another Parameter in a module (the config asks for ties the
model was not built with) is undone and refused: which parameters exist and are shared is
fixed when initialize() lays out the chunks.
A module whose class overrides `train()` outside torch and transformers gets one too (Note [A
module's own train()]).
The attributes hold the engine weakly (Note [Engine lifetime] in engine.py) and copies leave
them out (they are `Shadow`s: Note [Copies of the user's module] in module_copies.py), so a
deepcopy or pickle of the module is a plain module with its class's methods again.

Note [A module's own train()]
`model.eval()` / `model.train()` (the engine's, `model.module`'s, the Trainer's each step) call
`train(mode)` on every module. Hand-written modules may change weights there: loralib's `Linear`
(the reference LoRA implementation, `merge_weights=True` by default) adds `lora_B @ lora_A *
scaling` into its frozen `weight.data` on `eval()` and takes it out again on `train()`. Between
uses that weight is a placeholder, so the in-place add was refused and `model.eval()` raised. A
module whose class overrides `train` (other than torch's and transformers' own overrides, which
re-apply kernels or drop a cache and touch no parameter) gets an instance `train` that runs the
class's under `engine.call_lent`: the parameters of its subtree are lent their values on first
touch and what it changes goes back into the chunks (master and compute copies), as
`model.apply(fn)` does. A `train` called inside another's (`super().train(mode)` recursing into
a child's override) runs as it is: the outer call already lends that subtree, and a second
lending would read the chunks' values under the outer's pending change. With the engine gone or
destroyed, the class's `train` runs as it is (setting `training` needs no parameter; a write
into a freed weight raises as before). Each lending wakes and rests every parameter of the
engine, so a `model.train()` over a LoRA model (one override per adapted Linear) cost that many
passes over the parameters (87 ms for 96 adapters); the root module's `train` is therefore
shadowed too and keeps the parameters awake for the whole traversal
(`engine.awake_parameters()`).
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

from torch import nn

__all__ = ["ModuleMethods", "Shadow"]

READS_PARAMETER_SHAPES = frozenset({"num_parameters", "get_memory_footprint",
                                    "floating_point_ops", "get_num_params", "estimate_mfu"})
TIES_PARAMETERS = frozenset({"tie_weights"})
REBUILDS_PARAMETERS = frozenset({"resize_token_embeddings", "resize_position_embeddings",
                                 "prune_heads", "init_weights", "post_init", "crop_block_size"})
APPLIES = frozenset({"apply"})
NAMES = READS_PARAMETER_SHAPES | TIES_PARAMETERS | REBUILDS_PARAMETERS | APPLIES
# Packages whose train() overrides touch no parameter (Note [A module's own train()]).
TRAIN_WITHOUT_WRITES = ("torch.", "transformers.", "patrickstar.")


def overrides_train(cls: type) -> bool:
    """Whether `cls.train` is an override that may change weights (Note [A module's own
    train()])."""
    owner = next(c for c in cls.__mro__ if "train" in vars(c))
    return owner is not nn.Module and not f"{owner.__module__}.".startswith(TRAIN_WITHOUT_WRITES)


class Shadow(functools.partial):
    """A method shadowed on a module instance; copies of the module leave these out."""


def refuse_rebuild(module_type: str, name: str) -> Callable:
    if name.startswith("resize_"):
        instead = ("call it inside model_func, on the module it builds (with a copy of the "
                   "config made there: the resize updates the config, and model_func runs "
                   "twice), or build the model with the new size: set it in the config that "
                   "model_func builds from (e.g. config.vocab_size = n), and load trained "
                   "weights after initialize() with load_state_dict")
    else:
        instead = "call it inside model_func, on the module it builds"

    def refuse(*args, **kwargs):
        raise ValueError(f"model.{name}() changes the parameters of {module_type}, which live "
                         f"in PatrickStar chunks since initialize(): {instead}")
    return refuse


class ModuleMethods:
    def __init__(self, root: nn.Module, engine):
        """Shadows the methods in NAMES on every module under `root` whose class has them;
        `modules` lists those modules (their copies must leave the attributes out)."""
        self._engine = weakref.ref(engine)
        self._reading_shapes = False
        self._training = False  # inside a lent train() (Note [A module's own train()])
        self.modules: list[nn.Module] = []
        for module in root.modules():
            names = [name for name in NAMES if callable(getattr(type(module), name, None))]
            for name in names:
                method = getattr(type(module), name).__get__(module)
                module.__dict__[name] = self._wrap(module, name, method)
            if overrides_train(type(module)):  # held weakly, as apply
                module.__dict__["train"] = Shadow(self._train, weakref.ref(module))
                names.append("train")
            if names:
                self.modules.append(module)
        if "train" not in vars(root) and any("train" in vars(m) for m in self.modules):
            root.__dict__["train"] = Shadow(self._train_awake, weakref.ref(root))
            if root not in self.modules:
                self.modules.append(root)

    def _wrap(self, module: nn.Module, name: str, method: Callable) -> Shadow:
        if name in REBUILDS_PARAMETERS:
            return Shadow(refuse_rebuild(type(module).__name__, name))
        if name in TIES_PARAMETERS:
            return Shadow(self._tie, module, name, method)
        if name in APPLIES:  # every module has one: held weakly, so no module is in a cycle
            return Shadow(self._apply, weakref.ref(module))
        return Shadow(self._read_shapes, method)

    def _live_engine(self, name: str):
        engine = self._engine()
        if engine is None:
            raise RuntimeError(f"{name}() on a module whose PatrickStar engine is gone: its "
                               "parameters lived in the engine's chunks, which were freed "
                               "with it")
        return engine

    def _read_shapes(self, method: Callable, *args, **kwargs):
        # One reader calls another (floating_point_ops calls num_parameters): the inner one
        # must not put the placeholders back under the outer one.
        if self._reading_shapes:
            return method(*args, **kwargs)
        self._reading_shapes = True
        try:
            with self._live_engine(method.__name__).real_shapes():
                return method(*args, **kwargs)
        finally:
            self._reading_shapes = False

    def _apply(self, module: weakref.ref, fn: Callable[[nn.Module], None]) -> nn.Module:
        module = module()
        self._live_engine("apply").apply_to(module, fn)
        return module

    def _train(self, module: weakref.ref, mode: bool = True):
        module = module()
        train = type(module).train
        engine = self._engine()
        if self._training or engine is None or engine.guard.destroyed:
            return train(module, mode)
        self._training = True
        try:
            return engine.call_lent(module, lambda m: train(m, mode),
                                    f"{type(module).__name__}.train()")
        finally:
            self._training = False

    def _train_awake(self, module: weakref.ref, mode: bool = True):
        module = module()
        engine = self._engine()
        if self._training or engine is None or engine.guard.destroyed:
            return type(module).train(module, mode)
        with engine.awake_parameters():
            return type(module).train(module, mode)

    def _tie(self, module: nn.Module, name: str, method: Callable, *args, **kwargs):
        engine = self._live_engine(name)
        before = _parameter_slots(module)
        with engine.summon_full_params(writeback=True):
            result = method(*args, **kwargs)
            replaced = [key for key, param in _parameter_slots(module).items()
                        if before.get(key) is not param]
            for owner, attribute in replaced:  # undone before the lent values go back
                if (owner, attribute) in before:
                    owner._parameters[attribute] = before[(owner, attribute)]
                else:
                    del owner._parameters[attribute]
        if replaced:
            prefixes = {id(m): f"{n}." if n else ""
                        for n, m in module.named_modules(remove_duplicate=False)}
            listed = ", ".join(f"'{prefixes[id(owner)]}{attribute}'"
                               for owner, attribute in replaced)
            raise ValueError(
                f"{name}() would replace {listed} with another parameter (ties the model was "
                "not built with, e.g. config.tie_word_embeddings changed after initialize()): "
                "the parameters and their ties are laid out in PatrickStar chunks when "
                "initialize() builds the model, so the model is left as it was. Set the "
                "config before the model is built, inside model_func")
        return result


def _parameter_slots(root: nn.Module) -> dict[tuple[nn.Module, str], nn.Parameter]:
    """(module, attribute) -> the Parameter there, for every module under `root`."""
    return {(module, attribute): param
            for module in root.modules(remove_duplicate=False)
            for attribute, param in module._parameters.items() if param is not None}
