"""Checks that turn misuse of the engine into clear errors before any state changes.

Note [Training call order]
The engine expects, per optimizer step, exactly `gradient_accumulation_steps` calls of
`model.backward(loss)` (or `loss.backward()`, Note [loss.backward()] in backward_pass.py) followed by
one `optimizer.step()` (and `zero_grad()`), as a DeepSpeed user writes it. `TrainingGuard`
counts backward calls since the last step:
  * `step()` with no backward since the last step is an error (there are no gradients; a
    silent no-op would hide a broken loop), and so is `step()` after fewer backward calls than
    `gradient_accumulation_steps` (the loss was divided by that number, so the update would be
    too small). DeepSpeed's `engine.step()` silently waits for the boundary instead; our step
    is the user's `optimizer.step()`, called once per boundary, so a mismatch is a bug.
  * more backward calls than `gradient_accumulation_steps` before a step is an error: without
    accumulation a second backward would add a second batch's gradients into the first's.
  * `optimizer.zero_grad()` between steps drops the gradients and the count with them (as in
    PyTorch, where it starts a fresh accumulation): a GAN's discriminator, whose gradients from
    the generator's loss are computed and dropped, and a loop that abandons a partial
    accumulation go on with the next backward as the first of a step.
  * the count, skipped backwards included, is also what says which backward ends an
    accumulation (`ends_accumulation`, data parallelism's reduce-scatter boundary): a count kept
    elsewhere missed the skipped ones and moved every later boundary under data parallelism.
  * a non-finite loss in fp32/bf16 (fp16 has the loss scaler for that) is checked before its
    backward runs: `nonfinite_loss: "raise"` (default) raises `FloatingPointError` and leaves
    parameters, gradients and optimizer state as they were; `"skip"` drops the loss and turns
    the coming `optimizer.step()` into a skipped step (counted in `optimizer.skipped_steps`),
    like an fp16 overflow. Under data parallelism the ranks agree first (a small all-reduce of
    the flags per backward): if any rank's loss is non-finite, every rank raises, or every rank
    skips, so none misses a collective the others run.
In a process forked from the one that built the engine (os.fork, a multiprocessing or
DataLoader worker) every call raises too: the copy threads and NVMe IO are the parent's, so a
forward there waited forever for a copy nobody makes (Note [Swap files across fork] in
runtime/nvme_tier.h for what the child's exit must leave alone).
After `model.destroy()` every call raises instead of touching freed chunk memory, and after a
`load_checkpoint()` whose restore failed partway (the checks before it change nothing), or an
`optimizer.step()` that failed partway (an NVMe read or write-back error, Note [Optimizer sweep]
in engine.py) every training call raises until `model.load_checkpoint()` restores a consistent
state: the rows updated before the failure would otherwise mix two steps.
A backward that raised after storing some gradients (Ctrl-C, an error in a backward hook; found
probing a week-long run) is not counted, but what it stored stays in the gradient chunks, added
to the step's: the next step would apply it on top of the next batch's gradients, silently. So
the next backward and step raise, naming it, until `optimizer.zero_grad()` drops the gradients
(and with them the step's accumulation so far; gradients cannot be told apart by backward).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch

from . import _C

__all__ = ["TrainingGuard", "check_budgets"]


class TrainingGuard:
    def __init__(self, config):
        self.accumulation = config.gradient_accumulation_steps
        self.policy = config.nonfinite_loss
        self.backwards = 0
        self.skip_step = False
        self.destroyed = False
        self.owner_pid = os.getpid()  # the process whose threads and files the engine uses
        # What stopped partway (an optimizer.step() or a load_checkpoint()) and what it left.
        self.failed_step: str | None = None
        # A backward that raised after storing gradients (Note [Training call order]).
        self.failed_backward: str | None = None

    def in_owner_process(self) -> bool:
        """False in a process forked from the one that built the engine."""
        return os.getpid() == self.owner_pid

    def check_alive(self, what: str) -> None:
        if not self.in_owner_process():
            raise RuntimeError(
                f"{what}: this PatrickStar engine was built in process {self.owner_pid}, and "
                f"this is a process forked from it (pid {os.getpid()}): its copy threads and "
                f"NVMe IO belong to the parent, so a forked child cannot train or read it. Give "
                f"worker processes data rather than the model, or build an engine in the child "
                f"with patrickstar.initialize()")
        if self.destroyed:
            raise RuntimeError(f"{what}: this PatrickStar engine was destroyed (model.destroy()); "
                               f"its chunks are freed. Build a new one with "
                               f"patrickstar.initialize()")
        if self.failed_step is not None:
            raise RuntimeError(f"{what}: an earlier {self.failed_step}. Load the last "
                               f"checkpoint (model.load_checkpoint) to go on")

    def step_failed(self, error: BaseException) -> None:
        self.failed_step = (f"optimizer.step() failed partway ({type(error).__name__}: "
                            f"{error}); some parameters were updated and others not")
        self.backwards = 0
        self.skip_step = False

    def load_failed(self, error: BaseException) -> None:
        """A restore stopped after changing some state: nothing may train on that mix."""
        self.failed_step = (f"load_checkpoint() failed partway ({type(error).__name__}: "
                            f"{error}); the engine holds part of that checkpoint and part of "
                            f"its earlier state")
        self.backwards = 0
        self.skip_step = False

    def before_backward(self, loss: torch.Tensor, precision: str,
                        nonfinite_ranks: Callable[[bool], list[int]] | None = None) -> bool:
        """False when this backward must be skipped (non-finite loss, policy "skip").

        `nonfinite_ranks(flag)` (data parallelism: a collective) returns the ranks whose loss
        is non-finite, so every rank decides the same: a rank that skipped its backward alone
        would miss the others' reduce-scatters and hang them."""
        self.check_backward_allowed("model.backward()")
        if precision == "fp16":  # the loss scaler handles overflow
            return True
        bad = not bool(torch.isfinite(loss.detach()).all())
        ranks = nonfinite_ranks(bad) if nonfinite_ranks is not None else ([0] if bad else [])
        if ranks:
            where = f"the loss is {loss.item()}" if bad else \
                f"the loss of rank(s) {ranks} is not finite"
            if nonfinite_ranks is not None and bad:
                where += f" on rank(s) {ranks}"
            if self.policy == "raise":
                raise FloatingPointError(
                    f"model.backward(): {where} ({precision} training); nothing was changed. "
                    f"Set the config key nonfinite_loss to \"skip\" to skip such steps instead")
            self.skip_step = True
            self.backwards += 1
            return False
        return True

    def backward_failed(self, what: str, error: BaseException | None, stored: int) -> None:
        cause = "" if error is None else f" ({type(error).__name__}: {error})"
        self.failed_backward = (
            f"an earlier {what} raised partway{cause} after storing {stored} gradient(s), which "
            f"are still in the gradient chunks and would be added to this step's: call "
            f"optimizer.zero_grad() first (it drops this step's gradients so far too)")

    def _check_no_failed_backward(self, what: str) -> None:
        if self.failed_backward is not None:
            raise RuntimeError(f"{what}: {self.failed_backward}")

    def check_backward_allowed(self, what: str) -> None:
        """The checks of every backward, also one the user started with `loss.backward()`
        (Note [loss.backward()] in backward_pass.py), which has no loss to check."""
        self.check_alive(what)
        self._check_no_failed_backward(what)
        if self.backwards >= self.accumulation:
            raise RuntimeError(
                f"{what} called {self.backwards + 1} times since the last "
                f"optimizer.step(), but gradient_accumulation_steps is {self.accumulation}: "
                f"call optimizer.step() and optimizer.zero_grad() after every "
                f"{self.accumulation} backward() call(s) (optimizer.zero_grad() alone drops "
                f"the gradients), or raise the config key gradient_accumulation_steps (DDP's "
                f"`with model.no_sync():` micro-steps need it too: the engine reduces at the "
                f"backward that completes it, and model.no_sync() changes nothing)")

    def after_backward(self) -> None:
        self.backwards += 1

    @property
    def in_accumulation(self) -> bool:
        """Between the first and the last backward of a step's accumulation."""
        return 0 < self.backwards < self.accumulation

    @property
    def ends_accumulation(self) -> bool:
        """Whether the backward under way (counted only at its end) completes the step's
        `gradient_accumulation_steps`."""
        return self.backwards + 1 >= self.accumulation

    def discard_backwards(self) -> int:
        """The gradients were dropped (`optimizer.zero_grad()`): the next backward is the first
        of a step. Returns how many backward calls were dropped."""
        dropped, self.backwards, self.skip_step = self.backwards, 0, False
        self.failed_backward = None
        return dropped

    def before_step(self) -> bool:
        """False when the step must be skipped (a skipped non-finite loss in it)."""
        self.check_alive("optimizer.step()")
        self._check_no_failed_backward("optimizer.step()")
        if self.backwards == 0:
            raise RuntimeError("optimizer.step() called before model.backward(loss) (or "
                               "loss.backward()): there are no gradients for this step")
        if self.backwards < self.accumulation:
            raise RuntimeError(
                f"optimizer.step() after {self.backwards} of {self.accumulation} backward() "
                f"calls of this step (gradient_accumulation_steps = {self.accumulation}): "
                f"call model.backward() {self.accumulation - self.backwards} more time(s) first. "
                f"A shorter last accumulation (an epoch whose batch count is not a multiple of "
                f"it, which DDP loops, Hugging Face's Trainer and accelerate step anyway) is not "
                f"supported: drop it with optimizer.zero_grad(), or give every epoch a multiple "
                f"of {self.accumulation} batches")
        return not self.skip_step

    def after_step(self) -> None:
        self.backwards = 0
        self.skip_step = False


def _chunks_per_tensor(layout: dict) -> tuple[dict, dict, dict]:
    """(tensor name -> chunk id, chunk id -> bytes, kind -> bytes of all its chunks)."""
    chunk_of, chunk_bytes, per_kind = {}, {}, {}
    for chunk in layout["chunks"]:
        chunk_bytes[chunk["id"]] = chunk["bytes"]
        per_kind[chunk["kind"]] = per_kind.get(chunk["kind"], 0) + chunk["bytes"]
        for tensor in chunk["tensors"]:
            chunk_of[tensor["name"]] = chunk["id"]
    return chunk_of, chunk_bytes, per_kind


def _fmt(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.2f} MiB)"


def check_budgets(config, manager_json: str, names: list[str], trainable: list[bool],
                  device_is_host_memory: bool = False) -> None:
    """Refuses, before any chunk is allocated, budgets that no placement can satisfy: the
    device must hold a module's compute chunks and a gradient chunk at once (its backward),
    the host the chunks one Adam update touches at once, and without an NVMe tier device plus
    host must hold every chunk that always has a payload."""
    memory = config.memory
    layout = json.loads(manager_json)
    chunk_of, chunk_bytes, per_kind = _chunks_per_tensor(layout)
    # A module's backward holds the compute chunks of all its own parameters while each
    # gradient chunk is accessed in turn (the post-accumulate-grad hook).
    modules: dict[str, list[str]] = {}
    for name in names:
        modules.setdefault(name.rpartition(".")[0], []).append(name)
    device_need = host_need = 0
    device_who = host_who = ""
    for module, members in modules.items():
        compute = {chunk_of[name] for name in members}
        grads = [chunk_bytes[chunk_of[f"{n}#grad"]] for n, t in zip(names, trainable)
                 if t and n in members]
        need = sum(chunk_bytes[c] for c in compute) + max(grads, default=0)
        if need > device_need:
            device_need, device_who = need, module or "<root>"
    for name, train in zip(names, trainable):
        if train:
            # Note [Optimizer sweep] in optimizer.py: where the device tier is host memory the
            # update reads parameters and gradients where they are; only state comes to the host.
            parts = ["momentum", "variance", "momentum_scale", "variance_scale", "master",
                     "compensation"]  # those the parameter has
            chunks = {chunk_of[f"{name}#{p}"] for p in parts if f"{name}#{p}" in chunk_of}
            if not device_is_host_memory:
                chunks |= {chunk_of[name], chunk_of[f"{name}#grad"]}
            host = sum(chunk_bytes[c] for c in chunks)
            if host > host_need:
                host_need, host_who = host, name
    where = (f"(default_chunk_size={config.default_chunk_size} elements; lower it or raise the "
             f"budget)")
    if memory.device_budget is not None and memory.device_budget < device_need:
        raise _C.ChunkOutOfMemoryError(
            f"config key 'memory.device_budget' = {_fmt(memory.device_budget)} is smaller than "
            f"the chunks module '{device_who}' needs on the device at once in its backward "
            f"(the compute chunks of its parameters and one gradient chunk): "
            f"{_fmt(device_need)} {where}")
    # Initialization writes every parameter's fp32 copy (master, or compute in fp32) on the host;
    # without an NVMe tier to spill them to, they must all fit there (Note [Initialization under
    # a host budget] in init_context.py).
    init_need = per_kind.get("master_param", 0) or per_kind.get("compute_param", 0)
    if memory.nvme.path is None and memory.host_budget is not None \
            and memory.host_budget < init_need:
        raise _C.ChunkOutOfMemoryError(
            f"config key 'memory.host_budget' = {_fmt(memory.host_budget)} is smaller than the "
            f"fp32 parameter chunks initialization writes on the host: {_fmt(init_need)}, and "
            f"there is no NVMe tier (memory.nvme.path) to spill them to")
    if memory.host_budget is not None and memory.host_budget < host_need:
        raise _C.ChunkOutOfMemoryError(
            f"config key 'memory.host_budget' = {_fmt(memory.host_budget)} is smaller than the "
            f"chunks one Adam update of '{host_who}' holds on the host at once: "
            f"{_fmt(host_need)} {where}")
    if memory.nvme.path is None and memory.host_budget is not None \
            and memory.device_budget is not None:
        resident = sum(v for k, v in per_kind.items() if k != "gradient")
        if memory.host_budget + memory.device_budget < resident:
            raise _C.ChunkOutOfMemoryError(
                f"config keys 'memory.device_budget' + 'memory.host_budget' = "
                f"{_fmt(memory.device_budget + memory.host_budget)} cannot hold the "
                f"{_fmt(resident)} of parameter and optimizer-state chunks, and there is no "
                f"NVMe tier (memory.nvme.path) to spill to")
