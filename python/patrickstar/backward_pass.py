"""The engine's bookkeeping of one backward: the one started by `model.backward(loss)` and the one
autograd starts on `loss.backward()` (joined at the engine's first event inside it), how it ends,
what a backward that raised leaves behind, and the order of the gradient hooks at its start.

The engine owns the parameters, their chunks and the gradient hooks' stores; a BackwardPass owns
only whether a backward is under way and what it has stored so far, and it is handed what it
calls at the backward's start and end (the guard, the data-parallel side, the release of every
access, the engine's micro-step counter).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn


class BackwardPass:
    """Whether a backward is under way, and the gradients it stored (guards.py counts them)."""

    def __init__(self, guard, dp, precision: str, release_all: Callable[[], None],
                 counted: Callable[[], None], starting: Callable[[], None]):
        self._guard = guard
        # Note [fp16 loss.backward() scales at the engine's outputs]: set by the engine
        self.scaled_at_output: Callable[[], bool] = lambda: False
        self._dp = dp
        self._precision = precision
        self._starting = starting  # what the gradients need before new ones add to them
        self._release_all = release_all  # every access given back after a backward
        self._counted = counted  # the engine's micro-step moves on
        self.in_backward = False  # Note [loss.backward()]
        self._stored_grads = 0  # gradients stored by the backward under way (guards.py)
        self._stored_params: set[int] = set()  # and whose (Note [A second gradient in one ...])
        self._autograd_unchecked = False  # joined, no gradient stored yet
        self._joined = False  # a loss.backward() is under way (not model.backward())
        self._joined_thread: threading.Thread | None = None  # where, if a Python thread
        self._grad_hooks: list[tuple[nn.Parameter, int]] = []  # Note [User gradient hooks]
        self._grad_hook_handles: list = []
        # Note [The running sum in a user's gradient hook]: each parameter's hook that puts the
        # gradients stored earlier in the window into p.grad, made at its first user hook.
        self._sum_hook_makers: list[Callable[[], Callable]] = []
        self._sum_hook_ids: dict[int, int] = {}  # index in _grad_hooks -> hook id

    def in_model_backward(self) -> bool:
        """`model.backward(loss)` is under way (not a loss.backward() this pass joined)."""
        return self.in_backward and not self._joined

    def register_grad_hook(self, param: nn.Parameter, hook: Callable,
                           sum_hook: Callable[[], Callable]) -> None:
        """The engine's post-accumulate-grad hook of `param`, kept behind the user's, and the
        maker of the one kept in front of them (Note [The running sum in a user's gradient
        hook])."""
        handle = param.register_post_accumulate_grad_hook(hook)
        self._grad_hooks.append((param, handle.id))
        self._grad_hook_handles.append(handle)
        self._sum_hook_makers.append(sum_hook)

    def remove_grad_hooks(self) -> None:
        """The engine's gradient hooks off its parameters (which drop every p.grad once the
        engine is gone): Note [A built module given back when initialize() fails]."""
        for handle in self._grad_hook_handles:
            handle.remove()
        self._grad_hook_handles.clear()
        self._grad_hooks.clear()
        self._sum_hook_makers.clear()
        self._sum_hook_ids.clear()

    def run(self, tensors, grads, retain_graph: bool = False) -> None:
        """`model.backward(loss)`: autograd from `tensors` (the scaled loss), then the end."""
        self._keep_grad_hooks_last()
        self.in_backward = True
        self._stored_grads = 0
        self._stored_params.clear()
        self._starting()
        self._dp.before_backward()
        try:
            if tensors:
                torch.autograd.backward(tensors, grads, retain_graph=retain_graph)
        except BaseException as error:
            self.raised(error, "model.backward()")
            raise
        finally:
            # Modules whose inputs need no grad never see their post-backward hook. The flag
            # drops after the release (Note [A backward cut short before its release]).
            self._release_all()
            self.in_backward = False
        self._end()

    # Note [A backward cut short before its release]
    # A signal handled as the release above was entered (a second Ctrl-C, the first having
    # ended autograd, or one arriving as autograd returned) left every access of the backward
    # in COMPUTE with `in_backward` already dropped, so nothing knew: zero_grad() and
    # load_checkpoint() went through, and the next forward failed "illegal state transition
    # COMPUTE -> COMPUTE", as did every one after it. With the flag dropped only after the
    # release, such a backward is one that raised before its end, which the next forward,
    # zero_grad() or step() settles (forget_raised_autograd_backward: its gradients refused
    # until zero_grad(), its accesses released).

    # Note [Autocast's cast cache]
    # Inside `torch.autocast` torch caches each parameter's cast (bf16 weight.to(...)) until
    # the outermost autocast region exits, so a loop written inside one region (forward,
    # backward and optimizer.step all under it) reuses the casts of its first forward in
    # later iterations. For a plain model those casts are stale after a step (autocast's
    # documentation asks for the region around the forward only); here the reused cast also
    # brings back the earlier graph's cast node, whose backward met the parameter holding its
    # placeholder and failed with a shape error. Each backward's end therefore drops the cache:
    # the next forward casts the current weights, exactly as with autocast entered per step.
    # Casts that graphs still hold are theirs; dropping the cache changes no value, and the
    # cache of other models in the region refills at their next cast.
    @staticmethod
    def _forget_autocast_casts() -> None:
        torch.clear_autocast_cache()

    def _end(self) -> None:
        self._forget_autocast_casts()
        self._dp.after_backward()  # reads guard.ends_accumulation: before the count moves on
        self._guard.after_backward()
        self._counted()

    # Note [loss.backward()]
    # PyTorch users write `loss.backward()`; DeepSpeed's and upstream PatrickStar's users write
    # `model.backward(loss)`. Both work. A backward the user started through autograd is noticed
    # at the engine's first parameter access inside an autograd graph task (a module's
    # pre-backward hook, the recomputation of a checkpointed block, or a saved parameter
    # unpacked): that access runs what model.backward() runs before autograd (the call-order
    # checks, the data-parallel backward schedule) and queues the end of model.backward()
    # (release, count, the last reduce-scatters) as an autograd callback, which runs when the
    # graph task finishes, still inside loss.backward(). What loss.backward() cannot do:
    #  * scale the loss. fp16 scales the gradient entering the engine's outputs instead (Note
    #    [fp16 loss.backward() scales at the engine's outputs] in output_loss_scale.py); with
    #    gradient_accumulation_steps the user divides the loss, as in a PyTorch accumulation
    #    loop (model.backward divides by itself).
    #  * check the loss for NaN/inf before the backward (config nonfinite_loss): there is no
    #    loss to look at. Non-finite gradients are then the user's, as in PyTorch.
    # A graph task that stores no gradient is not a training backward: torch.autograd.grad (a
    # gradient penalty, input gradients) runs the same hooks but accumulates nothing. So the
    # call-order checks run when the first gradient is about to be stored, and a graph task
    # that stored none ends with the release only, uncounted.
    # A loss.backward() that raised before its end leaves no callback; the next forward
    # releases what it held (forget_raised_autograd_backward).
    def join_autograd_backward(self) -> None:
        if self.in_backward or torch._C._current_graph_task_id() == -1:
            return
        self._guard.check_alive("loss.backward()")
        # Before any access: Note [One thread at a time] in guards.py
        self._guard.check_no_other_caller("loss.backward()")
        self._keep_grad_hooks_last()
        self.in_backward = True
        self._autograd_unchecked = self._joined = True
        # autograd's own device threads are no Python thread the user started (_DummyThread)
        here = threading.current_thread()
        self._joined_thread = None if isinstance(here, threading._DummyThread) else here
        self._stored_grads = 0
        self._stored_params.clear()
        # Note [Calls between a read and its serving] in data_parallel.py
        self._dp.agree_on_training_call(self._dp.BACKWARD)
        self._starting()
        self._dp.before_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_autograd_backward)

    def before_storing_grad(self) -> None:
        """A gradient hook has a gradient to store (joins a loss.backward(), checks it)."""
        self.join_autograd_backward()
        if self._autograd_unchecked:
            try:
                if self._precision == "fp16" and not self.scaled_at_output():
                    raise RuntimeError(
                        "loss.backward() in fp16 training reached the parameters without "
                        "passing the engine's outputs, where the dynamic loss scale is applied "
                        "(a forward of model.module or of a submodule rather than of the "
                        "engine): call the engine (model(...)), or call model.backward(loss), "
                        "which scales the loss itself (without the scale small fp16 gradients "
                        "underflow to zero)")
                self._guard.check_backward_allowed("loss.backward()")
            except BaseException:
                self._abandon()  # nothing stored: the engine is as before this backward
                raise
            self._autograd_unchecked = False
        elif self._joined:  # a call another thread began during this backward
            self._guard.check_no_other_caller("loss.backward()")

    # Note [A second gradient in one backward]
    # Torch runs a parameter's post-accumulate-grad hook once per backward, when every use of it
    # has been differentiated, and data parallelism builds on that: the engine ends the
    # parameter's access there, and reduce-scatters its gradient group (releasing the group
    # with resharding) once each of the group's parameters got its gradient. A reentrant
    # `torch.utils.checkpoint(fn, ..., use_reentrant=True)` differentiates its recomputation in
    # a backward of its own, so a parameter used both inside `fn` and outside it gets two
    # gradients, each in its own graph task: the second came after its group was reduce-
    # scattered, and failed inside the chunk store ("has 1 tensors in COMPUTE there and cannot
    # move"; with resharding the recomputation already met the released group). torch's DDP
    # raises too there unless given static_graph=True. So under data parallelism a second
    # gradient of one parameter in one backward raises naming the parameter and
    # use_reentrant=False (the recomputation then runs inside the same backward). On one process
    # the store adds it to the first, as in PyTorch.
    def refuse_second_grad(self, index: int, name: str) -> None:
        """Before a gradient of parameter `index` (`name`) is stored: Note [A second gradient
        in one backward]."""
        if index in self._stored_params and self._dp.enabled:
            raise RuntimeError(
                f"data parallel: parameter '{name}' got a second gradient in one backward: a "
                f"reentrant torch.utils.checkpoint(..., use_reentrant=True) (or "
                f"checkpoint_sequential) differentiates its recomputation in a backward of its "
                f"own, and the parameter is used both inside it and outside it (torch's DDP "
                f"needs static_graph=True there). Each rank reduce-scatters a parameter's "
                f"gradient once per backward, when every use is differentiated: pass "
                f"use_reentrant=False, which recomputes inside the same backward")

    def count_stored_grad(self, index: int) -> None:
        """Right before a gradient's store: counted first, since the store may add half of it."""
        self._stored_grads += 1
        self._stored_params.add(index)

    # Note [A loss.backward() that raised, met by the optimizer]
    # A loss.backward() that raised (an error in a backward hook, Ctrl-C) leaves no callback,
    # so only the engine's next call can tell. That was the next forward only: PyTorch's
    # `try: loss.backward() except ...: optimizer.zero_grad()` dropped the gradients, yet the
    # next forward then found the raised backward and demanded a zero_grad() again, and a step
    # in an accumulation applied the earlier micro-steps' gradients plus the part the raised
    # backward stored. So optimizer.zero_grad() and optimizer.step() settle it first too, unless
    # they are called from inside a backward (a user's gradient hook), which is still running.
    def settle_raised_autograd_backward(self, call: str = "optimizer.zero_grad()",
                                        set_to_none: bool = True) -> None:
        """At optimizer.zero_grad() or optimizer.step() (`call`): forget_raised_autograd_backward()
        outside autograd's graph tasks; inside this engine's backward (a user's gradient hook)
        Note [The optimizer inside a gradient hook]."""
        if torch._C._current_graph_task_id() == -1:
            self.forget_raised_autograd_backward()
        elif self.in_backward:
            self._optimizer_in_hook(call, set_to_none)

    # Note [The optimizer inside a gradient hook]
    # PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass"
    # steps and zeroes optimizers inside post-accumulate-grad hooks, and users drop gradients
    # there (`optimizer.zero_grad()` when a gradient is found bad). torch's zero_grad sets every
    # p.grad to None, the one being accumulated included, so the step after the backward
    # applies only the gradients accumulated after it. Here the hook's own gradient was still
    # in p.grad, outside the chunks the zero_grad dropped, and the engine's hook stored it
    # after the user's: the step applied a gradient torch had dropped, silently. A zero_grad()
    # inside this engine's backward therefore also drops what autograd holds in p.grad
    # (set_to_none=False zeroes it, as torch's does, and the zeros are then stored). The
    # engine's optimizer.step() there is refused: its update reads and writes the chunks the
    # backward is computing with (the compute weights of layers still to differentiate, which
    # torch's fused recipe updates only after their last use), and the gradient of the hook's
    # parameter is not stored yet; and fusing saves no memory here, since the engine already
    # moves each gradient out of torch's memory into its chunk as it is made. torch optimizers
    # over the engine's parameters are refused at their step as anywhere (torch_optimizers.py,
    # which names the recipe when stepped in a backward). Under data parallelism the
    # zero_grad() there raises too: the ranks reduce-scatter each group as its gradients come,
    # which a drop part way through would leave waiting for gradients that never come.
    def _optimizer_in_hook(self, call: str, set_to_none: bool) -> None:
        if call == "optimizer.step()":
            raise RuntimeError(
                "optimizer.step() of the PatrickStar engine inside its backward (a "
                "post-accumulate-grad hook: the optimizer-in-backward recipe): the step updates "
                "the chunks the backward still computes with, and the engine already moves each "
                "gradient out of torch's memory into its chunk as it is made, so fusing the step "
                "into the backward saves no memory. Call optimizer.step() (then "
                "optimizer.zero_grad()) after loss.backward() returns; a hook may still change "
                "or drop gradients (p.grad.mul_(...), optimizer.zero_grad())")
        if self._dp.enabled:
            raise RuntimeError(
                f"{call} inside the engine's backward (a post-accumulate-grad hook) under data "
                f"parallelism: each rank reduce-scatters the gradients of a group as they are "
                f"made, so gradients cannot be dropped part way through a backward. Call it "
                f"after loss.backward() returns, or leave the part out of the loss")
        with torch._C.DisableTorchFunctionSubclass():  # torch's own p.grad, resting or not
            for param, _ in self._grad_hooks:
                grad = param.grad
                if grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    grad.detach_().zero_()

    def forget_raised_autograd_backward(self) -> None:
        """At a forward, optimizer.zero_grad() or optimizer.step(): a loss.backward() that
        raised before its end is given up."""
        if self.in_backward:
            what = "loss.backward()"
            other = self._joined_thread
            if other is not None and other is not threading.current_thread():
                # Perhaps not raised but still running there: Note [One thread at a time]
                what = (f"loss.backward() in thread {other.name!r} (or was it still running "
                        f"when thread {threading.current_thread().name!r} began model(...)? "
                        f"one thread at a time)")
            self.raised(None, what)
            self._abandon()

    def raised(self, error: BaseException | None, what: str) -> None:
        """A backward ended by an exception (Ctrl-C, an error in a backward hook) after it
        stored gradients: they stay in the chunks, added to the step's, but the backward is not
        counted (Note [Training call order] in guards.py)."""
        try:
            self._drop_stranded_grads()
            self._dp.backward_raised()  # Note [A backward that raised under data parallelism]
        finally:
            if self._stored_grads:
                self._guard.backward_failed(what, error, self._stored_grads)
            self._stored_grads = 0

    # Note [Gradients stranded in p.grad]
    # Autograd accumulates a parameter's gradient into `p.grad`, and the engine's
    # post-accumulate-grad hook moves it into its chunk and sets `p.grad` to None. A backward
    # that raised between the two (Ctrl-C: Python raises it at the next bytecode, often the
    # entry of that hook; or a user's post-accumulate-grad hook, which runs first) left the
    # gradient in `p.grad`, where no zero_grad() looked (the engine's gradients are never
    # there), and the next backward's autograd added its own to it: that parameter then
    # trained on the sum of two batches' gradients, silently. What a raised backward leaves
    # in `p.grad` never reached a chunk: dropping it is dropping that part of the failed
    # backward, whose stored part the step refuses until zero_grad() as before.
    def _drop_stranded_grads(self) -> None:
        for param, _ in self._grad_hooks:
            if param.grad is not None:
                param.grad = None

    def _abandon(self) -> None:
        self.in_backward = self._autograd_unchecked = self._joined = False
        self._forget_autocast_casts()
        self._release_all()

    def _end_autograd_backward(self) -> None:
        self.in_backward = self._joined = False
        self._release_all()
        if self._autograd_unchecked:  # no gradient stored: torch.autograd.grad
            self._autograd_unchecked = False
            self._forget_autocast_casts()
            return
        self._end()

    # Note [User gradient hooks]
    # The engine takes each gradient out of `p.grad` into its chunk in a post-accumulate-grad
    # hook and sets `p.grad` to None. torch runs a parameter's post-accumulate-grad hooks in
    # registration order, so a user's registered after initialize() (a gradient logger, the
    # optimizer-in-backward recipe, a per-parameter clip) ran after the engine's and found
    # None, and one changing `p.grad` changed nothing. Each backward therefore starts by moving
    # the engine's hook behind any the user added since (`p.register_hook` tensor hooks run
    # before accumulation and need nothing). torch calls the hooks from a snapshot of the
    # dict's values, so the move must come before the backward, not inside it: model.backward
    # does it before autograd runs, loss.backward() at the engine's first event in the graph
    # task (a module's pre-backward, before any of that module's gradients accumulate). Under
    # accumulation the user's hooks see torch's running sum: Note [The running sum in a user's
    # gradient hook].
    def _keep_grad_hooks_last(self) -> None:
        for position, (param, hook_id) in enumerate(self._grad_hooks):
            hooks = param._post_accumulate_grad_hooks
            if hooks is None or len(hooks) == 1:
                continue
            if next(reversed(hooks)) != hook_id:
                hooks[hook_id] = hooks.pop(hook_id)  # to the end of the dict's own order too
            self._keep_sum_hook_first(position, param, hooks)

    # Note [The running sum in a user's gradient hook]
    # Under gradient accumulation torch's p.grad holds the running sum of the window's
    # gradients, so a user's post-accumulate-grad hook sees (and scales, clips, logs, drops) that
    # sum. Here each backward's gradient came alone into p.grad, the earlier ones being in the
    # chunk: a hook halving p.grad halved only the last backward's part, and one logging its
    # norm logged the last batch's. A parameter with user hooks therefore also gets an engine
    # hook in front of them, which adds the gradient stored earlier in the window to p.grad (in
    # p.grad's dtype, the parameter's, as torch accumulates); the engine's hook behind them
    # then stores p.grad in place of the chunk's gradient instead of adding to it, and a hook
    # that set p.grad to None drops the chunk's too (PatrickStarEngine._make_sum_hook). A sum
    # no hook changed (a logger: the same tensor at the same version) is not stored: the
    # backward's own gradient is added as without hooks, so fp32 accumulators (config
    # gradient_accumulation_steps in bf16/fp16) keep their precision; a sum a hook changed is
    # stored as torch's p.grad holds it, in the parameter's dtype. A parameter without user
    # hooks has neither, so a backward costs what it did. Under data parallelism the chunk
    # holds reduced shards, not this rank's running sum, so the hooks there still see each
    # backward's own gradient (README).
    def _keep_sum_hook_first(self, position: int, param, hooks) -> None:
        sum_id = self._sum_hook_ids.get(position)
        if sum_id is None or sum_id not in hooks:
            handle = param.register_post_accumulate_grad_hook(self._sum_hook_makers[position]())
            self._grad_hook_handles.append(handle)
            sum_id = self._sum_hook_ids[position] = handle.id
        if next(iter(hooks)) != sum_id:
            # torch walks the dict's own insertion order (PyDict_Next), not an OrderedDict's
            # move_to_end order: the others are inserted again behind it.
            for key in [key for key in hooks if key != sum_id]:
                hooks[key] = hooks.pop(key)
