"""copy.deepcopy and pickling of the user's module: plain modules with the current weights.

Note [Copies of the user's module]
An EMA or teacher model starts as `copy.deepcopy(model)` (timm's ModelEmaV2) or
`copy.deepcopy(model.module)`, and `torch.save(model.module, path)` pickles the whole module.
Both go through `__getstate__`, and the user's modules would hand over their parameters' empty
placeholders and the engine's hooks (a copy of empty weights whose forward calls into this
engine; pickling failed on the hooks). Each module that owns parameters gets an instance-level
`__getstate__` (instance attributes shadow the class's for deepcopy and pickle alike) that
returns its state with:
  * each chunked parameter replaced by a Parameter over its current value (`read_parameter`:
    the compute dtype, gathered under data parallelism, so every rank copies; on the engine's
    device, beside the module's buffers), the same new
    Parameter for every module that shares it within one copy (a weak cache by index that lives
    as long as the copy operation holds it), so tied weights stay tied in the copy;
  * the engine's hooks and registrations left out, and no `__getstate__` of its own, nor the
    methods the engine shadows on it (Note [Methods of the user's modules]);
  * built on the class's own `__getstate__` (but a parametrized class's, which refuses),
    which the instance attribute shadows: nn.RNN, LSTM and GRU drop there the weak references
    to their weights (`_flat_weight_refs`), which cannot be pickled, so `torch.save(
    model.module, f)` of word_language_model's RNNModel failed with "cannot pickle
    'weakref.ReferenceType' object". Their `_flat_weights`, a list of the same Parameter
    objects as `_parameters`, get the same new Parameters.
A module with a torch.nn.utils.parametrize parametrization (a LoRA delta in model_func) has a
class of torch's making with a `__deepcopy__` that copies `__dict__` as it is, so its own
parameters (the bias beside the parametrized weight) stayed placeholders in the copy; such a
module gets an instance-level `__deepcopy__` too, which does what torch's does with the state
above. The copy is therefore an ordinary PyTorch module, independent of the engine. The engine itself
deep-copies to such a copy of its module (two engines would need two chunk runtimes) and refuses
to be pickled, naming what to save instead.
"""
from __future__ import annotations

import copy
import functools
import weakref

from torch import nn
from torch.nn.utils import parametrize

from .module_methods import Shadow

__all__ = ["ModuleCopies"]

_OWN_ATTRIBUTES = ("__getstate__", "__deepcopy__", "_patrickstar_external_parameters")


class ModuleCopies:
    def __init__(self, modules, engine, hook_ids):
        """`hook_ids()` are the ids of the engine's hooks (RemovableHandle ids, unique across
        modules), left out of copies; `engine` is held weakly (Note [Engine lifetime])."""
        self._engine = weakref.ref(engine)
        self._hook_ids = hook_ids
        self._materialized: "weakref.WeakValueDictionary[int, nn.Parameter]" = \
            weakref.WeakValueDictionary()
        for module in modules:
            module.__dict__["__getstate__"] = functools.partial(self._state_of, module)
            if parametrize.is_parametrized(module):
                module.__dict__["__deepcopy__"] = functools.partial(self._deepcopy_of, module)

    def _deepcopy_of(self, module: nn.Module, memo: dict) -> nn.Module:
        """torch's `__deepcopy__` of parametrized classes (parametrize.py), over the state
        `_state_of` gives rather than `module.__dict__`."""
        replica = memo.get(id(module))
        if replica is None:
            replica = module.__class__.__new__(module.__class__)
            memo[id(module)] = replica
            replica.__dict__ = copy.deepcopy(self._state_of(module), memo)
        return replica

    def _state_of(self, module: nn.Module) -> dict:
        engine = self._engine()
        if engine is None:
            raise RuntimeError(f"copying or pickling a {type(module).__name__} whose PatrickStar "
                               "engine is gone: its parameters lived in the engine's chunks, "
                               "which were freed with it")
        # A parametrized class's own __getstate__ refuses pickling; its deepcopy is ours. A
        # state that is not a dict has no `_parameters` to give values to: the module's own.
        base = (module.__dict__ if parametrize.is_parametrized(module)
                else type(module).__getstate__(module))
        if not isinstance(base, dict) or "_parameters" not in base:
            base = module.__dict__
        state = {key: value for key, value in base.items()
                 if key not in _OWN_ATTRIBUTES and not isinstance(value, Shadow)}
        ours = set(self._hook_ids())
        for key, value in state.items():
            if "hooks" in key and isinstance(value, dict) and ours & set(value):
                copy = type(value)()
                copy.update((k, v) for k, v in value.items() if k not in ours)
                state[key] = copy
        parameters = dict(state["_parameters"])
        replaced = {}
        for name, param in parameters.items():
            index = None if param is None else engine.params.index_of(param)
            if index is not None:
                parameters[name] = replaced[id(param)] = self._materialize(engine, index, param)
        state["_parameters"] = parameters
        for key, value in state.items():  # RNNBase's _flat_weights
            if type(value) in (list, tuple) and any(id(v) in replaced for v in value):
                state[key] = type(value)(replaced.get(id(v), v) for v in value)
        return state

    def _materialize(self, engine, index: int, param: nn.Parameter) -> nn.Parameter:
        copy = self._materialized.get(index)
        if copy is None:
            # On the engine's device, where the module's buffers are, as a deepcopy of a CUDA
            # model is a CUDA model. A read of user code (by_user): under data parallelism the
            # ranks agree on it first, so `if rank == 0: torch.save(model.module, f)` is served
            # by the other ranks at their next call (Note [Parameter reads agree] in
            # data_parallel.py); without the agreement rank 0's gather met the others' next
            # forward and both waited for ever.
            copy = nn.Parameter(
                engine.read_parameter(index, "copying or pickling model.module",
                                      by_user=True).to(engine.device),
                requires_grad=param.requires_grad)
            self._materialized[index] = copy
        return copy
