"""`module.zero_grad()` on the user's module or a part of it.

Note [Module zero_grad]
PyTorch drops gradients with `optimizer.zero_grad()` or with `module.zero_grad()`: the whole
model's (`model.module.zero_grad()`, a loop that never names its optimizer there) or a part's (a
GAN's `netD.zero_grad()` dropping the discriminator's gradients of the generator's loss, a frozen
encoder's gradients dropped before the step). torch's Module.zero_grad sets `p.grad` of each
parameter, and an engine's gradients live in chunks (`p.grad` is None), so it dropped nothing:
the step then used gradients PyTorch had discarded, silently. `install()` (run by
`initialize()`) wraps Module.zero_grad once: after torch's own, the engine's parameters among
the module's lose their chunked gradients too. The module's parameters being all of an
engine's, it is `optimizer.zero_grad()` (the backward calls made so far are dropped with the
gradients: Note [Training call order] in guards.py); a part of them drops only that part's
gradients, and the step still counts the backward calls made (a rank's gradient chunks under
data parallelism hold reduced shards of every parameter, so a part is refused there). The
engine itself defines its own zero_grad, which stays as it is.
"""
from __future__ import annotations

import functools

from torch import nn

from .param_owners import engine_of

__all__ = ["install"]

_TORCH_ZERO_GRAD = nn.Module.zero_grad


@functools.wraps(_TORCH_ZERO_GRAD)
def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    _TORCH_ZERO_GRAD(self, set_to_none)
    by_engine: dict[int, tuple[object, list]] = {}
    for param in self.parameters():
        engine = engine_of(param)
        if engine is not None:
            by_engine.setdefault(id(engine), (engine, []))[1].append(param)
    for engine, params in by_engine.values():
        engine.drop_gradients(params, set_to_none)


def install() -> None:
    """Puts the wrapper where every module looks it up (idempotent)."""
    nn.Module.zero_grad = zero_grad
