"""Checks that turn misuse of the engine into clear errors before any state changes.

Note [Training call order]
The engine expects, per optimizer step, exactly `gradient_accumulation_steps` calls of
`model.backward(loss)` (or `loss.backward()`, Note [loss.backward()] in backward_pass.py) followed by
one `optimizer.step()` (and `zero_grad()`), as a DeepSpeed user writes it. `TrainingGuard`
counts backward calls since the last step:
  * `step()` with no backward since the last step (or zero_grad) has no gradients: as torch's,
    which skips every parameter whose p.grad is None, it changes nothing and counts no
    iteration (Note [A step without gradients] in optimizer.py).
  * `step()` after fewer backward calls than `gradient_accumulation_steps` applies the gradients
    accumulated so far, as PyTorch's `optimizer.step()` does: the epoch-end step of a PyTorch /
    DDP loop, Hugging Face's Trainer and accelerate when an epoch's batch count is not a
    multiple of the accumulation (each loss was divided by the full count, so that update is
    the smaller one those loops make too). Under data parallelism the accumulation is closed
    there first (`close_accumulation`: the ranks' gradients reduced, as at the backward that
    ends a full one); a clip (`clip_grad_norm_`, `clip_grad_value_`) closes it too, since it
    must see the reduced gradients, and a backward after that in the same step is an error
    naming the call. (DeepSpeed's `engine.step()` silently waits for the boundary instead; its
    loop, `model.step()` after every backward, keeps that, counting calls as DeepSpeed does:
    Note [model.step() without a backward] in deepspeed_loop.py.)
  * more backward calls than `gradient_accumulation_steps` before a step is an error when the
    config gives the key (DeepSpeed's contract: that many, then a step) or under data
    parallelism (every backward at the count ends an accumulation: its reduce-scatter has run).
    Without the key on one rank, further backward calls add their gradients into the step's, as
    PyTorch's accumulation loop does (nanoGPT's `for micro_step ...: loss.backward()`, the loss
    divided by the user): Note [PyTorch's accumulation without the key].
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

Note [One thread at a time]
The engine keeps per-call state (which parameters a forward holds, whether a backward is under
way, the step's count) for one caller at a time. Two Python threads calling it at once (an
evaluation thread beside the training loop, two trainers on one engine) shared that state: one
thread's module hooks released parameters the other's forward was using ("The size of tensor
a (0) must match ..."), and a backward stored half its gradients. `TrainingGuard.calling` marks
the thread inside a forward, `model.backward()`, `optimizer.step()` or `zero_grad()`; a call
from another thread meanwhile raises at once, naming both threads and calls, before it changes
anything (never a wait, so no deadlock). The same thread may nest calls (a forward inside a
forward). So may autograd's own threads during a backward (on a GPU, backward runs on a device
thread; a checkpointed block's recomputation calls the forward there): a call made inside an
autograd graph task is part of the backward under way. Calls one after another from different
threads are fine: a loop in a worker thread trains as in the main one.
`loss.backward()` is autograd's call, not the engine's, so it enters no call; a loss.backward()
in one thread while another ran a forward or an optimizer step went on beside that call (its
accesses, gradient stores and end, which releases every access, mixed with the other thread's).
So the backward checks that no other thread is inside a call (`check_no_other_caller`) when the
engine first meets it, before it accesses anything, and again at each gradient store, for a
call another thread began meanwhile (the backward then counts as raised partway, Note
[Training call order]). PyTorch itself lets a backward run beside a forward in another thread;
here the two would share the engine's accesses, so it is refused like two engine calls.
A forward another thread begins in the middle of a loss.backward() is not refused at its start
(the backward holds no call, and the same start is how a forward gives up a loss.backward()
that raised, which on a GPU ran on autograd's device thread, not the user's): it gives the
backward up as raised, naming the backward's thread, so that backward raises at its next store
and the step refuses the gradients it stored until `optimizer.zero_grad()`.
Note [Reads are calls too]: reading or loading the weights or the optimizer state
(`state_dict()`, a parameter's value at rest, `load_state_dict()`, `save_checkpoint()`,
`optimizer.state_dict()`) opens the same chunks a forward or step is using, so it is a call as
well: a monitoring thread's `model.state_dict()` while the trainer thread was inside a forward
failed with "illegal state transition COMPUTE -> COMPUTE" and left the trainer's next forward
failing with "HOLD -> HOLD_AFTER_FWD"; now it raises at once naming both, as a forward would.
At interpreter exit only daemon threads are left (threading joins the others before the exit
hooks run), and a script may end while one of them trains. The exit hook that destroys the
engines (Note [Engine lifetime] in engine.py) first waits for the thread inside a call to
leave it (`quiesce_for_exit`, at most EXIT_WAIT_S, in case that call never ends), and from
then on every call from another thread parks forever instead of running on a destroyed engine:
the interpreter then ends with the daemon thread as it ends plain torch's, silently. Before,
the thread's next call printed "Exception in thread ...: the chunk manager was closed
(model.destroy())" at every such exit.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
import weakref
from typing import Callable, Iterator

import torch

from . import _C
from .config import auto_chunk_floor
from .utils.host_memory import host_memory_limit

__all__ = ["TrainingGuard", "check_budgets", "forked_child_error"]

EXIT_WAIT_S = 30.0  # the longest the exit hook waits for another thread's call (a bound only)


# Note [PyTorch's accumulation without the key]
# A PyTorch loop accumulates by calling backward() several times before optimizer.step(); the
# gradients add up in p.grad. Here they add up in the gradient chunks the same way (a store adds
# to what the chunk holds until zero_grad() or a step clears it), so on one rank nothing but this
# guard stood in the way. With a data-parallel world the backward calls' reductions follow DDP's
# (each backward averages, `no_sync()` skips: Note [Accumulation without the key under data
# parallelism] in data_parallel.py); with pipeline stages or tensor slices as well the count
# decides which backward reduce-scatters (`ends_accumulation`), so there the key is needed and
# its absence stays an error naming it. Where the gradient chunks hold the compute dtype
# (fp16/bf16 without the key: Note [Chunk kinds per precision] in chunked_params.py) the sum is
# taken in that dtype, as a half-precision PyTorch model's p.grad would be; the first such
# backward warns once, naming the key that makes them fp32 accumulators.


def forked_child_error(what: str, owner_pid: int) -> RuntimeError:
    """What a call raises in a process forked from the engine's, `owner_pid` (Note [Training
    call order])."""
    return RuntimeError(
        f"{what}: this PatrickStar engine was built in process {owner_pid}, and this is a "
        f"process forked from it (pid {os.getpid()}): its copy threads, NVMe IO and "
        f"collectives belong to the parent, so a forked child cannot train or read it. Give "
        f"worker processes data rather than the model, or build an engine in the child with "
        f"patrickstar.initialize()")


# Note [Module forwards in a forked child]
# The engine's own calls check the process (check_alive), but a forward of the user's module or
# of a submodule in a forked child (`model.module(x)`, `model.module[0](x)`) reaches the chunks
# through the module hooks alone: it ran on the child's copy of the chunks, or waited forever
# for a move by copy threads that exist only in the parent (an evicting one would write into
# the parent's swap file: Note [Swap files across fork] in runtime/nvme_tier.h). The hooks'
# access runs at every module's forward, so it checks a flag the fork sets on every guard
# (`inherited`) rather than asking the process id each time. So do the calls that read the
# chunks without check_alive: `optimizer.zero_grad()` (every call entered, `enter_call`), the
# clips, the optimizer's state_dict() / load_state_dict() and safe_get_full_grad(); a clip or
# an optimizer.state_dict() in the child read NVMe-resident chunks through the io_uring ring it
# shares with the parent, and the parent died of SIGSEGV.
_every_guard: "weakref.WeakSet[TrainingGuard]" = weakref.WeakSet()


def _mark_inherited() -> None:
    for guard in list(_every_guard):
        guard.inherited = True


os.register_at_fork(after_in_child=_mark_inherited)


class TrainingGuard:
    def __init__(self, config, data_parallel_size: int = 1, model_parallel: bool = False):
        self.accumulation = config.gradient_accumulation_steps
        # Note [PyTorch's accumulation without the key]
        self.open_accumulation = not config.accumulation_given and (
            data_parallel_size == 1 or not model_parallel)
        self.low_precision_sum = config.precision != "fp32" and self.open_accumulation
        self.policy = config.nonfinite_loss
        self.backwards = 0
        self.completed_backwards = 0  # every backward that ended, never reset
        self.closed_by: str | None = None  # the call that closed a short accumulation
        self.skip_step = False
        self.destroyed = False
        self.owner_pid = os.getpid()  # the process whose threads and files the engine uses
        self.inherited = False  # in a forked child: Note [Module forwards in a forked child]
        _every_guard.add(self)
        # What stopped partway (an optimizer.step() or a load_checkpoint()) and what it left.
        self.failed_step: str | None = None
        # A backward that raised after storing gradients (Note [Training call order]).
        self.failed_backward: str | None = None
        # The thread inside a call and how deep (Note [One thread at a time]).
        self._caller_lock = threading.Lock()
        self._caller_left = threading.Condition(self._caller_lock)
        self._caller: tuple[int, str, str] | None = None
        self._calls = 0
        self._exiting: int | None = None  # the thread of the exit hook destroying the engine

    # ---- Note [One thread at a time] -----------------------------------------------------

    def enter_call(self, what: str) -> None:
        """Marks this thread inside `what`; raises if another thread is inside a call."""
        self.check_owner_process(what)
        me = threading.current_thread()
        with self._caller_lock:
            caller = self._caller
            # Another thread than the one inside a call (nested calls of that one pass), and
            # not autograd's during a backward.
            other = (caller is None or caller[0] != me.ident) and \
                torch._C._current_graph_task_id() == -1
            park = other and self._exiting not in (None, me.ident)
            if not park and other and caller is not None:
                raise RuntimeError(
                    f"{what} from thread {me.name!r} while thread {caller[1]!r} is inside "
                    f"{caller[2]}: a PatrickStar engine serves one call at a time (its forward, "
                    f"backward and optimizer step share the engine's state). Call it from one "
                    f"thread, or hold one lock around each forward, backward and step")
            if not park:
                if caller is None:
                    self._caller = (me.ident, me.name, what)
                self._calls += 1
        if park:  # a daemon thread at interpreter exit: it ends with the interpreter
            threading.Event().wait()

    def check_no_other_caller(self, what: str) -> None:
        """Raises if another thread is inside a call: for a backward autograd started
        (`loss.backward()`), which enters no call of its own (Note [One thread at a time])."""
        caller = self._caller  # one read of a tuple: no lock needed to look
        if caller is not None and caller[0] != threading.get_ident():
            me = threading.current_thread()
            raise RuntimeError(
                f"{what} in thread {me.name!r} while thread {caller[1]!r} is inside {caller[2]}: "
                f"a PatrickStar engine serves one call at a time (its forward, backward and "
                f"optimizer step share the engine's state). Call it from one thread, or hold one "
                f"lock around each forward, backward and step")

    def leave_call(self) -> None:
        with self._caller_lock:
            self._calls -= 1
            if self._calls == 0:
                self._caller = None
                self._caller_left.notify_all()

    def quiesce_for_exit(self) -> None:
        """At interpreter exit: waits for another thread's call under way to end; later calls
        from other threads park (this thread's go on, and meet the destroyed engine's error)."""
        if not self.in_owner_process():  # a forked child: the threads are the parent's
            return
        me = threading.get_ident()
        with self._caller_left:
            self._exiting = me
            self._caller_left.wait_for(
                lambda: self._caller is None or self._caller[0] == me, EXIT_WAIT_S)

    @contextlib.contextmanager
    def calling(self, what: str) -> Iterator[None]:
        self.enter_call(what)
        try:
            yield
        finally:
            self.leave_call()

    def check_owner_process(self, what: str) -> None:
        """Raises in a process forked from the engine's: Note [Module forwards in a forked
        child] (its calls that read chunks the module hooks or the optimizer reach directly)."""
        if self.inherited:
            raise forked_child_error(what, self.owner_pid)

    def in_owner_process(self) -> bool:
        """False in a process forked from the one that built the engine."""
        return os.getpid() == self.owner_pid

    def check_alive(self, what: str) -> None:
        self.check_not_deleted(what)
        if self.failed_step is not None:
            raise RuntimeError(f"{what}: an earlier {self.failed_step}. Load the last "
                               f"checkpoint (model.load_checkpoint) to go on")

    def check_not_deleted(self, what: str) -> None:
        """check_alive without the failed step: for reads and loads of the state, which a
        failed step does not forbid."""
        if not self.in_owner_process():
            raise forked_child_error(what, self.owner_pid)
        if self.destroyed and self._exiting is not None:
            # Note [Engine lifetime] in engine.py: atexit runs the last registered first.
            raise RuntimeError(
                f"{what}: this PatrickStar engine was destroyed at interpreter exit by "
                f"patrickstar's exit hook (so that its swap files and threads do not outlive "
                f"the process). atexit runs the last registered function first, and that hook "
                f"is registered at `import patrickstar`: register an exit function that uses "
                f"the engine after `import patrickstar`")
        if self.destroyed:
            raise RuntimeError(f"{what}: this PatrickStar engine was deleted or destroyed (`del "
                               f"model` or model.destroy()); "
                               f"its chunks are freed. Build a new one with "
                               f"patrickstar.initialize()")

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
        if self.closed_by is not None:
            raise RuntimeError(
                f"{what} after {self.closed_by} in the same step: under data parallelism it "
                f"closed the accumulation after {self.backwards} of {self.accumulation} "
                f"backward() calls (the ranks' gradients were reduced for it), so no gradient "
                f"can join this step any more; call optimizer.step() and optimizer.zero_grad() "
                f"first, or call {self.closed_by} after the step's last backward")
        if self.backwards >= self.accumulation:
            if self.open_accumulation:  # Note [PyTorch's accumulation without the key]
                self._warn_low_precision_sum(what)
                return
            raise RuntimeError(
                f"{what} called {self.backwards + 1} times since the last "
                f"optimizer.step(), but gradient_accumulation_steps is {self.accumulation}: "
                f"call optimizer.step() and optimizer.zero_grad() after every "
                f"{self.accumulation} backward() call(s) (optimizer.zero_grad() alone drops "
                f"the gradients), or raise the config key gradient_accumulation_steps (DDP's "
                f"`with model.no_sync():` micro-steps need it too: the engine reduces at the "
                f"backward that completes it, and model.no_sync() changes nothing)")

    def _warn_low_precision_sum(self, what: str) -> None:
        if not self.low_precision_sum:
            return
        self.low_precision_sum = False  # once per engine
        warnings.warn(
            f"{what} called {self.backwards + 1} times since the last optimizer.step(): the "
            f"gradients are summed in the compute dtype's gradient chunks (as a half-precision "
            f"PyTorch model's p.grad). Give the config key gradient_accumulation_steps (the "
            f"number of backward() calls per step) for fp32 accumulation",
            stacklevel=3)

    def after_backward(self) -> None:
        self.backwards += 1
        self.completed_backwards += 1

    @property
    def in_accumulation(self) -> bool:
        """Between the first and the last backward of a step's accumulation (and not closed
        early by `close_accumulation`)."""
        return 0 < self.backwards < self.accumulation and self.closed_by is None

    def close_accumulation(self, what: str) -> None:
        """`what` (a step or a clip under data parallelism) ends this step's accumulation
        before its last backward (Note [Training call order])."""
        self.closed_by = what

    @property
    def ends_accumulation(self) -> bool:
        """Whether the backward under way (counted only at its end) completes the step's
        `gradient_accumulation_steps`."""
        return self.backwards + 1 >= self.accumulation

    def discard_backwards(self) -> int:
        """The gradients were dropped (`optimizer.zero_grad()`): the next backward is the first
        of a step. Returns how many backward calls were dropped, a backward that raised after
        storing gradients among them."""
        dropped = self.backwards + (self.failed_backward is not None)
        self.backwards, self.skip_step = 0, False
        self.closed_by = None
        self.failed_backward = None
        return dropped

    def check_step_allowed(self) -> None:
        """The checks of every optimizer.step(), one without gradients too."""
        self.check_alive("optimizer.step()")
        self._check_no_failed_backward("optimizer.step()")

    def before_step(self) -> bool:
        """False when the step must be skipped (a skipped non-finite loss in it)."""
        self.check_step_allowed()
        return not self.skip_step

    def after_step(self) -> None:
        self.backwards = 0
        self.closed_by = None
        self.skip_step = False


# Note [Padding chunks are not memory]
# Under data parallelism the layout pads each chunk list to whole groups and gives an oversize
# tensor's group world_size - 1 empty chunks of its size (Note [Oversize groups] in
# chunk/chunk_layout.h). The layout lists them with the bytes a payload would take, but they
# never get one, on any rank. Counted as memory, a 2-rank run of a model with oversize tensors
# (an embedding larger than the chunk) was refused host budgets it trains within: the rank that
# owns an embedding's padding was charged that embedding's optimizer state, and initialization
# every padding chunk of the compute list. The budget checks and the profile's model data count
# the chunks that hold tensors.
def has_payload(chunk: dict) -> bool:
    """Whether a layout chunk (layout_json()'s) is memory: it holds tensors (Note [Padding
    chunks are not memory])."""
    return bool(chunk.get("tensors"))


def _chunks_per_tensor(layout: dict) -> tuple[dict, dict, dict]:
    """(tensor name -> chunk id, chunk id -> bytes, kind -> bytes of all its chunks that are
    memory)."""
    chunk_of, chunk_bytes, per_kind = {}, {}, {}
    for chunk in layout["chunks"]:
        chunk_bytes[chunk["id"]] = chunk["bytes"]
        if has_payload(chunk):
            per_kind[chunk["kind"]] = per_kind.get(chunk["kind"], 0) + chunk["bytes"]
        for tensor in chunk["tensors"]:
            chunk_of[tensor["name"]] = chunk["id"]
    return chunk_of, chunk_bytes, per_kind


def _fmt(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.2f} MiB)"


# Note [Budgets a smaller chunk would meet]
# Chunks are allocated whole, so a small model in the default 64Mi-element chunks takes 256 MiB
# per chunk kind: the README's quick start with a host budget of 256 MiB refused a 1,089-
# parameter model for its 512 MiB of Adam state, and the message offered more budget, an NVMe
# tier or 8-bit moments, never the chunk size, which is what had made the state that large
# (the device check's message named it). Where the compute chunks are mostly empty, the host
# checks' messages name the size too.
def _chunk_size_hint(config, layout: dict) -> str:
    """A sentence naming default_chunk_size when the parameters fill under half of their
    chunks, else ""."""
    compute = [chunk for chunk in layout["chunks"]
               if chunk["kind"] == "compute_param" and has_payload(chunk)]
    parameters = sum(tensor["numel"] for chunk in compute for tensor in chunk["tensors"])
    capacity = len(compute) * config.default_chunk_size
    if capacity == 0 or 2 * parameters >= capacity:
        return ""
    auto = (" (or \"auto\")" if config.default_chunk_size > auto_chunk_floor(
        layout.get("world_size", 1)) else "")
    return (f"; the model's {parameters} parameters fill {100 * parameters / capacity:.2g}% of "
            f"their {len(compute)} chunk(s) of default_chunk_size={config.default_chunk_size} "
            f"elements (chunks are allocated whole): a smaller default_chunk_size{auto} needs "
            f"less")


def check_budgets(config, manager_json: str, names: list[str], trainable: list[bool],
                  pins, device_is_host_memory: bool = False) -> None:
    """Refuses, before any chunk is allocated, budgets that no placement can satisfy: the
    device must hold what backward pins at once and a gradient chunk (`pins`, a
    backward_pins.BackwardPins: Note [What backward pins]), the host the chunks one Adam update
    touches at once, and without an NVMe tier device plus host must hold every chunk that
    always has a payload."""
    memory = config.memory
    layout = json.loads(manager_json)
    chunk_of, chunk_bytes, per_kind = _chunks_per_tensor(layout)
    has_grad = {name for name, train in zip(names, trainable) if train}
    # Parameters no module walk reaches (Note [Parameters no hook saw] in init_context.py)
    # count with the others of their name's module.
    moments = [(m.what, m.pinned, m.stored) for m in pins.moments]
    reached = set().union(*(m.pinned for m in pins.moments))
    unreached: dict[str, list[str]] = {}
    for name in names:
        if name not in reached:
            unreached.setdefault(name.rpartition(".")[0], []).append(name)
    moments += [(f"module '{module or '<root>'}'", members, members)
                for module, members in unreached.items()]
    device_need = host_need = 0
    device_who = host_who = ""
    for what, pinned, stored in moments:
        compute = {chunk_of[name] for name in pinned if name in chunk_of}
        grads = [chunk_bytes[chunk_of[f"{n}#grad"]] for n in stored
                 if n in has_grad and f"{n}#grad" in chunk_of]
        need = sum(chunk_bytes[c] for c in compute) + max(grads, default=0)
        if need > device_need:
            device_need, device_who = need, what
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
            f"the chunks backward holds on the device at once at {device_who} (the compute "
            f"chunks pinned then, its ancestors' with parameters of their own included, and "
            f"one gradient chunk; Note [What backward pins]): {_fmt(device_need)} {where}")
    # Initialization writes every parameter's fp32 copy (master, or compute in fp32) on the host;
    # without an NVMe tier to spill them to, they must all fit there (Note [Initialization under
    # a host budget] in init_context.py).
    init_need = per_kind.get("master_param", 0) or per_kind.get("compute_param", 0)
    if memory.nvme.path is None and memory.host_budget is not None \
            and memory.host_budget < init_need:
        raise _C.ChunkOutOfMemoryError(
            f"config key 'memory.host_budget' = {_fmt(memory.host_budget)} is smaller than the "
            f"fp32 parameter chunks initialization writes on the host: {_fmt(init_need)}, and "
            f"there is no NVMe tier (memory.nvme.path) to spill them to"
            f"{_chunk_size_hint(config, layout)}")
    # Note [Chunks larger than the machine]
    # Chunks are allocated whole, so the host holds default_chunk_size elements per chunk at
    # initialization however small the model: a chunk size typed with a few zeros too many
    # (10**12) for a 72-parameter model made initialize() allocate terabytes, and without a host
    # budget nothing stopped it before the kernel's OOM killer ended the process (and, on a
    # shared machine, possibly others) with no message. Without a host budget or an NVMe tier
    # the host's memory is the bound: what initialization must write beyond it is refused.
    limit = host_memory_limit()
    if memory.nvme.path is None and memory.host_budget is None and limit is not None \
            and init_need > limit[0]:
        parameters = sum(tensor["numel"] for chunk in layout["chunks"]
                         if chunk["kind"] == "compute_param" for tensor in chunk["tensors"])
        raise _C.ChunkOutOfMemoryError(
            f"the fp32 parameter chunks initialization writes on the host, {_fmt(init_need)}, "
            f"are more than {limit[1]}, {_fmt(limit[0])}, and there is no NVMe tier "
            f"(memory.nvme.path) to spill them to: chunks are allocated whole, "
            f"default_chunk_size={config.default_chunk_size} elements each (the model has "
            f"{parameters} parameters here); lower default_chunk_size, or add an NVMe tier and "
            f"a memory.host_budget")
    # Note [Optimizer state stays on the host]
    # The optimizer makes its moments (and their 8-bit scales) on the host tier at the first
    # step (Note [Optimizer sweep] in optimizer.py), and eviction only goes down the hierarchy,
    # so without an NVMe tier every moment chunk this process owns lives on the host from then
    # on; so do the masters and Kahan compensations where the device tier is host memory (a
    # CPU build: nothing brings them to the device). A host budget between the initialization
    # figure above and this one passed initialize() and failed at the first optimizer.step()
    # ("... it is the last tier, with nowhere to evict to"): the figure
    # estimate_memory() prints as "host: optimizer step" was knowable here.
    state_kinds = {"momentum", "variance", "momentum_scale", "variance_scale"}
    if device_is_host_memory:
        state_kinds |= {"master_param", "param_compensation"}
    state_chunks = [chunk for chunk in layout["chunks"] if chunk["kind"] in state_kinds
                    and chunk.get("owner_rank", 0) == layout.get("rank", 0)
                    and has_payload(chunk)]
    state_need = sum(chunk["bytes"] for chunk in state_chunks)
    present = {chunk["kind"] for chunk in state_chunks}
    extra = "".join(label for kind, label in (("master_param", ", fp32 masters"),
                                              ("param_compensation", ", Kahan compensations"))
                    if kind in present)
    if memory.nvme.path is None and memory.host_budget is not None \
            and memory.host_budget < state_need:
        raise _C.ChunkOutOfMemoryError(
            f"config key 'memory.host_budget' = {_fmt(memory.host_budget)} is smaller than the "
            f"optimizer state this process keeps on the host once optimizer.step() has run: "
            f"{_fmt(state_need)} (Adam's momentum and variance chunks{extra}), and there is no "
            f"NVMe tier (memory.nvme.path) to spill it to; raise memory.host_budget above it "
            f"(non-model data placed on the host, such as activations on a CPU build, comes on "
            f"top), add an NVMe tier, or keep the moments in fewer bytes (optimizer params "
            f"\"state_dtype\": \"bf16\" or \"int8\"){_chunk_size_hint(config, layout)}")
    # With an NVMe tier of a given size, the same state has the host and NVMe between them.
    if memory.nvme.path is not None and memory.nvme.budget and memory.host_budget is not None \
            and memory.host_budget + memory.nvme.budget < state_need:
        raise _C.ChunkOutOfMemoryError(
            f"config keys 'memory.host_budget' + 'memory.nvme.budget' = "
            f"{_fmt(memory.host_budget + memory.nvme.budget)} cannot hold the optimizer state "
            f"this process keeps in host memory or on NVMe once optimizer.step() has run: "
            f"{_fmt(state_need)} (Adam's momentum and variance chunks{extra}); raise "
            f"memory.nvme.budget (or leave it out: the filesystem's free space), or keep the "
            f"moments in fewer bytes (optimizer params \"state_dtype\": \"bf16\" or \"int8\")"
            f"{_chunk_size_hint(config, layout)}")
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
                f"NVMe tier (memory.nvme.path) to spill to{_chunk_size_hint(config, layout)}")
