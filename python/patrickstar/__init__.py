"""PatrickStar-C++: train models larger than GPU memory by keeping parameters, gradients and
optimizer state in chunks that move between GPU memory, host memory and NVMe.

    model, optimizer = patrickstar.initialize(model_func, config={...})
    loss = model(*batch); model.backward(loss); optimizer.step(); optimizer.zero_grad()
"""

import torch  # noqa: F401  (must precede _C, which links against LibTorch)

from . import _C
from ._C import ChunkOutOfMemoryError, ChunkRuntimeError
from .config import Config, load_config

__version__ = "0.1.0"

__all__ = ["ChunkOutOfMemoryError", "ChunkRuntimeError", "Config", "load_config", "initialize",
           "initialize_engine", "__version__"]


def __getattr__(name):
    # The engine imports the chunk bindings; loaded on first use so `import patrickstar` stays
    # cheap for tools that only read reports or configs.
    if name in ("initialize", "initialize_engine", "PatrickStarEngine"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'patrickstar' has no attribute {name!r}")
