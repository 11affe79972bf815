"""PatrickStar-C++: train models larger than GPU memory by keeping parameters, gradients and
optimizer state in chunks that move between GPU memory, host memory and NVMe.

    model, optimizer = patrickstar.initialize(model_func, config={...})
    loss = model(*batch); model.backward(loss); optimizer.step(); optimizer.zero_grad()
"""

import torch  # noqa: F401  (must precede _C, which links against LibTorch)

from . import _C, _upstream
from ._C import ChunkOutOfMemoryError, ChunkRuntimeError
from .config import Config, load_config
from .engine import PatrickStarEngine
from .estimator import estimate_memory
from .external_params import register_external_parameter, unregister_external_parameter
from .full_grad import safe_get_full_grad
from .initializer import initialize, initialize_engine
from .profiling.recorder import Profiler, profile

__version__ = "0.1.0"

_upstream.install()  # upstream-only module names fail with what to use instead

__all__ = ["ChunkOutOfMemoryError", "ChunkRuntimeError", "Config", "PatrickStarEngine",
           "Profiler", "estimate_memory", "initialize", "initialize_engine", "load_config",
           "profile", "register_external_parameter", "safe_get_full_grad",
           "unregister_external_parameter", "__version__"]
