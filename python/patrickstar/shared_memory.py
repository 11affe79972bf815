"""`share_memory()` of an engine or of a module holding its parameters.

Note [share_memory() of an engine's parameters]
`model.share_memory()` moves a module's tensors into shared memory so that processes started
afterwards (Hogwild training with torch.multiprocessing, an evaluator process) read and write
the same weights. An engine's parameters hold an empty placeholder between uses; their values
live in chunks of the engine's runtime, which are not shared: torch's call only shared the
placeholder and the buffers, and returned as if the weights were shared, so another process
went on with a copy the engine never updates, without a word. `install()` (run by
`initialize()`) wraps nn.Module.share_memory so that a module holding an engine's parameters
(the engine, `model.module` or one of its submodules) raises first, before any tensor moves,
naming what works instead; any other module reaches torch unchanged.
"""
from __future__ import annotations

import functools

from torch import nn

from .param_owners import qualified_name

__all__ = ["install"]

_TORCH_SHARE_MEMORY = nn.Module.share_memory


@functools.wraps(_TORCH_SHARE_MEMORY)
def share_memory(self):
    for param in self.parameters():
        qualified = qualified_name(param)
        if qualified is None:
            continue
        raise ValueError(
            f"{type(self).__name__}.share_memory(): parameter 'module.{qualified}' (and every "
            f"other PatrickStar parameter) keeps its values in chunks of the engine's runtime, "
            f"which cannot be moved to shared memory for other processes (Hogwild training "
            f"with torch.multiprocessing). Train in several processes with torchrun (chunked "
            f"data parallelism), or give another process the weights as values: "
            f"model.state_dict(), or copy.deepcopy(model.module) (a plain module you may "
            f"share_memory())")
    return _TORCH_SHARE_MEMORY(self)


def install() -> None:
    """Puts the wrapper on nn.Module (idempotent)."""
    nn.Module.share_memory = share_memory
