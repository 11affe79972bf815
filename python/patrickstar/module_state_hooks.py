"""The state_dict() / load_state_dict() of the user's own module and its submodules.

Note [The user's module's state dict]
Between uses an engine's parameters hold empty placeholders (Note [Parameter data swapping]),
so the user's module, reached as `model.module` or through the engine's attribute forwarding,
would save empty tensors: `model.module.state_dict()` as a DDP user writes it, and Hugging
Face's `model.save_pretrained(dir)`, which wrote a checkpoint of zero-size weights without a
word. Loading into it failed with size mismatches against the placeholders. Hooks on every
module that owns parameters fix both:
  * its state_dict carries each parameter's real value, read out of the chunks (the compute
    dtype, as `model.state_dict()`; under data parallelism the groups are gathered first, a
    collective, so every rank calls it, as with `model.state_dict()`). With keep_vars=True the
    entries stay the Parameter objects (the engine's own state_dict builds on that).
  * under data parallelism an outermost state_dict() call on any module of the engine (prefix
    "", keep_vars False: `model.module.state_dict()`, `save_pretrained`, a submodule's) first
    checks that every rank makes it (Note [Every rank runs the same forwards] in
    data_parallel.py): a rank saving alone raised only at the collective timeout. Calls
    nested under it have a prefix; keep_vars=True reads nothing, so needs no agreement.
  * its load_state_dict writes each parameter present into the chunks (the engine's
    `load_parameter`: compute copy, master, compensation zeroed) and hands torch an empty
    tensor in its place, so torch's copy into the placeholder is a no-op and its missing- and
    unexpected-key accounting is unchanged (that copy bumps the parameter's version counter,
    which a post-hook then forgets: Note [Writes to a released parameter]). A shape that
    differs from the real one is reported in torch's own words with the real shape;
    `assign=True` cannot replace a chunked parameter and says so. Under data parallelism an
    outermost load (prefix "") first checks that every rank makes it, as the engine's own
    load does (Note [Writes on one rank are refused] in data_parallel.py): each rank writes
    its own shards only, and rank 0 loading alone left the other ranks' shards as they were.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from . import resting_params
from .hooks import HookSet
from .parameter_values import checked_value

__all__ = ["ModuleStateHooks"]


class ModuleStateHooks(HookSet):
    def __init__(self, modules, engine, tree):
        """Hooks `modules` (those owning parameters) of `engine`, held weakly (Note [Engine
        lifetime]): the engine's `params`, `read_parameter(index)` and
        `load_parameter(index, tensor)` do the work; every module of `tree` (the user's
        module) gets the call agreement (`engine.agree_on_state_dict_read()`)."""
        super().__init__()
        self._engine = weakref.ref(engine)
        # Note [Tied weights share one tensor in the state dict]: parameter index -> (id of
        # the state dict, key, weak reference to the tensor read for it).
        self._reads: dict[int, tuple] = {}
        # Keys refused under assign=True, taken out of the state dict so torch does not put a
        # new Parameter in the engine's place; the post-hook takes them out of the missing keys
        # torch then counts (they were given, only not assignable).
        self._refused_assign: set[str] = set()
        # Partials, not bound methods: torch marks its hooks with an attribute.
        before_state_dict = functools.partial(ModuleStateHooks._before_state_dict, self)
        for module in tree.modules():
            self._handles.append(module.register_state_dict_pre_hook(before_state_dict))
        after_state_dict = functools.partial(ModuleStateHooks._after_state_dict, self)
        self._before_load = functools.partial(ModuleStateHooks._before_load_state_dict, self)
        after_load = functools.partial(ModuleStateHooks._after_load_state_dict, self)
        # module -> the handle of its _before_load (Note [The chunk writes run after the user's
        # load pre-hooks])
        self._load_handles = {}
        for module in modules:
            handle = module.register_state_dict_post_hook(after_state_dict)
            # Note [The values are read before the user's state-dict post-hooks]
            handle.hooks_dict_ref().move_to_end(handle.id, last=False)
            self._handles.append(handle)
            self._register_before_load(module)
            handle = module.register_load_state_dict_post_hook(after_load)
            # Note [The values are read before the user's state-dict post-hooks]
            handle.hooks_dict_ref().move_to_end(handle.id, last=False)
            self._handles.append(handle)
        last = functools.partial(ModuleStateHooks._load_hooks_last, self)
        for module in tree.modules():
            self._handles.append(module.register_load_state_dict_pre_hook(last))

    def _register_before_load(self, module) -> None:
        handle = module.register_load_state_dict_pre_hook(self._before_load)
        self._handles.append(handle)
        self._load_handles[module] = handle

    # Note [The values are read before the user's state-dict post-hooks]
    # torch runs a module's state_dict post-hooks in the order they were registered, and a hook
    # the model registered while it was built (inside model_func: one that casts, renames or
    # counts the saved values) came before the one here, which puts each parameter's value read
    # out of the chunks in place of the placeholder torch saved: it saw empty placeholders, and
    # what it wrote for a parameter was then overwritten by the read. The one here goes first,
    # so every user hook sees the values, as on the plain model. Likewise the load post-hook
    # here (which puts the parameters back at rest) goes first, so a user's load post-hook
    # reads the loaded values rather than placeholders (Note [The engine's load_state_dict is
    # torch's, all or nothing] in parameter_values.py serves those held for the chunks).

    # Note [The chunk writes run after the user's load pre-hooks]
    # torch runs a module's load_state_dict pre-hooks in the order they were registered, and the
    # one here (which takes each parameter's value out of the state dict into the chunks) was
    # registered at initialize(): a hook the user registered after it, renaming an older
    # checkpoint's key to the parameter's ("head.kernel" -> "head.weight"), ran too late, and
    # torch copied the renamed value into the placeholder ("size mismatch ... the shape in
    # current model is torch.Size([0])"), where on the plain model it loads. At the start of a
    # load (the module load_state_dict was called on: prefix "") this hook is registered anew
    # on every module below it, so it comes after every hook there, as torch's copy does. (The
    # module the load starts at is already running its hooks, so a hook registered later on
    # that module itself still runs after the chunk writes.)
    def _load_hooks_last(self, module, state_dict, prefix, *args) -> None:
        if prefix:
            return
        self._live_engine().agree_on_module_load()
        for below in module.modules():
            handle = self._load_handles.get(below)
            if below is module or handle is None:
                continue
            self._handles.remove(handle)
            handle.remove()
            self._register_before_load(below)

    def _live_engine(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("state_dict()/load_state_dict() of a module whose PatrickStar "
                               "engine is gone: its parameters lived in the engine's chunks, "
                               "which were freed with it")
        return engine

    def _chunked(self, engine, module: nn.Module, prefix: str):
        for name, param in module.named_parameters(recurse=False):
            index = engine.params.index_of(param)
            if index is not None:
                yield prefix + name, param, index

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        if prefix == "" and not keep_vars:
            self._live_engine().agree_on_state_dict_read()
        self._wake_own(module)

    # Note [Parameters at rest] in resting_params.py: torch's own save and load of a module
    # look at its parameters' data (a detach, a shape check, a copy into the placeholder) and
    # the hooks here put the real values in; so the module's own parameters are plain while
    # torch does that, and rest again after.
    def _wake_own(self, module) -> None:
        engine = self._engine()
        if engine is not None and engine.parameters_at_rest:
            resting_params.wake(module.parameters(recurse=False))

    def _rest_own(self, engine, module) -> None:
        if engine.parameters_at_rest:
            resting_params.rest(param for param in module.parameters(recurse=False)
                                if engine.params.index_of(param) is not None)

    # Note [Tied weights share one tensor in the state dict]
    # torch's state dict holds a tied parameter (GPT-2's wte.weight and lm_head.weight) under
    # each of its names as one storage, so torch.save writes it once. Reading it out of the
    # chunks under each name made two copies: a file larger by the whole embedding, and twice
    # its memory when loaded. The first read of a parameter within one state_dict() call (the
    # post-hooks of one call fill the same dict) is kept here, weakly, and a later name of the
    # same parameter in that dict takes the same tensor; a dict of another call (even at a
    # reused id) does not hold that tensor under that key, so it reads again.
    #
    # Note [A state dict read inside a forward]
    # Inside a module's forward (a forward pre-hook dumping the weights, as a debugging hook
    # does) that module's parameters hold their chunk views, in COMPUTE. Reading them out of
    # the chunks accessed them a second time and released them to HOLD, so the module's end
    # of forward failed with "illegal state transition HOLD -> HOLD_AFTER_FWD". torch's own
    # state dict already holds their values there (param.detach(), the live view): a copy of
    # it is the value, and the forward's access is left alone.
    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        engine = self._live_engine()
        self._rest_own(engine, module)
        for key, param, index in self._chunked(engine, module, prefix):
            if key in state_dict and state_dict[key] is not param:  # not keep_vars
                value = self._read_in_this_call(state_dict, index)
                if value is None and not engine.guard.destroyed and \
                        engine.parameter_in_use(index):
                    # Note [A state dict read inside a forward]: the parameter holds its chunk
                    # view now; a copy of what torch put there, not a second access.
                    value = state_dict[key].detach().clone()
                    self._reads[index] = (id(state_dict), key, weakref.ref(value))
                if value is None:
                    value = engine.read_parameter(index)
                    self._reads[index] = (id(state_dict), key, weakref.ref(value))
                state_dict[key] = value

    def _read_in_this_call(self, state_dict, index: int):
        dict_id, key, value = self._reads.get(index, (None, None, lambda: None))
        value = value()
        if dict_id == id(state_dict) and value is not None and state_dict.get(key) is value:
            return value
        return None

    def _before_load_state_dict(self, module, state_dict, prefix, local_metadata, strict,
                                missing_keys, unexpected_keys, error_msgs) -> None:
        engine = self._live_engine()
        self._wake_own(module)
        for key, param, index in self._chunked(engine, module, prefix):
            if key not in state_dict:
                continue
            source = state_dict[key]
            shape = tuple(engine.params.shapes[index])
            if local_metadata.get("assign_to_params_buffers", False):
                error_msgs.append(f"load_state_dict(assign=True) cannot replace '{key}': its "
                                  f"data lives in PatrickStar chunks; load without assign")
                del state_dict[key]  # torch would put a new Parameter in the engine's place
                self._refused_assign.add(key)
                continue
            # Note [A state dict's values, checked as torch checks them] in parameter_values.py
            source, error = checked_value(key, source, shape)
            if error is not None:
                error_msgs.append(error)
            else:
                engine.load_parameter(index, source)
            state_dict[key] = torch.empty(0, dtype=param.dtype)

    def _after_load_state_dict(self, module, incompatible_keys) -> None:
        if self._refused_assign:
            incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys
                                                 if key not in self._refused_assign]
            self._refused_assign.clear()
        engine = self._live_engine()
        engine.after_module_load([index for _, _, index in self._chunked(engine, module, "")])
        self._rest_own(engine, module)
