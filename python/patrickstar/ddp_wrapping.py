"""torch's DistributedDataParallel around the user's module of an engine.

Note [DDP around an engine's module]
Under torchrun, accelerate's `prepare(model.module, ...)` (and a script's own
`DDP(model.module)`) wraps the user's module in torch's DistributedDataParallel, whose
constructor broadcasts rank 0's parameters into each rank's; the parameters live in the
engine's chunks, and the constructor failed deep inside with "parameter ... was assigned new
data (p.data = ...) while it was not in use", naming neither DDP nor accelerate. The engine is
data-parallel itself, and accelerate leaves an engine given to `prepare()` as it is (Note [The
engine is prepared for accelerate] in engine.py), so the wrap can only be refused: `install()`
wraps the constructor once, and a module holding an engine's parameters raises there, naming
what to pass instead. The engine itself inside DDP is refused at its first forward
(engine._refuse_wrapping_data_parallel); other modules go to torch's constructor untouched.
"""
from __future__ import annotations

import functools

from torch import nn

from .param_owners import engine_of, qualified_name

__all__ = ["install"]

_DDP = nn.parallel.DistributedDataParallel
_TORCH_INIT = _DDP.__init__
_engine_types: tuple = ()  # the engine's class, from install()


def _engine_parameter(module) -> str | None:
    """The name of a parameter of `module` that belongs to a live engine, or None (also for
    the engine itself, which its forward refuses)."""
    if isinstance(module, _engine_types):
        return None
    for param in module.parameters():
        if engine_of(param) is not None:
            return qualified_name(param) or "?"
    return None


@functools.wraps(_TORCH_INIT)
def _init(self, module, *args, **kwargs):
    name = _engine_parameter(module)
    if name is not None:
        raise RuntimeError(
            f"torch DistributedDataParallel around a module whose parameters live in a "
            f"PatrickStar engine's chunks (e.g. '{name}'): the engine already trains "
            f"data-parallel over the torchrun ranks. Train the engine itself, unwrapped: with "
            f"accelerate, pass the engine to accelerator.prepare() (it leaves the engine as it "
            f"is), not model.module; without it, drop the DDP(...) wrapper")
    return _TORCH_INIT(self, module, *args, **kwargs)


def install(engine_type: type) -> None:
    """Puts the wrapper on torch's class (idempotent); `engine_type` is the engine's class."""
    global _engine_types
    _engine_types = (engine_type,)
    _DDP.__init__ = _init
