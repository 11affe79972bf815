"""What DeepSpeed's `engine.step()` does besides the optimizer step: the lr scheduler, and the
counters its loop reads (`is_gradient_accumulation_boundary()`, `was_step_applied()`,
`get_global_grad_norm()`).

Note [model.step() steps model.lr_scheduler]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In DeepSpeed, `engine.lr_scheduler` (given to `deepspeed.initialize(lr_scheduler=...)` or
assigned) is stepped by `engine.step()` after every optimizer step that was applied, and not
after one skipped for fp16 overflow; the user never calls `scheduler.step()`. Before, our
`model.step()` ran only the optimizer, so a DeepSpeed script that assigned `model.lr_scheduler`
(as our own docs told it to, for checkpoints) trained at its initial learning rate for ever,
silently. Now `model.step()` steps `model.lr_scheduler` as DeepSpeed does. PatrickStar's loop
(`optimizer.step()` called directly) is unchanged: there the user steps the scheduler.

The danger of that rule is a scheduler stepped twice per optimizer step (by `model.step()` and
by the user's own `scheduler.step()`, a habit from plain PyTorch), which would silently run the
schedule at twice its speed. The scheduler's position is remembered after each step we make;
finding it moved at the next boundary means someone else stepped it, and that raises before
the optimizer steps. Positions are torch's `last_epoch` or DeepSpeed's `last_batch_iteration`;
a scheduler with neither is not checked.

Note [A configured scheduler in PatrickStar's loop]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A scheduler built from the config's DeepSpeed `scheduler` section has no line in the script
that steps it: under DeepSpeed's loop `model.step()` does, but a script calling
`optimizer.step()` directly (PatrickStar's loop) would train at the schedule's first rate for
ever, silently. We do not step it inside `optimizer.step()`: there a torch user's own
`scheduler.step()` would double it, and `optimizer.step()` would differ between a configured
scheduler and an assigned one. Instead the rule stays "in PatrickStar's loop you step the
scheduler" and is checked: at each direct `optimizer.step()` after the first, the configured
scheduler must have moved exactly one position since the previous one (zero is also allowed
after a step skipped for fp16 overflow, where DeepSpeed does not step it), else it raises
before the optimizer steps, saying to call `model.lr_scheduler.step()` or to use
`model.step()`. A scheduler the user assigned is theirs and is not checked this way.

Note [model.step(lr_kwargs)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DeepSpeed's `engine.step(lr_kwargs=None)` passes `lr_kwargs` to the scheduler's `step()`: a
ReduceLROnPlateau (torch's, or Hugging Face's `get_scheduler("reduce_lr_on_plateau", ...)`)
given as `initialize(lr_scheduler=...)` steps by `model.step(lr_kwargs={"metrics": loss})`.
Without the argument that loop could not train such a scheduler at all (`model.step()` took no
argument), and a call without the metric failed in torch's `step()` after the optimizer had
stepped. Such a call is now refused before the optimizer steps, naming the argument.
"""
from __future__ import annotations

import weakref

import torch


class GradNorm(float):
    """get_global_grad_norm()'s value (Note [The grad norm answers item()]).

    Note [The grad norm answers item()]
    DeepSpeed documents get_global_grad_norm() as a float, but under ZeRO it returns a 0-dim
    tensor, and scripts rely on either: `f"{norm:.3f}"`, `json.dumps`, `math.isfinite(norm)`, or
    `metrics["grad_norm"] = model.get_global_grad_norm().item()`. Our plain float failed the last
    with AttributeError; a tensor would fail json.dumps. So the value is a float that also has
    `item()`. A checkpoint's client_state saves it as a plain float (plain_data.to_plain), and
    torch.load(weights_only=True) of the user's own files accepts it (a safe global)."""

    def item(self) -> float:
        return float(self)

    @classmethod
    def of(cls, norm: float | None) -> "GradNorm | None":
        return None if norm is None else cls(norm)


torch.serialization.add_safe_globals([GradNorm])


def _position(scheduler):
    for name in ("last_epoch", "last_batch_iteration"):
        value = getattr(scheduler, name, None)
        if isinstance(value, int):
            return value
    return None


class EngineLrScheduler:
    """The scheduler `model.step()` steps (Note [model.step() steps model.lr_scheduler])."""

    def __init__(self):
        self.scheduler = None
        self._position = None  # where our last step left it; None: not stepped by us yet
        self.configured = False  # built from the config's `scheduler` section
        # Note [A configured scheduler in PatrickStar's loop]: the position at the last direct
        # optimizer.step() and whether that step was applied (None: no direct step yet).
        self._direct: tuple[int, bool] | None = None

    def set(self, scheduler, configured: bool = False) -> None:
        """`configured`: built from the config's `scheduler` section."""
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"model.lr_scheduler must be a learning-rate scheduler with a step() "
                            f"method (a torch.optim.lr_scheduler scheduler built on the "
                            f"optimizer initialize() returned), not {type(scheduler).__name__}")
        self.scheduler = scheduler
        self._position = None
        self.configured = configured
        self._direct = None

    def forget_position(self) -> None:
        """After load_checkpoint(): the scheduler's position is the checkpoint's now."""
        self._position = None
        self._direct = None

    def check_not_stepped_elsewhere(self) -> None:
        """Before an optimizer step of model.step(): nobody else stepped the scheduler."""
        if self.scheduler is None or self._position is None:
            return
        now = _position(self.scheduler)
        if now is not None and now != self._position:
            raise RuntimeError(
                f"model.lr_scheduler was stepped outside model.step() (its position moved from "
                f"{self._position} to {now}): model.step() steps model.lr_scheduler after each "
                f"optimizer step, as DeepSpeed's engine.step() does, so the schedule would run "
                f"twice as fast. Remove your own scheduler.step() call (or call "
                f"optimizer.step() instead of model.step() and step the scheduler yourself)")

    def before_direct_optimizer_step(self) -> None:
        """Before `optimizer.step()` called outside `model.step()` (Note [A configured scheduler
        in PatrickStar's loop])."""
        if not self.configured:
            return
        # The user steps it in this loop, so model.step()'s check restarts from its next step.
        self._position = None
        if self._direct is None:
            return
        before, applied = self._direct
        now = _position(self.scheduler)
        moved = now - before
        if moved == 1 or (moved == 0 and not applied):
            return
        kind = type(self.scheduler).__name__
        if moved == 0:
            raise RuntimeError(
                f"model.lr_scheduler ({kind}, built from the config's 'scheduler' section) was "
                f"not stepped after the last optimizer.step(), so the learning rate would not "
                f"follow the schedule: call model.lr_scheduler.step() after each "
                f"optimizer.step(), or use DeepSpeed's loop (model.backward(loss); "
                f"model.step()), whose model.step() steps it")
        raise RuntimeError(
            f"model.lr_scheduler ({kind}, built from the config's 'scheduler' section) was "
            f"stepped {moved} times since the last optimizer.step() (position {before} to "
            f"{now}); step it once per optimizer step")

    def after_direct_optimizer_step(self, applied: bool) -> None:
        if self.configured:
            self._direct = (_position(self.scheduler), applied)

    def check_step_arguments(self, lr_kwargs: dict | None) -> None:
        """Before the optimizer steps (Note [model.step(lr_kwargs)])."""
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise TypeError(f"model.step(lr_kwargs=...): a dict of keyword arguments for "
                            f"model.lr_scheduler.step(), not {type(lr_kwargs).__name__}")
        plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and "metrics" not in (lr_kwargs or {}):
            raise TypeError("model.step(): model.lr_scheduler is a ReduceLROnPlateau, whose "
                            "step() needs the metric it watches: call model.step(lr_kwargs="
                            "{'metrics': value}) at least at the accumulation boundary "
                            "(DeepSpeed's argument); nothing was stepped")

    def after_optimizer_step(self, applied: bool, lr_kwargs: dict | None = None) -> None:
        if self.scheduler is None or not applied:  # DeepSpeed skips it on fp16 overflow
            return
        self.scheduler.step(**(lr_kwargs or {}))
        self._position = _position(self.scheduler)
        self._direct = None  # DeepSpeed's loop stepped it


class DeepSpeedLoop:
    """The state of DeepSpeed's loop on an engine: `model.step()` (its optimizer step at the
    accumulation boundary, then the scheduler), whether the current micro-step is the boundary,
    whether the last step was applied, and `lr_schedule`, the scheduler it steps. `guard` is
    the engine's TrainingGuard (backwards, accumulation); `attach(optimizer, count_step)` once
    the optimizer exists."""

    def __init__(self, guard):
        self.lr_schedule = EngineLrScheduler()
        self._guard = guard
        self._optimizer = None
        self._count_step = None  # see attach()
        self._in_model_step = False  # optimizer.step() called by model.step()
        self._backwards_at_model_step = 0  # guard.backwards when model.step() last ran
        self._model_steps = 0  # model.step() calls since the last optimizer step
        self.micro_steps = 0  # DeepSpeed's engine.micro_steps: every model.step() call
        self._step_applied = False
        self._without_gradients = False  # the last optimizer step had no gradients

    def attach(self, optimizer, count_step) -> None:
        """`count_step()` counts an optimizer step of model.step() that had no gradients as one
        of the engine's steps (Note [model.step() without a backward])."""
        # Weakly: the optimizer holds this loop's hooks, and a cycle would keep both until the
        # collector ran (Note [Engine lifetime] in engine.py).
        self._optimizer = weakref.ref(optimizer)
        self._count_step = count_step

    # Note [model.step() without a backward]
    # DeepSpeed's engine.step() counts its calls (micro_steps), not the backwards: every
    # gradient_accumulation_steps-th call is the boundary, where it steps the optimizer with
    # whatever gradients there are, zeroes them, counts the step (global_steps, global_samples)
    # and steps the lr scheduler unless fp16 overflowed; every other call sets
    # was_step_applied() False. Ours raised "model.step() called before model.backward(loss)"
    # at a call with no backward (a batch skipped after its forward, with `continue` after the
    # step, as DeepSpeed scripts keep their micro-step count aligned). Now a call without a
    # backward is a micro-step too: the boundary is the call that completes the accumulation
    # by backwards or by calls, whichever comes first (both, in the usual loop of one backward
    # per call). Its optimizer step without gradients changes nothing, as torch's (Note [A
    # step without gradients] in optimizer.py), but as in DeepSpeed it counts as a step
    # (global_steps, the default checkpoint tag), steps the lr scheduler and was_step_applied()
    # answers True. model.step() zeroes the gradients after its optimizer step as DeepSpeed's
    # does, so such a call after it is not mistaken for a second step over consumed gradients;
    # a boundary call with no backward after a direct optimizer.step() not followed by
    # zero_grad() (two loops mixed) still raises, in that optimizer.step() (whose check agrees
    # over the ranks after the step's agreement on the call).
    def step(self, lr_kwargs: dict | None = None) -> None:
        """The engine's `model.step()` (its docstring says what DeepSpeed's does)."""
        guard = self._guard
        guard.check_alive("model.step()")
        optimizer = self._optimizer()
        self._step_applied = False  # DeepSpeed's, until this call steps
        self._backwards_at_model_step = guard.backwards
        self._model_steps += 1
        if max(guard.backwards, self._model_steps) >= guard.accumulation:
            self.lr_schedule.check_step_arguments(lr_kwargs)
            self.lr_schedule.check_not_stepped_elsewhere()
            self._in_model_step = True
            try:
                optimizer.step()  # sets _step_applied (after_optimizer_step)
            finally:
                self._in_model_step = False
            optimizer.zero_grad()  # as DeepSpeed's _take_model_step
            self._backwards_at_model_step = 0
            if self._without_gradients:  # Note [model.step() without a backward]
                self._count_step()
                self._step_applied = True
            self.lr_schedule.after_optimizer_step(self._step_applied, lr_kwargs)
        self.micro_steps += 1  # at the end, as DeepSpeed's (not after a step that raised)

    def restart_accumulation(self) -> None:
        """The gradients were dropped by a load_checkpoint(): the next call is the first
        micro-step of a step."""
        self._model_steps = 0
        self._backwards_at_model_step = 0

    def before_optimizer_step(self) -> None:
        """Called by every optimizer.step(), model.step()'s or the user's."""
        if not self._in_model_step:  # PatrickStar's loop
            self.lr_schedule.before_direct_optimizer_step()

    def after_optimizer_step(self, applied: bool, without_gradients: bool = False) -> None:
        """`applied`: False when the step was skipped (fp16 overflow) or had no gradients
        (`without_gradients`)."""
        # Also in PatrickStar's loop: was_step_applied() answered False after every
        # optimizer.step() called directly, applied or not.
        self._step_applied = applied
        self._without_gradients = without_gradients
        self._model_steps = 0
        if not self._in_model_step:
            self.lr_schedule.after_direct_optimizer_step(applied)

    def is_gradient_accumulation_boundary(self) -> bool:
        backwards = self._guard.backwards
        if backwards < self._backwards_at_model_step:  # optimizer.step() reset the count
            self._backwards_at_model_step = 0
        # A backward since the last model.step() belongs to the current micro-step.
        done_before = backwards - 1 if backwards > self._backwards_at_model_step else backwards
        # Calls of model.step() without a backward are micro-steps too (Note [model.step()
        # without a backward]).
        return max(done_before, self._model_steps) + 1 >= self._guard.accumulation

    def was_step_applied(self) -> bool:
        return self._step_applied
