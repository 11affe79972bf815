"""The optimizer users get back from `patrickstar.initialize()`.

It is a `torch.optim.Optimizer` (so `torch.optim.lr_scheduler` schedulers drive it through
`param_groups[i]["lr"]`), but its state lives in chunks and `step()` runs the fused C++ Adam /
AdamW kernel tensor by tensor over chunk memory, with each tensor's group hyperparameters and
step count (parameters that got no gradient this step are skipped, as torch does). It owns the
sweep, the update and its state: the step counts, which parameters have a gradient this step,
and the optimizer state_dict.

Note [Optimizer sweep]
`optimizer.step()` updates parameters row by row, a row being the parameters whose optimizer
state shares a momentum chunk (so a row touches a handful of chunks: their params or masters,
gradients, momentum, variance). Each tensor is updated where its chunk already is whenever the
kernel can reach it there: on a CPU build every memory tier is host memory (the device tier is
emulated), so nothing moves; with CUDA a parameter whose chunks are all on the GPU is updated by
the GPU kernel there, anything else on the host. Chunks on NVMe stream through host memory: while
row k is updated, the NVMe chunks of row k+1 are already being read (`start_move`, Note [Started
moves] in chunk_manager_moves.cc) and those of row k-1 written back, so disk reads, Adam and disk
writes overlap, and the host holds about three rows of NVMe state at a time. A failed read or
write-back raises out of `step()` with the file, offset and bytes; the chunk keeps its bytes in
memory and its NVMe slot stays invalid (never read back torn), and the engine refuses to train on
until a checkpoint is loaded, since the rows before the failure were already updated.
"""
from __future__ import annotations

import collections.abc
import contextlib
import difflib
import math
import numbers
import sys
import weakref
from typing import Callable, ContextManager, Iterable

import torch
from torch.amp.grad_scaler import GradScaler

from . import _C, moment_state
from .state_edits import EditableEntry, StateEdits
from .chunked_params import ChunkedParams
from .loss_scaler import LossScaleAtMinimum
from .vocabulary import Tier as T

__all__ = ["PatrickStarOptimizer", "build_param_groups", "clip_coefficient"]

S = _C.TensorState

# Note [torch.amp.GradScaler over the chunked optimizer]
# A torch AMP loop, `scaler.scale(loss).backward(); scaler.unscale_(optimizer);
# clip_grad_norm_(model.parameters(), c); scaler.step(optimizer)`, cannot work here: the
# gradients live in chunks (no p.grad for the scaler to divide), and fp16's loss scale is the
# engine's own (config fp16.enabled). The error came only at scaler.step (which hands the
# scaler to step(), _step_supports_amp_scaling), after unscale_ had found no p.grad and returned
# as if it had unscaled, so the clip between them had already returned the still-scaled norm
# (790 where torch says 0.77) and clipped by it. unscale_ reaches the optimizer only through
# GradScaler._unscale_grads_, which reads `optimizer.param_groups` (its per-optimizer state is
# keyed by id(optimizer), which cannot be hooked), so param_groups is a property that raises the
# same error when that function is its reader: the first point the engine can see a scaler. A
# disabled scaler (GradScaler(enabled=False), nanoGPT's loop under bf16) returns from unscale_
# before reading anything, and every other reader (schedulers, torch.optim's own methods, ours)
# gets the list as before, stored where torch.optim's __setstate__ puts it (the instance dict).
_UNSCALES_GRADIENTS = GradScaler._unscale_grads_.__code__
_GRAD_SCALER_UNSUPPORTED = (
    "torch.amp.GradScaler cannot scale the PatrickStar optimizer's gradients (they live in "
    "chunks): drop the GradScaler (or make it GradScaler(enabled=False)). For fp16 training "
    "the config's fp16.enabled gives the dynamic loss scale, which model.backward(loss) and "
    "loss.backward() apply; with torch.autocast(dtype=torch.bfloat16) no scaler is needed")

_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay", "name", "param_names"}

# Note [torch.optim's own group keys]
# A torch optimizer's param_groups carry its constructor's options besides lr/betas/eps/
# weight_decay, so `param_groups=torch_optimizer.param_groups` (nanoGPT's configure_optimizers
# kept as it is, on the module before initialize()) listed them all as unknown. Some say only
# how torch runs its update (foreach, fused, capturable, differentiable: the same values), and
# are dropped; the variants amsgrad and maximize are taken when off and refused when on (ours
# does neither); decoupled_weight_decay (AdamW's True, Adam's False) must be the config's
# optimizer type, which is what decides it here.
# The groups (and defaults) of the optimizer show torch's keys with the values of what it does,
# as torch.optim.AdamW's / Adam's do: code reading `param_groups[0]["maximize"]` or
# `defaults["foreach"]` found no key, and a state dict lacked them. A step checks them as the
# groups are checked here, so `group["maximize"] = True` set during training raises rather than
# training without it.
_TORCH_HOW_KEYS = {"foreach", "fused", "capturable", "differentiable"}
_TORCH_OFF_KEYS = {"amsgrad", "maximize"}


def _torch_keys(decoupled_weight_decay: bool) -> dict:
    return {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None,
            "decoupled_weight_decay": decoupled_weight_decay}


def _without_torch_keys(index: int, group: dict, decoupled_weight_decay) -> dict:
    for key in _TORCH_OFF_KEYS & set(group):
        if group[key]:
            raise ValueError(f"param_groups[{index}][{key!r}] is {group[key]!r}: the PatrickStar "
                             f"optimizer has no {key} variant (give {key}=False or leave it out)")
    # With no weight decay Adam and AdamW make the same update, so a torch Adam's groups of
    # weight_decay 0 (its default) go with an AdamW config too.
    if "decoupled_weight_decay" in group and decoupled_weight_decay is not None and \
            bool(group["decoupled_weight_decay"]) != decoupled_weight_decay and \
            not (_is_number(group.get("weight_decay")) and float(group["weight_decay"]) == 0):
        kind = "AdamW" if decoupled_weight_decay else "Adam"
        raise ValueError(f"param_groups[{index}]['decoupled_weight_decay'] is "
                         f"{group['decoupled_weight_decay']!r} but config optimizer type is "
                         f"{kind!r}: set config 'optimizer': {{'type': "
                         f"{'Adam' if decoupled_weight_decay else 'AdamW'!r}}} to match the "
                         "torch optimizer the groups came from")
    dropped = _TORCH_HOW_KEYS | _TORCH_OFF_KEYS | {"decoupled_weight_decay"}
    return {k: v for k, v in group.items() if k not in dropped}


def _is_number(value) -> bool:
    """A real number, or a one-element real tensor: torch.optim.AdamW takes `lr=torch.tensor(
    1e-3)` (its docs: "lr (float, Tensor)"), and so did a group edited during training (the
    step converts each value to one float), but initialize() refused it in its groups and
    load_state_dict in a saved torch state dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_group_numbers(index: int, group: dict) -> None:
    """A group's hyperparameters are numbers (a string "1e-3" failed in the range check below
    with "'<' not supported between instances of 'str' and 'int'", a beta of 1.5 trained)."""
    for key in ("lr", "weight_decay", "eps"):
        if not _is_number(group[key]):
            raise TypeError(f"param_groups[{index}][{key!r}]: expected a number, got "
                            f"{type(group[key]).__name__} {group[key]!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and
            all(_is_number(beta) for beta in betas)):
        raise TypeError(f"param_groups[{index}]['betas']: expected two numbers, got {betas!r}")
    if not all(0 <= beta < 1 for beta in betas):
        raise ValueError(f"param_groups[{index}]['betas']: each must be in [0, 1), got "
                         f"{tuple(betas)}")


# Note [A group's own keys]
# torch.optim keeps any key of a group: timm's and MAE/BEiT's layer-wise lr decay put
# "lr_scale" (or "layer_id") in each group and set `g["lr"] = lr * g["lr_scale"]` at every
# step, and every torch scheduler adds "initial_lr" to the groups of the optimizer it drives,
# so nanoGPT's `param_groups=optimizer.param_groups` after a scheduler was made carries it.
# Such keys were refused as unknown. They are kept as torch keeps them (in the groups and the
# state dict, read by nothing here); only a key that looks like a misspelt hyperparameter
# ("weight_decy", "beta") is refused, since torch would train without it silently.
def _check_own_keys(index: int, group: dict) -> None:
    for key in set(group) - _GROUP_KEYS:
        close = difflib.get_close_matches(str(key), sorted(_GROUP_KEYS), n=1, cutoff=0.75)
        if close:
            raise ValueError(f"param_groups[{index}]: key {key!r} is not one the update reads; "
                             f"did you mean {close[0]!r}? (other keys are kept as torch keeps "
                             f"them, unread)")


# Note [Named parameters in the groups]
# torch.optim (2.6 on) given named parameters, `AdamW(model.named_parameters())` or groups of
# (name, parameter) pairs, keeps the names in each group as "param_names", and its state_dict
# saves them. Ours dropped the names, so groups and state dicts lacked the key, and a torch
# optimizer's own groups with it (`param_groups=torch_optimizer.param_groups`, Note
# [torch.optim's own group keys]) were refused as "unknown keys ['param_names']". The names
# are kept as torch keeps them: taken from the pairs when every parameter comes named, else
# from a "param_names" key, which must name each parameter of the group once.
def _param_names(index: int, group: dict, params: list) -> list[str] | None:
    named = [isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
             for item in params]
    if params and all(named):
        return [item[0] for item in params]
    if "param_names" not in group:
        return None
    names = group["param_names"]
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ValueError(f"param_groups[{index}]['param_names']: expected a list of names, got "
                         f"{type(names).__name__} {names!r}")
    names = list(names)
    if len(names) != len(params) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"param_groups[{index}]['param_names']: expected one name (a str) per "
                         f"parameter of the group ({len(params)}), got {names!r}")
    return names


def build_param_groups(module: torch.nn.Module, groups, optimizer) -> list[dict]:
    """Validates user param groups (torch's format: dicts with "params" and overrides) or, when
    `groups` is None, one group of every parameter, with `optimizer`'s (the config's
    OptimizerConfig) defaults filled in. Every parameter of `module` must be in exactly one
    group; frozen parameters may be left out."""
    defaults = optimizer.group_defaults
    decoupled_weight_decay = optimizer.decoupled_weight_decay
    all_params = list(module.parameters())
    ids = {id(p) for p in all_params}
    if groups is None:
        groups = [{"params": all_params}]
    if callable(groups):
        groups = groups(module)
    if isinstance(groups, torch.Tensor):
        groups = [groups]
    if isinstance(groups, dict) or not isinstance(groups, Iterable):
        raise ValueError("param_groups: expected a list of dicts like torch.optim's, "
                         f"got {type(groups).__name__}")
    groups = list(groups)
    if groups and not isinstance(groups[0], dict):  # torch.optim's: parameters, one group
        groups = [{"params": groups}]
    result, seen = [], set()
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"param_groups[{index}]: expected a dict with a 'params' key")
        group = _without_torch_keys(index, group, decoupled_weight_decay)
        _check_own_keys(index, group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = _param_names(index, group, params)
        # torch.optim's named parameters (`model.named_parameters()`): (name, parameter) pairs.
        params = [item[1] if isinstance(item, tuple) and len(item) == 2 and
                  isinstance(item[0], str) else item for item in params]
        for param in params:
            if id(param) not in ids:
                raise ValueError(f"param_groups[{index}]: a parameter of shape "
                                 f"{tuple(param.shape)} is not a parameter of the model")
            if id(param) in seen:
                raise ValueError(f"param_groups[{index}]: a parameter of shape "
                                 f"{tuple(param.shape)} appears in more than one group")
            seen.add(id(param))
        merged = dict(defaults)
        merged.update({k: v for k, v in group.items() if k != "params"})
        _check_group_numbers(index, merged)
        if merged["lr"] < 0 or merged["weight_decay"] < 0 or merged["eps"] < 0:
            raise ValueError(f"param_groups[{index}]: lr, weight_decay and eps must be >= 0, "
                             f"got lr={merged['lr']}, weight_decay={merged['weight_decay']}, "
                             f"eps={merged['eps']}")
        merged["params"] = params
        if names is not None:
            merged["param_names"] = names
        result.append(merged)
    missing = [f"'{name}' {tuple(p.shape)}" for name, p in module.named_parameters()
               if p.requires_grad and id(p) not in seen]
    if missing:  # torch would leave them untrained; here the step covers every trainable one
        raise ValueError(
            f"param_groups: {len(missing)} trainable parameter(s) are in no group: "
            f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}; the optimizer "
            f"steps every trainable parameter of the model, so freeze those it should not "
            f"train with requires_grad_(False) in model_func (or on the module given) or put "
            f"them in a group")
    return result


class _UpdateRow:
    """Parameters whose optimizer state shares a momentum chunk, and every chunk their update
    touches (Note [Optimizer sweep])."""

    __slots__ = ("indices", "chunks")

    def __init__(self):
        self.indices: list[int] = []
        self.chunks: set[int] = set()


class ChunkedStateView(collections.abc.Mapping):
    """`optimizer.state` as torch.optim offers it (parameter -> its state dict), read out of the
    chunks on each lookup: the entry its `state_dict()` holds for that parameter, the same keys
    (Note [The state view lists the state dict's keys]); under data parallelism a rank has the
    state of the parameters it owns, as in its `state_dict()`. Edits of an entry reach the
    state as in torch (Note [Edits of optimizer.state entries] in state_edits.py); assigning a
    whole entry (`optimizer.state[p] = ...`) is refused: `optimizer.load_state_dict` writes
    state."""

    def __init__(self, optimizer: "PatrickStarOptimizer"):
        self._optimizer = weakref.ref(optimizer)

    def _with_state(self) -> list:
        optimizer = self._optimizer()
        if optimizer is None:
            return []
        optimizer.apply_state_edits()
        return [param for index, param in enumerate(optimizer.chunked.params)
                if optimizer.has_state(index)] + optimizer.outside_with_state()

    def __getitem__(self, param) -> dict:
        optimizer = self._optimizer()
        if optimizer is None:
            return {}
        optimizer.guard.check_not_deleted("optimizer.state[p]")
        index = optimizer.chunked.index_of(param)
        if index is None:
            return optimizer.outside_entry(param)
        return optimizer.editable_state_entry(index)

    def __iter__(self):
        return iter(self._with_state())

    def __len__(self) -> int:
        return len(self._with_state())

    def __setitem__(self, param, value):
        raise TypeError("optimizer.state[p] = ...: the state lives in chunks, so a whole entry "
                        "cannot be replaced; edit the entry (optimizer.state[p]['exp_avg']"
                        ".zero_(), optimizer.state[p].clear()) or use "
                        "optimizer.load_state_dict()")

    def __repr__(self) -> str:
        return f"ChunkedStateView({len(self)} parameters with state)"


class PatrickStarOptimizer(torch.optim.Optimizer):
    """Adam/AdamW over chunked state. Built by `patrickstar.initialize()`, not by users.

    Handed what a step needs: `params` (the chunk tensors), the config, the data-parallel side
    `dp`, the training guard and loss scaler, whether chunks stream from NVMe, `end_iteration`
    (the engine's, called after every step, applied or skipped), `phase` (the profiler's
    optimizer phase) and `wait_for_gradient_stores` (before gradients are freed unread: Note
    [Gradient stores on the compute stream])."""

    def __init__(self, params: ChunkedParams, groups: list[dict], config, dp, guard,
                 loss_scaler, device: torch.device, has_nvme: bool,
                 end_iteration: Callable[[], None],
                 phase: Callable[[], ContextManager] = contextlib.nullcontext,
                 wait_for_gradient_stores: Callable[[], None] = lambda: None,
                 before_step: Callable[[], None] = lambda: None,
                 after_step: Callable[..., None] = lambda applied, without_gradients=False: None,
                 settle_backward: Callable[[str, bool], None] = lambda call, set_to_none: None,
                 end_iteration_without_step: Callable[[], None] = lambda: None):
        # torch's `defaults` are the constructor's arguments, not a group's: here the config's
        # optimizer params. Hugging Face's get_polynomial_decay_schedule_with_warmup decays from
        # `defaults["lr"]`, which showed the first group's lr (a backbone's 1e-5 under a head's
        # 1e-3) and so made another schedule than on torch.optim.AdamW(groups, lr=...).
        defaults = dict(config.optimizer.group_defaults)
        # Note [torch.optim's own group keys] (the groups show them too)
        defaults.update(_torch_keys(config.optimizer.decoupled_weight_decay))
        # Parameters without elements stay outside the chunks (init_context.plan_parameters):
        # nothing to update, but the groups list them as torch's do (Note [Saved state of
        # parameters without elements]).
        super().__init__(groups, defaults)
        self.chunked = params
        self.state = ChunkedStateView(self)  # torch's dict of per-parameter state
        self._state_edits = StateEdits()  # Note [Edits of optimizer.state entries]
        self.config = config
        self.precision = params.precision
        self.decoupled_weight_decay = config.optimizer.decoupled_weight_decay
        self.dp = dp
        self.guard = guard
        self.loss_scaler = loss_scaler
        self.device = device
        self.has_nvme = has_nvme
        self.skipped_steps = 0  # steps skipped for fp16 overflow
        # DeepSpeed's ZeRO/fp16 optimizers' `overflow`: whether the last step found inf/NaN
        # gradients in fp16 and was skipped (Accelerate's step_was_skipped reads it).
        self.overflow = False
        self.step_counts = [0] * len(params)  # Adam's step count of each parameter
        self.has_grad = [False] * len(params)  # a gradient this step (set by the engine)
        # Note [Gradients zeroed, not dropped]: the parameters whose p.grad torch would hold as
        # zeros now, and those the last step had gradients for.
        self._zeroed: set[int] = set()
        self._stepped: set[int] = set()
        # Those whose p.grad torch would hold as a tensor (a gradient on some rank since they
        # were last set to None), and those whose p.grad reads zeros until the backward after
        # the zero_grad(set_to_none=False) that made them (every rank alike: Note [p.grad after
        # zero_grad(set_to_none=False)] in resting_params.py).
        self._held: set[int] = set()
        self._zero_reads: set[int] = set()
        self._zero_reads_until = -1  # the guard's completed_backwards they hold for
        # Those whose p.grad torch would still hold the last step's gradients in: no zero_grad
        # since (Note [A step without gradients]).
        self._unzeroed: set[int] = set()
        # Zeros set by hand where the optimizer had no state yet, held as an empty p.grad until
        # the step (Note [Zeros set by hand before the first step]).
        self._zeros_by_hand: set[int] = set()
        # The tensors of the update under way (Note [An update interrupted before its release]).
        self._updating: list[int] | None = None
        self._end_iteration = end_iteration
        self._phase = phase
        self._wait_for_gradient_stores = wait_for_gradient_stores
        # The engine's scheduler checks (Note [A configured scheduler in PatrickStar's loop]).
        self._before_step = before_step
        self._after_step = after_step
        # Note [A loss.backward() that raised, met by the optimizer] in backward_pass.py
        self._settle_backward = settle_backward
        # Note [An iteration without a step] in engine.py
        self._end_iteration_without_step = end_iteration_without_step
        self._group_of = {}
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                index = params.index_of(param)
                if index is not None:
                    self._group_of[index] = group_index
        self._rows: list[_UpdateRow] | None = None  # built at first use
        self._remade_chunks: dict[int, bool] = {}  # compute chunk -> re-made from its master
        # clip_grad_norm_() before this step: (max_norm, overflow, scaled norm).
        self._requested_clip: tuple[float, bool, float] | None = None
        # DeepSpeed's get_global_grad_norm(): the unscaled norm of the last step's gradients
        # (None before the first step).
        self.last_grad_norm: float | None = None

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def param_groups(self) -> list[dict]:
        # Note [torch.amp.GradScaler over the chunked optimizer]: scaler.unscale_ reads them.
        if sys._getframe(1).f_code is _UNSCALES_GRADIENTS:
            raise TypeError(_GRAD_SCALER_UNSUPPORTED)
        return self.__dict__["param_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.__dict__["param_groups"] = groups

    # torch.amp.GradScaler hands such an optimizer to step() instead of looking for p.grad
    # (which chunked gradients never fill), so a scaler.step without unscale_ gets the clear
    # error too rather than its "No inf checks were recorded for this optimizer".
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            raise TypeError(_GRAD_SCALER_UNSUPPORTED)
        with self.guard.calling("optimizer.step()"):  # Note [One thread at a time]
            self._settle_backward("optimizer.step()", True)
            self.apply_state_edits()
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # torch.distributed.checkpoint's state-initializing step (zero gradients, lr 0) is
            # decided by this rank's own state (a rank owning no state makes it alone) and
            # issues no collective: it agrees on nothing.
            if self._is_state_initializing_step():
                self._initialize_state()
                return loss
            self.hold_zeros_set_by_hand()  # Note [Zeros set by hand before the first step]
            # Note [Calls between a read and its serving] in data_parallel.py
            self.dp.agree_on_training_call(self.dp.OPTIMIZER_STEP)
            self.guard.check_step_allowed()
            if not self._has_gradients():  # Note [A step without gradients]
                self._before_step()
                self.overflow = False  # it found no overflow (accelerate's step_was_skipped)
                # DeepSpeed's get_global_grad_norm() after a step over no gradients: 0, not the
                # last step's (Note [model.step() without a backward] in deepspeed_loop.py). With
                # pipeline stages or tensor slices, a stage whose step has gradients all-reduces
                # its norm over the model group; one without (its gradients zeroed, not dropped,
                # and no backward since: this check is agreed over data-parallel ranks only)
                # joins with 0, so the group's collectives pair, and reports the group's norm.
                self.last_grad_norm = self._norm_without_gradients()
                self._end_iteration_without_step()
                self._after_step(False, without_gradients=True)
                return loss
            self._before_step()
            with self._phase():
                try:
                    applied = self._step()
                except LossScaleAtMinimum:  # the step was skipped before the scaler raised
                    self.skipped_steps += 1
                    self._after_step(False)
                    raise
            if not applied:
                self.skipped_steps += 1
            self._after_step(applied)
        return loss

    # Note [A step without gradients]
    # torch's optimizer.step() skips every parameter whose p.grad is None, so with no backward
    # since the gradients were last dropped it changes nothing: no weight, moment or step
    # count, and it returns the closure's loss. Loops rely on it: an accumulation loop written
    # `if i % accum == 0: optimizer.step(); optimizer.zero_grad()` before batch 0's backward,
    # an optimizer.step() before the first lr_scheduler.step() (silencing torch's "called in
    # the wrong order" warning), a batch skipped with `continue` after its forward. Ours raised
    # "called before model.backward(loss)". The engine's gradients read None (p.grad, and
    # gradient()) after a step or zero_grad() until a backward stores new ones, so such a step
    # is that no-op here too: it counts no iteration (global_steps, the checkpoint tag), does
    # not move the fp16 loss scale or skipped_steps, and leaves the chunk runtime's trace as if
    # the forwards since the last step had not run (Note [An iteration without a step] in
    # engine.py). For was_step_applied() and the configured scheduler's once-per-step check it
    # is a step not applied, like an fp16 overflow's, after which stepping the scheduler or
    # not are both right. Parameters torch would hold zero gradients for
    # (zero_grad(set_to_none=False): Note [Gradients zeroed, not dropped]) make it an applied
    # step, as in torch. One case
    # stays an error: no zero_grad() since the last step, whose gradients torch's p.grad still
    # holds and would apply once more, while here that step consumed them (as DeepSpeed's and
    # upstream PatrickStar's do): a no-op would train differently without a word (README). Every
    # rank decides alike: the backward count is the loop's, and what each rank knows only of the
    # parameters it owns (zeroed, or stepped and not zeroed since) is agreed on.
    def _has_gradients(self) -> bool:
        """False for a step that changes nothing (Note [A step without gradients])."""
        if self.guard.backwards:
            return True
        stale, zeroed = bool(self._unzeroed), bool(self._zeroed)
        if self.dp.enabled:
            stale = bool(self.dp.ranks_with(stale, label="unzeroed gradients", phase=None))
            zeroed = bool(self.dp.ranks_with(zeroed, label="zeroed gradients", phase=None))
        if stale:
            # (model.step() zeroes the gradients after its own steps: Note [model.step()
            # without a backward] in deepspeed_loop.py.)
            raise RuntimeError(
                "optimizer.step() again (or model.step() at an accumulation boundary) with no "
                "backward and no optimizer.zero_grad() since the last step: torch would apply "
                "that step's gradients (still in its p.grad) once more, but the "
                "PatrickStar engine's step consumed them (as DeepSpeed's does). Call "
                "optimizer.zero_grad() after each optimizer.step() (a step without gradients "
                "is then a no-op, as torch's), or a backward before the step; use one loop, "
                "DeepSpeed's (model.backward(loss); model.step(), which zeroes the gradients "
                "itself) or PatrickStar's (backward; optimizer.step(); optimizer.zero_grad())")
        return zeroed

    # Note [The state-initializing step of torch.distributed.checkpoint]
    # get_state_dict(model, optimizer) (FSDP2's checkpoint recipe with dcp.save / dcp.load /
    # set_state_dict) makes a torch optimizer's lazily made state exist before its first step,
    # so that dcp.load has tensors to fill: where optimizer.state is empty and no p.grad is set,
    # it sets every trainable p.grad to zeros_like(p), steps with every lr 0, then sets the
    # gradients to None. Our step refused to run without a backward, so the recipe failed on a
    # new engine (a resume) naming a backward the user never skipped. The step is known by its
    # marks: no backward since the last step, no gradient in chunks, every group's lr 0 and
    # every trainable parameter's p.grad set to an empty tensor (a gradient of ours is never
    # there; zeros set at rest become one). It counts as torch's step with zero gradients at
    # lr 0 counts: the weights and the (zero) moments stay, each step count becomes 1 and the
    # state shows in state_dict() for dcp.load to fill (only Adam with L2 weight decay would
    # differ, its first moment there being (1 - beta1) * wd * p, and dcp.load overwrites it).
    def _is_state_initializing_step(self) -> bool:
        if self.guard.backwards or any(self.has_grad) or len(self.state):
            return False
        if any(group["lr"] != 0 for group in self.param_groups):
            return False
        trainable = [p for group in self.param_groups for p in group["params"]
                     if p.requires_grad]
        # Zeros become an empty gradient on the placeholder (Note [Gradients set by hand at
        # rest] in resting_params.py).
        return bool(trainable) and all(p.grad is not None and p.grad.numel() == 0
                                       for p in trainable)

    # Note [Zeros set by hand before the first step]
    # `p.grad = torch.zeros_like(p)` where the optimizer has no state yet becomes an empty
    # gradient on the placeholder, which marks torch.distributed.checkpoint's state-initializing
    # step (above). Any other step after it (a lr above 0, or zeros on some parameters only)
    # changed nothing, where torch's AdamW applies zero gradients: the weight decay moves the
    # weights and each parameter gets its state, step 1. Such a step now holds those zeros as
    # zero_grad(set_to_none=False) holds them (hold_zero_gradient), then steps as torch's does;
    # a zero_grad() before it drops them (set_to_none=True) or holds them (False), as torch's
    # drops or keeps them; `p.grad = None` clears the empty gradient itself. A backward holds
    # them first too: autograd's accumulation into the empty p.grad failed with torch's bare
    # size error ("The size of tensor a (0) must match ...") and left the engine's accesses
    # stuck, where torch adds the gradient to the zeros.
    def note_zeros_set_by_hand(self, index: int) -> None:
        """Parameter `index`'s p.grad was set to zeros by hand before any state (Note [Zeros
        set by hand before the first step])."""
        self._zeros_by_hand.add(index)

    def hold_zeros_set_by_hand(self, set_to_none: bool = False) -> None:
        """Note [Zeros set by hand before the first step]: at a step, a zero_grad() or a
        backward's start."""
        if not self._zeros_by_hand:
            return
        indices, self._zeros_by_hand = sorted(self._zeros_by_hand), set()
        for index in indices:
            param = self.chunked.params[index]
            with torch._C.DisableTorchFunctionSubclass():  # its own empty p.grad, not a read
                if param.grad is None or param.grad.numel() != 0:
                    continue
                param.grad = None
            if not set_to_none:
                self.drop_gradients([index], set_to_none=False)
                self.hold_zero_gradient(index)

    def _initialize_state(self) -> None:
        manager = self.chunked.chunks.manager
        for index, ids in enumerate(self.chunked.ids):
            if ids.momentum is not None and self.dp.owns(manager, ids.momentum):
                self.step_counts[index] = 1
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def _step(self) -> bool:
        """Applies one Adam/AdamW step; returns False when it was skipped for overflow."""
        self.overflow = False
        self._check_hyperparameters()
        self._check_no_unplaced_gradients()
        self.dp.close_accumulation("optimizer.step()")  # Note [A short accumulation]
        self._stepped = {index for index, has in enumerate(self.has_grad) if has}
        self._unzeroed = set(self._stepped)
        self._held |= self.dp.gradients_anywhere(self.has_grad)
        run = self.guard.before_step()
        self.guard.after_step()
        if not run:  # a non-finite loss was skipped (config nonfinite_loss: "skip")
            self._drop_step_gradients()
            self._end_iteration()
            return False
        clip = self.config.gradient_clipping
        # The scale the gradients carry: backward() used it and only this method changes it.
        grad_scale = self.loss_scaler.scale
        overflow, norm = False, 0.0
        self.last_grad_norm = None
        requested_coef = None
        if self._requested_clip is not None:  # clip_grad_norm_ read the gradients already
            requested_coef, overflow, norm = self._requested_clip
            self._requested_clip = None
            self.last_grad_norm = norm / grad_scale
        elif clip > 0 or self.precision == "fp16":  # one read pass over the gradients
            overflow, norm = self._gradient_statistics()
            self.last_grad_norm = norm / grad_scale
        # Only fp16 skips steps; elsewhere a non-finite gradient reaches the parameters as it
        # would in plain PyTorch.
        overflow = overflow and self.precision == "fp16"
        self.overflow = overflow
        if overflow:
            self._drop_step_gradients()
            self._end_iteration()
            # Raises at the minimum scale (Note [Overflow at the minimum loss scale] in
            # loss_scaler.py), after the skipped step is cleaned up like any other.
            self.loss_scaler.update(overflow)
            return False
        self.loss_scaler.update(overflow)
        if requested_coef is not None:
            coef = requested_coef
        else:
            coef = clip_coefficient(norm / grad_scale, clip) if clip > 0 else 1.0
        # Note [The norm the update measures] in kernels/adam.cc: a step that read no norm
        # measures it as it updates, for get_global_grad_norm() (DeepSpeed's ZeRO-3 reports one
        # every step).
        measured: dict[int, float] | None = {} if self.last_grad_norm is None else None
        try:
            self._fill_zeroed_gradients()
            self._sweep(grad_scale, coef, measured)
            if measured is not None:  # before the gradients go: the duplicates' squares read them
                self.last_grad_norm = self._measured_grad_norm(measured) / grad_scale
        except BaseException as error:
            if self._updating is not None:  # Note [An update interrupted before its release]
                self.chunked.chunks.release_left_in_compute(self._updating)
                self._updating = None
            self.guard.step_failed(error)
            raise
        try:
            self._drop_step_gradients()
        finally:
            # The step is applied: an interrupt while its gradients are dropped must not leave
            # the iteration uncounted (the next checkpoint's global step and tag one short).
            self._end_iteration()
        return True

    def _norm_without_gradients(self) -> float:
        """A step without gradients' norm: 0, or with a model group the group's (Note [A step
        without gradients])."""
        if not self.dp.model_parallel_enabled:
            return 0.0
        _, squared = self.dp.all_reduce_grad_stats(False, 0.0)
        return math.sqrt(squared) / self.loss_scaler.scale

    def _measured_grad_norm(self, measured: dict[int, float]) -> float:
        """The gradient norm from the squares the sweep measured per parameter: added in index
        order, as _gradient_statistics adds them, so that it is the same number, and over every
        rank (with tensor slices, less the duplicated parameters' squares, which read the
        gradients: called before they are dropped)."""
        squared = 0.0
        for index in sorted(measured):
            squared += measured[index]
        _, squared = self.dp.all_reduce_grad_stats(False, squared)
        return math.sqrt(squared)

    def _check_hyperparameters(self) -> None:
        """A group's lr, betas, eps or weight_decay set to something other than a number (`g['lr']
        = None` in a user's schedule, betas as one number) failed inside the update kernel at the
        first parameter, with pybind11's signature dump listing whole tensors, after that
        parameter's step count had moved: the optimizer then refused every later step as
        "failed partway" though nothing was updated. Checked before anything changes, naming
        the group, key and value; the step can be called again once it is fixed. So are the
        ranges the kernel requires, torch.optim.AdamW's own (a schedule's NaN or negative lr
        was refused by the kernel only, after the step counts had moved: "failed partway",
        and a checkpoint load was the only way on)."""
        for index, group in enumerate(self.param_groups):
            for key in ("lr", "eps", "weight_decay"):
                _require_number(index, key, group.get(key))
                _require_range(index, key, group.get(key), 0.0, None)
            try:  # Note [torch.optim's own group keys]
                _without_torch_keys(index, group, self.decoupled_weight_decay)
            except ValueError as error:
                raise ValueError(f"optimizer.{error}; nothing was updated") from None
            betas = group.get("betas")
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise TypeError(f"optimizer.param_groups[{index}]['betas'] is {betas!r}: "
                                f"expected two numbers (beta1, beta2); nothing was updated")
            for beta in betas:
                _require_number(index, "betas", beta, whole=betas)
                _require_range(index, "betas", beta, 0.0, 1.0, whole=betas)

    def _check_no_unplaced_gradients(self) -> None:
        """A parameter frozen when initialize() built the model has no gradient or optimizer
        chunks; unfreezing it later would let autograd compute a gradient that nothing applies.
        Say so instead of training silently without it."""
        for index, param in enumerate(self.chunked.params):
            if param.grad is not None and self.chunked.ids[index].grad is None:
                param.grad = None
                raise RuntimeError(
                    f"parameter '{self.chunked.names[index]}' was frozen (requires_grad=False) "
                    f"when patrickstar.initialize() built the model, so it has no gradient or "
                    f"optimizer state in chunks, but it got a gradient now (requires_grad_(True) "
                    f"after initialize()?). Leave it trainable in model_func and freeze it with "
                    f"requires_grad_(False) afterwards instead: a parameter frozen after "
                    f"initialize() is skipped by the step, as torch skips it")

    def gradient(self, index: int) -> torch.Tensor | None:
        """Parameter `index`'s gradient as `p.grad` would show it in PyTorch now: fp32, the loss
        scale taken out, clipped when `clip_grad_norm_()` was called (the config's
        `gradient_clipping` applies inside `step()`, as DeepSpeed's does); None without one.
        This rank's chunk: under data parallelism only the owner has it after the
        accumulation boundary (PatrickStarEngine.full_gradient gathers it)."""
        if not self.has_grad[index]:
            # Zeros kept by zero_grad(set_to_none=False): Note [Gradients zeroed, not dropped].
            return torch.zeros(self.chunked.shapes[index]) if index in self._zeroed else None
        grad = self.chunked.read(index, _C.ChunkKind.GRADIENT).float()
        scale = self.loss_scaler.scale
        return grad.mul_(self._pending_clip_coefficient() / scale)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for gradients that live in chunks (which
        `model.parameters()` cannot show): returns the total norm over every rank's gradients
        (unscaled: what PyTorch would report) and clips the coming `step()` to `max_norm`, for
        this step only (config `gradient_clipping` clips every step)."""
        # Note [Module forwards in a forked child] in guards.py
        self.guard.check_owner_process("clip_grad_norm_()")
        if not (norm_type == math.inf or norm_type > 0):
            raise ValueError(f"clip_grad_norm_: norm_type {norm_type} is not supported; "
                             f"PatrickStar-C++ clips by a norm of order p > 0 or inf (torch's "
                             f"default: 2.0)")
        if norm_type != 2.0 and self.dp.model_parallel is not None:
            raise ValueError(f"clip_grad_norm_: norm_type {norm_type} with pipeline stages or "
                             f"tensor slices is not supported; clip by the L2 norm "
                             f"(norm_type=2.0)")
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be positive, got {max_norm}")
        # Note [Calls between a read and its serving] in data_parallel.py
        self.dp.agree_on_training_call(self.dp.GRADIENT_CLIP)
        self.dp.close_accumulation("clip_grad_norm_()")  # Note [A short accumulation]
        if norm_type == 2.0:
            overflow, norm = self._gradient_statistics()
        else:
            overflow, norm = self._gradient_norm(norm_type)
        total = self._measured_norm(overflow, norm)
        self._request_clip(clip_coefficient(total, float(max_norm)), overflow, norm)
        return torch.tensor(total)

    def clip_grads_with_norm_(self, max_norm: float, total_norm: float) -> None:
        """`torch.nn.utils.clip_grads_with_norm_`: clips the coming `step()` by max_norm /
        (total_norm + 1e-6), capped at 1, `total_norm` being the caller's. torch's
        `get_total_norm([p.grad ...])` before it finds no gradient here and gives 0, which
        would clip nothing: a zero for gradients that are not all zero is refused."""
        self.guard.check_owner_process("clip_grads_with_norm_()")  # (as clip_grad_norm_)
        if not max_norm > 0:
            raise ValueError(f"clip_grads_with_norm_: max_norm must be positive, got {max_norm}")
        self.dp.close_accumulation("clip_grads_with_norm_()")  # Note [A short accumulation]
        overflow, norm = self._gradient_statistics()
        if total_norm == 0 and (overflow or norm > 0):
            raise ValueError(
                f"torch.nn.utils.clip_grads_with_norm_: total_norm is 0 but the PatrickStar "
                f"engine's gradients have norm {self._measured_norm(overflow, norm):.6g}: they "
                f"live in chunks (p.grad is "
                f"None), so torch.nn.utils.get_total_norm over p.grad found none. Call "
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), which returns "
                f"the total norm and clips, or model.clip_grad_norm_(max_norm)")
        self._request_clip(clip_coefficient(total_norm, float(max_norm)), overflow, norm)

    def _measured_norm(self, overflow: bool, norm: float) -> float:
        """The norm torch would measure of the gradients now: `norm` (of the chunked, scaled
        gradients) unscaled and with the clip asked for before applied (Note [A clip before the
        step])."""
        return math.inf if overflow else norm * self._pending_clip_coefficient() / (
            self.loss_scaler.scale)

    def _request_clip(self, coefficient: float, overflow: bool, norm: float) -> None:
        """Multiplies `coefficient` into the clip the coming step applies (Note [A clip before
        the step]); the first request's `norm` stays for get_global_grad_norm()."""
        first_norm = norm if self._requested_clip is None else self._requested_clip[2]
        self._requested_clip = (self._pending_clip_coefficient() * coefficient, overflow,
                                first_norm)

    # Note [A clip before the step]
    # torch's clip_grad_norm_ scales p.grad at once; here the chunked gradients keep their values
    # and the coefficient waits in _requested_clip (coefficient, overflow, the first call's norm)
    # for step()'s sweep, which scales them anyway (one pass over the gradients, not two). What
    # the user does between must see the gradients as torch would, clipped: gradient() scales
    # what it reads, a later clip_grad_norm_ (a second clip, or `max_norm=inf` to log the
    # clipped norm) measures norm * coefficient and multiplies its own coefficient in, and
    # clip_grad_value_ clamps the unscaled values at value / coefficient, so that after the
    # coming scaling they are clamped at value, as torch's clamp of the scaled p.grad. The first
    # call's norm stays for get_global_grad_norm(), DeepSpeed's norm before clipping. A backward
    # that follows the clip in the same step adds unclipped gradients to torch's clipped p.grad,
    # so its start applies the waiting coefficient first (apply_pending_clip; the step then
    # measures the sum afresh).
    def _pending_clip_coefficient(self) -> float:
        return 1.0 if self._requested_clip is None else self._requested_clip[0]

    def apply_pending_clip(self) -> None:
        """A backward starts: the clip waiting for the step scales the gradients now (Note [A
        clip before the step])."""
        if self._requested_clip is None:
            return
        coefficient, self._requested_clip = self._requested_clip[0], None
        if coefficient != 1.0:
            self.scale_gradients(coefficient)

    def clip_grad_value_(self, clip_value: float, indices: Iterable[int]) -> None:
        """`torch.nn.utils.clip_grad_value_` on these parameters' gradients in their chunks
        (clamped in place to +-clip_value, in the loss scale they carry). In fp16, gradients
        with an inf or NaN are left as they are, so that the step still skips them (torch's
        clamp would turn an overflow into +-clip_value)."""
        self.guard.check_owner_process("clip_grad_value_()")  # (as clip_grad_norm_)
        value = float(clip_value)
        if not value >= 0:
            raise ValueError(f"clip_grad_value_: clip_value must be >= 0, got {clip_value}")
        indices = [index for index in indices if self.has_grad[index]]
        if self.precision == "fp16" and self._gradient_statistics()[0]:
            return
        # Note [A clip before the step]: the pending clip scales these values afterwards.
        bound = value * self.loss_scaler.scale / self._pending_clip_coefficient()
        for index in indices:
            with self.chunked.view(index, _C.ChunkKind.GRADIENT) as grad:
                grad.clamp_(-bound, bound)

    def scale_gradients(self, factor: float) -> None:
        """Multiplies every gradient this rank holds by `factor` in its chunk (Note [A short
        accumulation] in data_parallel.py)."""
        for index, has in enumerate(self.has_grad):
            if has:
                with self.chunked.view(index, _C.ChunkKind.GRADIENT) as grad:
                    grad.mul_(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients; between steps also the backward calls made so far (Note
        [Training call order] in guards.py). `set_to_none=False`: Note [Gradients zeroed, not
        dropped]."""
        with self.guard.calling("optimizer.zero_grad()"):  # Note [One thread at a time]
            self._settle_backward("optimizer.zero_grad()", set_to_none)
            self.hold_zeros_set_by_hand(set_to_none)
            self._note_zeroing(range(len(self.has_grad)), set_to_none)
            self._drop_step_gradients()
            if set_to_none:  # as torch's, the groups' parameters without elements too
                for group in self.param_groups:
                    for param in group["params"]:
                        if self.chunked.index_of(param) is None:
                            param.grad = None

    def _drop_step_gradients(self) -> None:
        """zero_grad() without its set_to_none: also the step's own drop of the gradients it
        applied, which a user's zero_grad(set_to_none=False) then follows."""
        self._requested_clip = None
        self._free_gradients(range(len(self.has_grad)))
        self.dp.gradients_dropped(self.guard.discard_backwards() > 0)

    # Note [Gradients zeroed, not dropped]
    # torch's zero_grad(set_to_none=False) (the default before torch 2.0, and model.zero_grad's)
    # leaves every existing p.grad a tensor of zeros, and torch's Adam updates every parameter
    # whose p.grad is not None: one unused in a later step (a branch not taken, a frozen part)
    # still moves there, by its decaying first moment (and AdamW's decay). Gradients here live
    # in chunks and every step drops them (DeepSpeed's engine does too), so such a parameter
    # was skipped: 0.002 off PyTorch after four steps of a branch taken once. The optimizer
    # therefore remembers the parameters torch would keep zeros for: those with a gradient (or
    # the last step's) when zero_grad(set_to_none=False) is called, until a zero_grad with
    # set_to_none=True forgets them; a step gives each of them without a gradient of its own
    # a zero gradient, so it is updated as torch's Adam updates it. Loops that never call
    # zero_grad, or call it with set_to_none=True, are as before.
    def _note_zeroing(self, indices: Iterable[int], set_to_none: bool) -> None:
        indices = set(indices)
        self._unzeroed -= indices
        if set_to_none:
            self._zeroed -= indices
            self._stepped -= indices
            self._held -= indices
            self._zero_reads -= indices
        else:
            self._held |= indices & self.dp.gradients_anywhere(self.has_grad)
            reads = self._zero_reads if self._zero_reads_hold() else set()
            self._zero_reads = reads | (indices & self._held)
            self._zero_reads_until = self.guard.completed_backwards
            # this rank's parameters only: their owner updates them
            owned = {index for row in self._update_rows() for index in row.indices}
            self._zeroed |= indices & owned & (self._stepped | {
                index for index, has in enumerate(self.has_grad) if has})

    def hold_zero_gradient(self, index: int) -> None:
        """Parameter `index`'s p.grad set to zeros by hand: kept as zero_grad(set_to_none=False)
        keeps a gradient it had (Note [Gradients set by hand at rest] in resting_params.py)."""
        self._held.add(index)
        self._note_zeroing([index], set_to_none=False)
        if any(index in row.indices for row in self._update_rows()):  # owned: updated here
            self._zeroed.add(index)

    def _zero_reads_hold(self) -> bool:
        """Whether no backward ended since the last zero_grad(set_to_none=False)."""
        return self._zero_reads_until == self.guard.completed_backwards

    def reads_zero_gradient(self, index: int) -> bool:
        """Whether parameter `index`'s p.grad reads zeros now (Note [p.grad after
        zero_grad(set_to_none=False)] in resting_params.py)."""
        return index in self._zero_reads and self._zero_reads_hold()

    def _fill_zeroed_gradients(self) -> None:
        """Zero gradients for this rank's zeroed parameters without one of their own (Note
        [Gradients zeroed, not dropped])."""
        if not self._zeroed:
            return
        for row in self._update_rows():
            for index in row.indices:
                if index in self._zeroed and not self.has_grad[index]:
                    with self.chunked.view(index, _C.ChunkKind.GRADIENT) as grad:
                        grad.zero_()
                    self.has_grad[index] = True

    def drop_gradients(self, indices: Iterable[int], set_to_none: bool = True) -> None:
        """Frees the gradients of these parameters (a module's zero_grad(): Note [Module
        zero_grad] in module_zero_grad.py); the backward calls of the step stay counted. A clip
        asked for before stays: torch would already have scaled the remaining gradients."""
        indices = list(indices)
        self._note_zeroing(indices, set_to_none)
        self._free_gradients(indices)

    def _free_gradients(self, indices: Iterable[int]) -> None:
        indices = [index for index in indices if self.has_grad[index]]
        if indices:  # a store still queued on the GPU may use a block being freed
            self._wait_for_gradient_stores()
        chunks = self.chunked.chunks
        for index in indices:
            grad_id = self.chunked.ids[index].grad
            try:
                chunks.set_tensor_state(grad_id, S.FREE)
                self.has_grad[index] = False
            except BaseException:
                # A signal handler's exception right after the free returned (Note [Interrupted
                # access] in chunk_runtime.py) left `has_grad` set on a freed gradient, and
                # every later zero_grad() and step failed with "illegal state transition FREE
                # -> FREE": the engine was lost. A free that failed changed nothing.
                if chunks.tensor_info(grad_id)["state"] == S.FREE:
                    self.has_grad[index] = False
                raise

    # ---- Gradients -----------------------------------------------------------------------------

    def _grad_views(self):
        """Yields (index, grad view) of every parameter that has a gradient this step, each
        read where its chunk is (Note [Optimizer sweep]); COMPUTE until the generator moves on."""
        chunks = self.chunked.chunks
        for index, has in enumerate(self.has_grad):
            if not has:
                continue
            grad_id = self.chunked.ids[index].grad
            view = chunks.access(grad_id, self._update_tiers([grad_id])[0])
            try:
                yield index, view
            finally:
                chunks.release(grad_id, S.HOLD)

    def _gradient_statistics(self) -> tuple[bool, float]:
        overflow = False
        squared = 0.0
        for _, grad in self._grad_views():
            grad_squared, bad = _C.kernels.grad_stats([grad])
            overflow |= bad
            squared += grad_squared
        overflow, squared = self.dp.all_reduce_grad_stats(overflow, squared)
        return overflow, math.sqrt(squared)

    def _gradient_norm(self, norm_type: float) -> tuple[bool, float]:
        """_gradient_statistics for torch's other norm orders (clip_grad_norm_'s norm_type):
        the norm of the tensors' norms, as torch takes it, and whether one is inf/NaN."""
        overflow, total = False, 0.0
        for _, grad in self._grad_views():
            norm = float(torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32))
            overflow |= not math.isfinite(norm)
            total = max(total, norm) if norm_type == math.inf else total + norm ** norm_type
        overflow, total = self.dp.all_reduce_grad_powers(overflow, total,
                                                         maximum=norm_type == math.inf)
        return overflow, total if norm_type == math.inf else total ** (1.0 / norm_type)

    # ---- The sweep -----------------------------------------------------------------------------

    def _update_roles(self, index: int) -> dict[str, int]:
        """The chunk tensors one Adam update of parameter `index` reads and writes, by the
        kernel argument each one is: the param is the fp32 master where there is one (its
        16-bit compute copy then receives the result, unless the chunk manager makes that copy
        from the master when it is next needed: Note [Compute chunks re-made from the master]
        in chunk/chunk_manager_remake.cc), else the compute chunk itself (fp32, or bf16 with
        its Kahan compensation when bf16.master_weights is false); 8-bit moments bring their
        scales."""
        ids = self.chunked.ids[index]
        roles = {"param": ids.master if ids.master is not None else ids.compute,
                 "grad": ids.grad, "exp_avg": ids.momentum, "exp_avg_sq": ids.variance}
        if ids.master is not None and not self._remade(ids.compute):
            roles["param_copy"] = ids.compute
        if ids.compensation is not None:
            roles["param_compensation"] = ids.compensation
        if ids.momentum_scale is not None:
            roles["exp_avg_scale"] = ids.momentum_scale
            roles["exp_avg_sq_scale"] = ids.variance_scale
        return roles

    def _remade(self, compute_id: int) -> bool:
        """Whether the chunk manager drops this compute tensor's chunk between uses and makes it
        again from the master (data parallelism with parallel.remake_compute)."""
        chunk = self.chunked.chunk_of(compute_id)
        remade = self._remade_chunks.get(chunk)
        if remade is None:  # fixed once data parallelism declared the sources (after_init)
            remade = self._remade_chunks[chunk] = self.chunked.chunks.manager.remakeable(chunk)
        return remade

    def _update_tensors(self, index: int) -> list[int]:
        """The chunk tensors one Adam update of parameter `index` reads and writes."""
        return list(self._update_roles(index).values())

    def _update_rows(self) -> list[_UpdateRow]:
        if self._rows is None:
            manager = self.chunked.chunks.manager
            rows: dict[int, _UpdateRow] = {}
            for index, ids in enumerate(self.chunked.ids):
                if ids.momentum is None or not self.dp.owns(manager, ids.momentum):
                    continue
                row = rows.setdefault(self.chunked.chunk_of(ids.momentum), _UpdateRow())
                row.indices.append(index)
                row.chunks.update(self.chunked.chunk_of(t) for t in self._update_tensors(index))
            self._rows = [rows[chunk] for chunk in sorted(rows)]
        return self._rows

    def _update_tiers(self, tensor_ids: list[int]) -> list[str]:
        """Where the optimizer reads and writes each tensor: Note [Optimizer sweep]."""
        tiers = self.chunked.chunks.chunk_tiers([self.chunked.chunk_of(t) for t in tensor_ids])
        if self.device.type == "cpu":  # the device tier is host memory too
            return [tier if tier in (T.DEVICE, T.HOST) else T.HOST for tier in tiers]
        on_device = all(tier == T.DEVICE for tier in tiers)
        return [T.DEVICE if on_device else T.HOST] * len(tiers)

    def _sweep(self, grad_scale: float, coef: float, measured: dict[int, float] | None) -> None:
        """Note [Optimizer sweep]. `measured`, when given, receives each updated parameter's
        squared gradient norm (Note [The norm the update measures] in kernels/adam.cc)."""
        chunks = self.chunked.chunks
        rows = [row for row in self._update_rows()
                if any(self.has_grad[i] for i in row.indices)]
        streaming = self.has_nvme
        staged: set[int] = set()  # chunks this sweep brought up from NVMe

        def read_ahead(row: _UpdateRow) -> None:
            for chunk in sorted(row.chunks):
                if chunks.chunk_tier(chunk) == T.NVME:
                    staged.add(chunk)
                    chunks.start_move(chunk, T.HOST)

        if streaming and rows:
            read_ahead(rows[0])
        for k, row in enumerate(rows):
            following = rows[k + 1] if k + 1 < len(rows) else None
            if streaming and following is not None:
                read_ahead(following)
            for index in row.indices:
                if not self.has_grad[index]:
                    continue
                group = self.param_groups[self._group_of[index]]
                self.step_counts[index] += 1
                squared = self._adam_update(index, group, grad_scale, coef, measured is not None)
                if measured is not None:
                    measured[index] = squared
            if streaming:
                for chunk in sorted(row.chunks & staged):
                    if following is None or chunk not in following.chunks:
                        staged.discard(chunk)
                        chunks.start_move(chunk, T.NVME)

    # Note [An update interrupted before its release]
    # A signal handled in the finally below before release_tensors ran (at `if accessed is not
    # None`) left the update's tensors in COMPUTE: the step failed partway, as it should, but
    # the load_checkpoint() meant to recover failed "COMPUTE -> FREE" on them. The tensors of
    # the update under way are kept in `_updating` until it has released them, and the step's
    # failure releases those still in COMPUTE (none else holds them: an access of a tensor in
    # COMPUTE is refused, so the update's access put them there).
    def _adam_update(self, index: int, group: dict, grad_scale: float, coef: float,
                     measure_grad: bool = False) -> float | None:
        """Updates parameter `index`; with `measure_grad`, returns its gradient's squared norm
        (as stored, in the loss scale)."""
        chunks = self.chunked.chunks
        roles = self._update_roles(index)
        tensors = list(roles.values())
        self._updating = tensors
        accessed = None
        try:
            # The access inside the try: a signal handled right after it returned (at the next
            # call, dict() or zip()) left the tensors in COMPUTE, and the load_checkpoint() that
            # a step failed partway asks for failed "... COMPUTE -> FREE" on them. An access
            # that raises has given back what it took (Note [Interrupted access]).
            accessed = chunks.access_tensors(tensors, self._update_tiers(tensors))
            views = dict(zip(roles, accessed))
            beta1, beta2 = group["betas"]
            squared = _C.kernels.adam_(
                views.pop("param"), views.pop("grad"), views.pop("exp_avg"),
                views.pop("exp_avg_sq"), **views,
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], adamw=self.decoupled_weight_decay,
                step=self.step_counts[index], grad_scale=grad_scale, clip_coef=coef,
                measure_grad=measure_grad)
        finally:
            if accessed is not None:
                chunks.release_tensors(tensors, S.HOLD)
        self._updating = None
        return squared

    # ---- State dict ----------------------------------------------------------------------------

    @staticmethod
    def _refuse_copy(call: str):
        raise TypeError(f"the PatrickStar optimizer cannot be copied or pickled ({call}): its "
                        f"state lives in chunks of the engine's runtime. Save "
                        f"optimizer.state_dict() (loads with optimizer.load_state_dict) or "
                        f"model.save_checkpoint(dir) (the whole training state)")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("torch.save(optimizer)")

    def __copy__(self):
        self._refuse_copy("copy.copy(optimizer)")

    def __deepcopy__(self, memo):
        self._refuse_copy("copy.deepcopy(optimizer)")

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "chunked", None) is None:  # torch.optim.Optimizer.__init__'s groups
            return super().add_param_group(param_group)
        raise ValueError("add_param_group: the PatrickStar optimizer updates the chunks of the "
                         "model it was built with; parameters cannot be added later. Split the "
                         "model's parameters into groups with initialize(..., param_groups=...), "
                         "and give other parameters a torch optimizer of their own")

    def has_state(self, index: int) -> bool:
        """Whether parameter `index` has Adam state: trainable and stepped at least once."""
        return self.chunked.ids[index].momentum is not None and self.step_counts[index] > 0

    def _empty_moments(self, param: torch.Tensor) -> dict:
        """The state torch keeps for a stepped parameter without elements (Note [Saved state
        of parameters without elements])."""
        return {"step": torch.tensor(float(max(self.step_counts, default=0))),
                **{key: torch.zeros_like(param, memory_format=torch.contiguous_format)
                   for key in moment_state.MOMENT_KEYS}}

    def outside_with_state(self) -> list[torch.Tensor]:
        """The groups' trainable parameters outside the chunks (those without elements) once
        the optimizer has stepped: as in torch, they then have state (Note [Saved state of
        parameters without elements])."""
        if max(self.step_counts, default=0) == 0:
            return []
        return [param for group in self.param_groups for param in group["params"]
                if param.requires_grad and self.chunked.index_of(param) is None]

    def outside_entry(self, param) -> dict:
        """`optimizer.state[param]` of a parameter outside the chunks: the entry state_dict()
        gives it ({} before the first step, or for what the groups do not hold)."""
        if not any(param is p for p in self.outside_with_state()):
            return {}
        return self._empty_moments(param)

    # Note [The state view lists the state dict's keys]
    # torch.distributed.checkpoint's set_state_dict with
    # StateDictOptions(flatten_optimizer_state_dict=True) (torchtitan's optimizer container)
    # rebuilds each parameter's saved entry from the keys of `optimizer.state[p]`, not from the
    # flattened dict's. The view held step and moments only, so a 16-bit run's fp32 masters and
    # Kahan compensations (Note [Master weights in the optimizer's state dict]) were dropped at
    # such a load: the masters were rebuilt from the bf16 weights and the compensations zeroed,
    # and the resumed run drifted from an uninterrupted one. As in torch, where state_dict() is
    # built from `optimizer.state`, a parameter's entry is now one thing, read by both.
    def state_entry(self, index: int) -> dict:
        """Parameter `index`'s optimizer state ({} before its first step): "step" and the
        moments read out of their chunks (8-bit state: codes and their scales), and in 16 bits
        its fp32 master or Kahan compensation (Note [Master weights in the optimizer's state
        dict]); `optimizer.state[p]` and `state_dict()` give the same entry (Note [The state view
        lists the state dict's keys])."""
        if not self.has_state(index):
            return {}
        params = self.chunked
        entry = {"step": torch.tensor(float(self.step_counts[index]))}
        for key in moment_state.MOMENT_KEYS:
            entry.update(moment_state.read_moment(params, index, key))
        entry.update(self._weight_entry(index))
        return entry

    def editable_state_entry(self, index: int) -> EditableEntry:
        """`optimizer.state[p]` of parameter `index`: its state entry, whose edits the next
        read or step of the state writes back (Note [Edits of optimizer.state entries])."""
        self.apply_state_edits()
        return self._state_edits.hand_out(index, self.state_entry(index))

    def apply_state_edits(self) -> None:
        """Writes back the `optimizer.state[p]` entries edited since they were handed out."""
        self._state_edits.write_back(self._write_state_edits)

    def forget_state_edits(self) -> None:
        """After a load replaced the state: the entries handed out before are no longer it."""
        self._state_edits.forget()

    def _write_state_edits(self, index: int, entry: EditableEntry | None, edited: dict) -> None:
        """Writes parameter `index`'s edited state: `entry` as the script left it, or, when it
        dropped the dict, the state in chunks with the `edited` tensors it kept."""
        name = self.chunked.names[index]
        momentum = self.chunked.ids[index].momentum
        if momentum is None or not self.dp.owns(self.chunked.chunks.manager, momentum):
            raise ValueError(f"optimizer.state['{name}'] was edited, but this rank holds no "
                             f"state for it (frozen, or owned by another data-parallel rank)")
        if entry is not None and not entry:  # torch's state[p] = {}: Adam starts afresh
            self._forget_state({index})
            return
        full = dict(entry) if entry is not None else {**self.state_entry(index), **edited}
        known = {"step", *moment_state.MOMENT_KEYS, *self._WEIGHT_KINDS, self._COMPENSATED,
                 *map(moment_state.scale_key, moment_state.MOMENT_KEYS)}
        unknown = sorted(set(edited) - known)
        if unknown:
            raise ValueError(f"optimizer.state['{name}'] was given key(s) {unknown}: the state "
                             f"in chunks holds only {sorted(known & set(self.state_entry(index)))}"
                             f"; the state keeps its values")
        try:
            self._check_saved_shapes({name: full}, {name: index})
            step = float(full["step"])
            if not math.isfinite(step) or step < 0 or step != int(step):
                raise ValueError(f"its step must be a whole number >= 0, got {step}")
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"optimizer.state['{name}'] was edited into a state the optimizer "
                             f"cannot take ({error}); the state keeps its values") from None
        self.step_counts[index] = int(step)
        for key in moment_state.MOMENT_KEYS:
            scale = moment_state.scale_key(key)
            if key in edited or scale in edited:
                moment_state.write_moment(self.chunked, index, key, full[key], full.get(scale))
        if set(edited) & {*self._WEIGHT_KINDS, self._COMPENSATED}:
            self._load_weight_entry(index, full)
            self.dp.parameters_changed()

    # Note [Optimizer state-dict hooks]
    # torch.optim.Optimizer.state_dict() and load_state_dict() run the hooks registered with
    # register_state_dict_pre_hook / _post_hook and register_load_state_dict_pre_hook /
    # _post_hook (a post-hook's or a load pre-hook's return value, when not None, replaces the
    # dict, and load works on a shallow copy). Ours override both, so those hooks were
    # registered on the optimizer and never ran: a script that adds its own entries to the
    # saved dict (or strips them before a load) lost them silently. Both run them as torch does,
    # around the optimizer's own layout.
    def state_dict(self):
        """torch's layout, every parameter's Adam state: under data parallelism a collective
        (every rank calls it, as `model.state_dict()`) that gathers each owner's entries, so a
        file saved by one rank holds all of it and loads on any rank. Runs torch's state-dict
        hooks (Note [Optimizer state-dict hooks])."""
        # Note [Module forwards in a forked child] in guards.py
        self.guard.check_not_deleted("optimizer.state_dict()")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self.guard.calling("optimizer.state_dict()"):  # Note [Reads are calls too]
            self.apply_state_edits()
            state_dict = self._own_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _own_state_dict(self) -> dict:
        params = self.chunked
        self.dp.agree_on_call(3)  # Note [Every rank runs the same forwards] in data_parallel.py
        state = {}
        for index in range(len(params)):
            entry = self.state_entry(index)
            if entry:
                state[index] = entry
        if self.dp.enabled:
            merged = {}
            for part in self.dp.all_gather_object(state, label="optimizer state"):
                merged.update(part)
            state = dict(sorted(merged.items()))
        # torch's numbering: each parameter's place in the groups (Note [Saved optimizer state
        # is numbered by its groups]), which torch.distributed.checkpoint reads as such.
        groups, number_of, outside = [], {}, {}
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = []
            for param in group["params"]:
                number, index = len(number_of) + len(outside), params.index_of(param)
                if index is None:
                    outside[number] = param
                else:
                    number_of[index] = number
                saved["params"].append(number)
            groups.append(saved)
        state = {number_of[index]: entry for index, entry in state.items()}
        if state:  # Note [Saved state of parameters without elements]
            state.update({number: self._empty_moments(param)
                          for number, param in outside.items() if param.requires_grad})
            state = dict(sorted(state.items()))
        return {"state": state, "param_groups": groups,
                "loss_scaler": self.loss_scaler.state_dict()}

    # Note [Master weights in the optimizer's state dict]
    # In fp16/bf16, `model.state_dict()` holds the 16-bit compute weights (as DeepSpeed's module
    # state dict does), but the optimizer updates an fp32 master (or, with bf16.master_weights
    # false, the bf16 weights plus a bf16 Kahan compensation): both are optimizer state, so a
    # plain `torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})`
    # resumed from the rounded weights alone and drifted from an uninterrupted run from the
    # first step on (as DeepSpeed's fp16 optimizer, ours carries its fp32 copy). Each entry with
    # Adam state also holds "master_param" / "param_compensation", what the chunks keep.
    # `model.load_state_dict` writes the master from the 16-bit weights and zeroes the
    # compensation (new weights carry no rounding error); `optimizer.load_state_dict` then
    # writes the saved ones. An engine without that kind ignores the key, and a dict without
    # it (a torch optimizer's, an older file) leaves what the model load wrote, as before.
    # `optimizer.state[p]` holds them too (Note [The state view lists the state dict's keys]).
    _WEIGHT_KINDS = {"master_param": _C.ChunkKind.MASTER_PARAM,
                     "param_compensation": _C.ChunkKind.PARAM_COMPENSATION}
    # Note [The weights a compensation belongs to]
    # A Kahan compensation is the rounding error of the bf16 weights it was carried with: the
    # finer copy of a weight without a master is the pair. The optimizer's state dict carried
    # the compensation alone, so loading it before the model's state dict (the order of
    # torch.distributed.checkpoint's set_state_dict, FSDP2's recipe that the README promises
    # resumes bit for bit) wrote it beside the new engine's initial weights, and the model's
    # load then brought other weights and zeroed it (Note [Loading the weights the model has]
    # in parameter_values.py): the resumed run drifted by a bf16 ulp within a few steps. Each
    # entry with a compensation now also holds those bf16 weights ("compensated_param"), and
    # the optimizer's load writes both, as it writes a master: the model's load of the same
    # weights is then no change and keeps the compensation, in either order. An engine without
    # compensation chunks ignores both keys (its weights come from the model's load).
    _COMPENSATED = "compensated_param"

    def _weight_entry(self, index: int) -> dict:
        """Parameter `index`'s fp32 master and Kahan compensation (with the bf16 weights it
        belongs to), where it has them (Note [Master weights in the optimizer's state dict])."""
        entry = {key: self.chunked.read(index, kind) for key, kind in self._WEIGHT_KINDS.items()
                 if self.dp.keeps(self.chunked, index, kind)}
        # Note [The weights a compensation belongs to] (the compute chunk's owner is the
        # compensation's: both lists register the trainable parameters alike)
        if "param_compensation" in entry and \
                self.dp.keeps(self.chunked, index, _C.ChunkKind.COMPUTE_PARAM):
            entry[self._COMPENSATED] = self.chunked.read(index, _C.ChunkKind.COMPUTE_PARAM)
        return entry

    def _load_weight_entry(self, index: int, entry: dict) -> None:
        if self._COMPENSATED in entry and "param_compensation" in entry and \
                self.dp.keeps(self.chunked, index, _C.ChunkKind.PARAM_COMPENSATION) and \
                self.dp.keeps(self.chunked, index, _C.ChunkKind.COMPUTE_PARAM):
            self.chunked.write(index, _C.ChunkKind.COMPUTE_PARAM, entry[self._COMPENSATED])
        for key, kind in self._WEIGHT_KINDS.items():
            if key in entry and self.dp.keeps(self.chunked, index, kind):
                self.chunked.write(index, kind, entry[key])

    def load_state_dict(self, state_dict):
        """Runs torch's load hooks (Note [Optimizer state-dict hooks]) around the load."""
        self.guard.check_not_deleted("optimizer.load_state_dict()")  # (as state_dict())
        state_dict = state_dict.copy()  # torch's shallow copy, which the pre-hooks may change
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self.guard.calling("optimizer.load_state_dict()"):  # Note [Reads are calls too]
            # Note [Writes on one rank are refused] in data_parallel.py
            self.dp.agree_on_training_call(self.dp.OPTIMIZER_LOAD)
            self._load_own_state_dict(state_dict)
            self.forget_state_edits()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_own_state_dict(self, state_dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state dict has {len(groups)} param groups, the "
                             f"optimizer {len(self.param_groups)}")
        # Saved names as the groups' 'params' give them (Note [Saved optimizer state is
        # numbered by its groups]): numbers, or fully qualified names.
        state = {_saved_key(key): entry for key, entry in state_dict["state"].items()}
        empty = _empty_entries(state)  # Note [Saved state of parameters without elements]
        # Note [An empty entry is no state]
        state = {key: entry for key, entry in state.items() if key not in empty and entry}
        to_index = self._saved_numbering(groups, empty)
        self._check_saved_shapes(state, to_index)
        groups = [self.checked_saved_group(number, saved) for number, saved in enumerate(groups)]
        if "loss_scaler" in state_dict:  # Note [A loss scaler's saved state] in loss_scaler.py
            self.loss_scaler.checked_state(state_dict["loss_scaler"])
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        manager = self.chunked.chunks.manager
        for key, entry in state.items():
            index = to_index[key]
            momentum = self.chunked.ids[index].momentum
            if momentum is not None and not self.dp.owns(manager, momentum):
                continue  # data parallel: its owner loads it
            self.step_counts[index] = int(entry["step"])
            for key in moment_state.MOMENT_KEYS:
                moment_state.write_moment(self.chunked, index, key, entry[key],
                                          entry.get(moment_state.scale_key(key)))
            self._load_weight_entry(index, entry)
        self._forget_state(set(range(len(self.chunked.ids))) -
                           {to_index[key] for key in state})
        if state_dict["state"] and any(ids.compensation is not None for ids in self.chunked.ids):
            # The owners may have written bf16 weights (compensated_param): gathered copies are
            # stale. Every rank comes here: each loads a dict of the same parameters, the same
            # dict or, flattened by torch.distributed.checkpoint, with empty entries for those
            # it does not own (Note [An empty entry is no state]).
            self.dp.parameters_changed()
        if "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # Note [An empty entry is no state]
    # torch.optim keeps `state[p] = {}` for a parameter without state (its step initializes
    # one), so a saved entry {} means none, as a missing entry does (Note [Loading a state dict
    # without a parameter's state]); ours raised "has no 'exp_avg'". torch.distributed.
    # checkpoint's set_state_dict with flatten_optimizer_state_dict=True rebuilds each entry
    # from the keys of `optimizer.state[p]` (Note [The state view lists the state dict's
    # keys]); under data parallelism a rank's view holds the parameters it owns only, so every
    # other parameter's entry comes to it as {}: such a load failed on every rank. Its owner
    # gets the whole entry and loads it.

    # Note [Loading a state dict without a parameter's state]
    # torch's load_state_dict replaces the optimizer's state: a parameter the saved dict has no
    # state for (a state dict saved before the first step, the usual "initial checkpoint") has
    # none afterwards, and its next step starts Adam afresh (step 1, zero moments). The loop
    # above wrote only the saved entries, so such parameters kept the moments and step counts
    # of the training before the load: restoring an initial optimizer state dict trained on
    # with the old moments and bias correction (weights 0.03 away from torch's within two
    # steps). Their state is reset as a new engine holds it (zero chunks: codes and scales of
    # 8-bit state too, so the next step is a new engine's bit for bit).
    def _forget_state(self, indices) -> None:
        manager = self.chunked.chunks.manager
        for index in sorted(indices):
            momentum = self.chunked.ids[index].momentum
            if momentum is None or not self.dp.owns(manager, momentum) or \
                    not self.step_counts[index]:
                continue
            self.step_counts[index] = 0
            for key in moment_state.MOMENT_KEYS:
                stored = moment_state.read_moment(self.chunked, index, key)
                scales = stored.get(moment_state.scale_key(key))
                moment_state.write_moment(self.chunked, index, key, torch.zeros_like(stored[key]),
                                          None if scales is None else torch.zeros_like(scales))

    # Note [Saved groups of another optimizer]
    # A saved group's hyperparameters replace the group's, as in torch. The group of another
    # torch optimizer (SGD's lr 0.5 and momentum) was taken as it was: Adam then trained at
    # SGD's lr without a word (torch's Adam fails at its step, "KeyError: 'betas'"), and an
    # AdamW state dict (decoupled_weight_decay True) loaded into an Adam config, or one with
    # amsgrad on, was trained with the config's update instead of the saved one. The saved
    # groups are checked as initialize() checks torch groups (Note [torch.optim's own group
    # keys]): Adam's keys present and numbers, the update's variant the config's. Keys torch's
    # schedulers add (initial_lr, max_lr, ...) are kept.
    def checked_saved_group(self, number: int, saved: dict, *,
                            refuse_other_type: bool = True) -> dict:
        """Saved param group `number` as a load applies it (without torch's keys of how or
        which update, the config's deciding), after checking it: raises ValueError or
        TypeError naming the key (Note [Saved groups of another optimizer]). Also for
        model.load_checkpoint()'s groups, which pass `refuse_other_type=False`: there, as in
        DeepSpeed, the config's optimizer type decides (a checkpoint converted between
        slicings loads into an engine configured only for it)."""
        if "betas" not in saved:
            raise ValueError(
                f"optimizer state dict: param group {number} has no 'betas' (its keys: "
                f"{sorted(key for key in saved if key != 'params')}): it is not the state "
                f"dict of an Adam or AdamW optimizer, which the PatrickStar optimizer is")
        try:
            saved = _without_torch_keys(
                number, saved, self.decoupled_weight_decay if refuse_other_type else None)
            _check_group_numbers(number, {**self.config.optimizer.group_defaults, **saved})
        except (TypeError, ValueError) as error:
            raise type(error)(f"optimizer state dict: {error}") from None
        return saved

    # Note [Saved optimizer state is numbered by its groups]
    # torch.optim numbers a state dict's parameters as they appear in its param_groups (decay
    # weights first, in nanoGPT's configure_optimizers), and its load_state_dict maps each
    # group's saved numbers onto the group's parameters in order; the numbers themselves mean
    # nothing else, except to torch.distributed.checkpoint, which names them through
    # param_groups. Ours were the engine's parameter indices (the same numbers in one group in
    # the model's order); they are torch's numbers now. Reading a torch-saved dict's numbers as
    # our indices (as load_state_dict did) put a bias's moments into a weight, or, where shapes
    # agreed, into the wrong parameter silently:
    # so load maps through the groups as torch does, and checks every group and shape before
    # it writes anything.
    def _saved_numbering(self, saved_groups, empty: set = frozenset()) -> dict[int, int]:
        params = self.chunked
        to_index = {}
        for number, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            keys = [_saved_key(key) for key in saved["params"]]
            members = group["params"]
            if len(keys) != len(members):  # Note [Saved state of parameters without elements]
                keys = [key for key in keys if key not in empty]
                members = [p for p in members if params.index_of(p) is not None]
            if len(keys) != len(members):
                raise ValueError(
                    f"optimizer state dict: param group {number} has {len(saved['params'])} "
                    f"parameters, the optimizer's has {len(group['params'])} (the groups must "
                    "be made the same way as when it was saved)")
            for key, param in zip(keys, members):
                if params.index_of(param) is not None:
                    to_index[key] = params.index_of(param)
        return to_index

    # Note [Saved state of parameters without elements]
    # A parameter without elements stays outside the chunks and the optimizer's groups
    # (init_context.plan_parameters), while a torch optimizer over `model.parameters()` lists it
    # and, once it has stepped, keeps its (empty) moments: loading that state dict failed with
    # "param group 0 has 5 parameters, the optimizer's has 4". Entries whose moments have no
    # elements are such parameters': their state is dropped (there is nothing to load). The
    # optimizer's groups list them too, as torch's do (the step skips them: they have no
    # chunks), so its state_dict lists them where torch lists them, numbered as torch numbers
    # (each parameter's place in the groups) and, once the optimizer has state, with the empty
    # moments a stepped torch optimizer keeps for them (their step count is the largest of the
    # others': nothing reads it): torch.optim.Adam over `model.parameters()` of the plain model
    # loads it ("a group size mismatch" while they were left out), and
    # torch.distributed.checkpoint, which maps those numbers through param_groups and wants
    # state for every trainable parameter, pairs them with the right names. `optimizer.state`
    # lists them and gives them the same entry (it gave {}, so a loop over each parameter's
    # `optimizer.state[p]["exp_avg"]` raised KeyError there). A saved state dict that leaves
    # them out (the engine's before) is paired with the chunked parameters once its empty
    # entries are dropped.

    # Note [8-bit moments are checked before the load writes]
    # The shape check above let 8-bit codes through (their scales were checked as each moment
    # was written), so codes of another size, or codes without their scales or with too few,
    # failed in the middle of the load: the entries before had been written, the optimizer
    # held half of one state dict and half of another, and too few codes gave torch's "shape
    # '[10]' is invalid for input of size 5". moment_state.check_moment checks each moment as
    # its write will, here, before anything is written; a missing "step" too.
    def _check_saved_shapes(self, state, to_index) -> None:
        params = self.chunked
        for key, entry in state.items():
            if key not in to_index:
                raise ValueError(f"optimizer state dict: state {key!r} belongs to no param "
                                 "group's 'params'")
            index = to_index[key]
            for moment in ("step", *moment_state.MOMENT_KEYS):
                if entry.get(moment) is None:
                    raise ValueError(f"optimizer state dict: state {key} ('{params.names[index]}')"
                                     f" has no {moment!r}")
            # Note [8-bit moments are checked before the load writes]
            for moment in moment_state.MOMENT_KEYS:
                value = entry[moment]
                if value.dtype != torch.uint8:
                    if tuple(value.shape) != params.shapes[index]:
                        raise ValueError(
                            f"optimizer state dict: state {key} maps to '{params.names[index]}' "
                            f"of shape {params.shapes[index]}, but its {moment} has shape "
                            f"{tuple(value.shape)} (parameters in another order than when "
                            f"saved?)")
                    continue
                try:
                    moment_state.check_moment(params.names[index], params.shapes[index], moment,
                                              value, entry.get(moment_state.scale_key(moment)))
                except ValueError as error:
                    raise ValueError(f"optimizer state dict: state {key}: {error}") from None
            for weight in (*self._WEIGHT_KINDS, self._COMPENSATED):
                value = entry.get(weight)
                if value is not None and tuple(value.shape) != params.shapes[index]:
                    raise ValueError(
                        f"optimizer state dict: state {key} maps to '{params.names[index]}' of "
                        f"shape {params.shapes[index]}, but its {weight} has shape "
                        f"{tuple(value.shape)}")


def _empty_entries(state: dict) -> set:
    """The keys of saved state entries whose moments hold no elements (Note [Saved state of
    parameters without elements])."""
    return {key for key, entry in state.items()
            if isinstance(entry, dict) and all(
                isinstance(entry.get(moment), torch.Tensor) and entry[moment].numel() == 0
                for moment in moment_state.MOMENT_KEYS)}


def _saved_key(key):
    """A saved state dict's name for a parameter: torch's numbers (as strings after a JSON round
    trip), or the names torch.distributed.checkpoint's get_state_dict gives (fully qualified
    parameter names); either only pairs the state with the groups' 'params' (Note [Saved
    optimizer state is numbered by its groups])."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _require_number(group: int, key: str, value, whole=None) -> None:
    """Raises unless `value` converts to one float, as the update kernel takes it (a Python
    number, a numpy scalar, a one-element tensor)."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        float(value)
    except (TypeError, ValueError, RuntimeError):
        shown = value if whole is None else whole
        raise TypeError(f"optimizer.param_groups[{group}][{key!r}] is {shown!r} "
                        f"({type(value).__name__}): expected a number; nothing was updated, "
                        f"set it to a number and call optimizer.step() again") from None


def _require_range(group: int, key: str, value, low: float, high: float | None,
                   whole=None) -> None:
    """Raises unless the number `value` is finite, >= low and (with `high`) < high: the update
    kernel's ranges (ValidateAdamHyperParams in kernels/adam.cc), torch.optim.AdamW's too."""
    number = float(value)
    if math.isfinite(number) and number >= low and (high is None or number < high):
        return
    expected = f">= {low:g}" if high is None else f"in [{low:g}, {high:g})"
    shown = value if whole is None else whole
    raise ValueError(f"optimizer.param_groups[{group}][{key!r}] is {shown!r}: expected a finite "
                     f"number {expected}; nothing was updated, set it and call "
                     f"optimizer.step() again")


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), capped at 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
