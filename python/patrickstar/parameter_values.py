"""The values of the engine's parameters read out of their chunks and written into them: what
`state_dict()`, `load_state_dict()` and every caller reading or loading whole weights (the
module's own state dict hooks, `model.apply`, deepcopy, parameters_to_vector) go through.

The engine owns the parameters and their chunks; a ParameterValues is handed the objects it
reads and writes through (the guard, the chunked parameters, the data-parallel side, the
parameter slots) and owns only the rules of a load: torch's errors before anything
is written, and which chunk kinds new weights replace (Note [Loading the weights the model
has]).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _C
from .param_owners import engine_of

__all__ = ["ParameterValues"]

K = _C.ChunkKind


# Note [A state dict's values, checked as torch checks them]
# torch's `_load_from_state_dict` names a value that is not a tensor ("While copying the
# parameter named ..., expected torch.Tensor or Tensor-like object from checkpoint but received
# <class 'NoneType'>"), and loads a one-element 1-dim tensor into a 0-dim parameter (its
# "backward compatibility" with checkpoints of torch 0.3). The engine's own loads (its
# load_state_dict and the hooks of the module's) check values here, in torch's words: a None
# was taken for a missing key and then failed with "'NoneType' object has no attribute
# 'dtype'", a list was "a param with shape None", and a 0-dim scale saved as shape (1,) loaded
# in PyTorch but was a size mismatch here.
def checked_value(key: str, source, shape: tuple) -> tuple[torch.Tensor | None, str | None]:
    """(the value to load for parameter `key` of `shape`, None) or (None, torch's error)."""
    if not torch.overrides.is_tensor_like(source):
        return None, (f'While copying the parameter named "{key}", expected torch.Tensor or '
                      f'Tensor-like object from checkpoint but received {type(source)}')
    owner = engine_of(source)
    if owner is not None:  # Note [keep_vars gives the parameters themselves] in engine.py
        # An engine's parameter holds a placeholder: read its value before any chunk of the
        # load is opened (the same chunk, when an engine loads its own parameters).
        source = owner.read_parameter(owner.params.index_of(source), "load_state_dict()")
    if len(shape) == 0 and tuple(source.shape) == (1,):
        source = source[0]
    if tuple(source.shape) != tuple(shape):
        return None, (f"size mismatch for {key}: copying a param with shape {source.shape} "
                      f"from checkpoint, the shape in current model is {torch.Size(shape)}.")
    return source, None


def _saved_by_ddp(module: nn.Module, state_dict) -> bool:
    """Whether `state_dict` is `module`'s under DDP's 'module.' prefix (and not its own)."""
    keys = list(state_dict.keys()) if hasattr(state_dict, "keys") else []
    if not keys or not all(isinstance(k, str) and k.startswith("module.") for k in keys):
        return False
    # Names only: a state_dict() here would read (under data parallelism, gather) the values.
    own = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
    return not own & set(keys) and {k[len("module."):] for k in keys} <= own


class ParameterValues:
    def __init__(self, guard, params, dp, slots, compute_dtype: torch.dtype):
        self._guard = guard
        self._params = params
        self._dp = dp
        self._slots = slots
        self._compute_dtype = compute_dtype
        # Parameter index -> value, while the engine's load_state_dict runs (Note [The engine's
        # load_state_dict is torch's, all or nothing]); None otherwise.
        self._held: dict[int, torch.Tensor] | None = None

    def read(self, index: int, what: str = "state_dict()",
             agree_as: int | None = None) -> torch.Tensor:
        """Parameter `index` in the compute dtype (a collective under data parallelism); `what`
        is the call an error names; `agree_as`: DataParallel.gather_all's."""
        self._guard.check_alive(what)
        if self._held is not None and index in self._held:  # read by a user's load post-hook
            return self._held[index].detach().to(self._compute_dtype).clone()
        with self._guard.calling(what):  # Note [Reads are calls too] in guards.py
            self._slots.check_unchanged([index])  # Note [Writes to a released parameter]
            self._gather_for_state_dict(agree_as)
            return self._params.read(index, K.COMPUTE_PARAM)

    def _gather_for_state_dict(self, agree_as: int | None = None) -> None:
        try:
            self._dp.gather_all(agree_as)  # a collective: every rank calls state_dict()
        except _C.ChunkRuntimeError as error:
            error.add_note("state_dict() under data parallelism gathers every rank's shards: "
                           "the other ranks serve a read on one rank at their next call (a "
                           "forward, a state-dict read, a torch.distributed collective, their "
                           "engine's end), and a rank whose engine has ended serves for "
                           "END_WAIT_S seconds only: after a late save on one rank call "
                           "torch.distributed.barrier() on every rank, or call "
                           "model.save_checkpoint(dir) on every rank, which writes each rank's "
                           "shards")
            raise

    # Note [The engine's load_state_dict is torch's, all or nothing]
    # `model.load_state_dict(sd)` checked and copied the values itself, key by key against the
    # module's own state dict. That skipped what torch's load runs on the way: the modules'
    # load_state_dict pre- and post-hooks (key renames for older checkpoints, as Hugging Face
    # registers; a user's) and `_load_from_state_dict` overrides (BatchNorm fills in a
    # `num_batches_tracked` missing from a checkpoint without version metadata), so a state dict
    # torch loads was refused ("Missing key(s)") or loaded otherwise. It is now torch's own
    # `module.load_state_dict`, whose hooks (module_state_hooks.py) write the parameters into
    # the chunks, as for `model.module.load_state_dict`. What it keeps of its own: nothing of a
    # load that fails reaches the chunks (torch would have copied the parameters before the
    # error; the writes are held here until torch returns, and a read of such a parameter
    # meanwhile, by a user's load post-hook, gives the held value), and a strict load refused for
    # its keys names strict=False. Buffers are torch's copies, as in torch.
    def load_state_dict(self, module: nn.Module, state_dict, strict: bool):
        """`module.load_state_dict(state_dict, strict)` by torch, the parameters' writes held
        until it succeeds (Note [The engine's load_state_dict is torch's, all or nothing])."""
        self._guard.check_alive("load_state_dict()")
        with self._guard.calling("load_state_dict()"):  # Note [Reads are calls too]
            # Note [Writes on one rank are refused] in data_parallel.py
            self._dp.agree_on_training_call(self._dp.MODEL_LOAD)
            return self._load_state_dict(module, state_dict, strict)

    def agree_on_module_load(self) -> None:
        """A load_state_dict of the user's module or a submodule starts (`model.module.
        load_state_dict`, Hugging Face's and PEFT's loads): every rank makes it (Note [Writes on
        one rank are refused] in data_parallel.py), unless the engine's own load, which agreed
        already, runs it."""
        if self._held is None:
            self._dp.agree_on_training_call(self._dp.MODEL_LOAD)

    def _load_state_dict(self, module: nn.Module, state_dict, strict: bool):
        self._held = {}
        try:
            result = module.load_state_dict(state_dict, strict)
        except RuntimeError as error:
            if strict and ("Missing key(s)" in str(error) or "Unexpected key(s)" in str(error)):
                if _saved_by_ddp(module, state_dict):
                    error.add_note(
                        "every key starts with 'module.': the state dict of a model wrapped in "
                        "torch's DistributedDataParallel (ddp_model.state_dict(), as PyTorch's "
                        "DDP tutorial saves it), whose keys are its module's under 'module.'; "
                        "the engine's are its module's own. Strip the prefix first: "
                        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present("
                        "state_dict, 'module.')")
                else:
                    error.add_note("load_state_dict(state_dict, strict=False) loads the keys "
                                   "the model has, as upstream PatrickStar's default did")
            raise
        finally:
            held, self._held = self._held, None
        try:
            for index, source in held.items():
                self.load(index, source)
        finally:
            self._dp.parameters_changed()  # gathered copies of what the owners loaded are stale
        return result

    def load(self, index: int, source: torch.Tensor) -> None:
        """New weights for parameter `index` (its shape, any float dtype)."""
        self._guard.check_alive("load_state_dict()")
        if self._held is not None:  # inside the engine's load_state_dict: written once it succeeds
            self._held[index] = source
            return
        with torch.no_grad(), self._guard.calling("load_state_dict()"):
            # Note [Loading the weights the model has]
            kinds = (K.COMPUTE_PARAM,) if self._holds_already(index, source) else (
                K.COMPUTE_PARAM, K.MASTER_PARAM, K.PARAM_COMPENSATION)
            for kind in kinds:
                if not self._dp.keeps(self._params, index, kind):
                    continue  # none of that kind, or data parallel: the owner loads it
                # New weights carry no rounding error of earlier updates.
                self._params.write(index, kind, torch.zeros_like(source)
                                   if kind == K.PARAM_COMPENSATION else source)

    # Note [Loading the weights the model has]
    # In fp16/bf16 the optimizer keeps a finer copy of each weight than the 16-bit value
    # `state_dict()` gives: the fp32 master, or the Kahan compensation without one. Loading
    # 16-bit weights writes the master from them and zeroes the compensation, as new weights
    # carry no rounding error of earlier updates. But 16-bit weights that are exactly the
    # ones the model holds (the master rounds to them; without a master, the parameter is
    # them) are not new: `model.load_state_dict(model.state_dict())` is a no-op in torch, and
    # the resume idiom may load the optimizer's state dict, which restores the master and
    # compensation (Note [Master weights in the optimizer's state dict] in optimizer.py),
    # before the model's. So such weights leave both as they are; other values, or weights
    # of another dtype (an fp32 state dict into a bf16 engine), replace them. Without a master
    # the optimizer's load writes the bf16 weights its compensations belong to as well (Note
    # [The weights a compensation belongs to] in optimizer.py), so that order keeps them too.
    def _holds_already(self, index: int, source: torch.Tensor) -> bool:
        if source.dtype != self._compute_dtype or self._compute_dtype == torch.float32:
            return False
        for kind in (K.MASTER_PARAM, K.COMPUTE_PARAM):  # the finer copy where there is one
            if self._params.tensor_id(index, kind) is not None:
                if not self._dp.keeps(self._params, index, kind):
                    return False  # data parallel: the owner decides for what it loads
                held = self._params.read(index, kind).to(self._compute_dtype)
                return torch.equal(held, source.reshape(held.shape))
        return False
