"""torch optimizers built over an engine's parameters.

Note [torch optimizers over an engine's parameters]
A user porting a loop may keep building an optimizer of their own: nanoGPT's
`model.configure_optimizers(...)` (reached through the engine's attribute forwarding),
`torch.optim.AdamW(model.parameters(), ...)`. An engine's gradients live in chunks (`p.grad` is
None) and its parameters hold placeholders between uses, so such an optimizer skips every
parameter: training would silently change nothing. `install()` (run by `initialize()`) adds
one global optimizer step pre-hook that raises at the first step of an optimizer other than
the engine's own that holds an engine's parameter, naming it and the optimizer to use. The
verdict is cached per optimizer and its parameter count, so other optimizers pay for the check
once.
"""
from __future__ import annotations

import weakref

import torch

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .param_owners import engine_of, qualified_name

__all__ = ["install"]

_handle = None
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def _parameter_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


# Note [The optimizer inside a gradient hook] in backward_pass.py: what a step inside a backward
# (the optimizer-in-backward recipe) is told besides.
_IN_BACKWARD = (
    ". Stepped inside a backward (PyTorch's optimizer-in-backward recipe, one optimizer per "
    "parameter stepped in a post-accumulate-grad hook): the engine already moves each gradient "
    "out of torch's memory into its chunk as it is made, so the recipe saves nothing here. "
    "Remove those hooks and optimizers, and call the engine's optimizer.step() and "
    "optimizer.zero_grad() after loss.backward() returns")


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    count = _parameter_count(optimizer)
    if _checked.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            engine = engine_of(param)
            if engine is None or engine.optimizer is optimizer:
                continue
            name = qualified_name(param)
            raise RuntimeError(
                f"{type(optimizer).__module__}.{type(optimizer).__name__} holds parameters of "
                f"a PatrickStar engine (e.g. 'module.{name}'): their gradients live in the "
                f"engine's chunks, so it would update nothing. Use the optimizer "
                f"patrickstar.initialize() returns (set its type and hyperparameters with the "
                f"config's \"optimizer\" key; parameter groups with param_groups=)"
                + (_IN_BACKWARD if torch._C._current_graph_task_id() != -1 else ""))
    _checked[optimizer] = count


def install() -> None:
    """Registers the check once per process (idempotent)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_before_step)
