"""PatrickStar-C++: train models larger than GPU memory by keeping parameters, gradients and
optimizer state in chunks that move between GPU memory, host memory and NVMe.

    model, optimizer = patrickstar.initialize(model_func, config={...})
    loss = model(*batch); model.backward(loss); optimizer.step(); optimizer.zero_grad()
"""

import torch  # must precede _C, which links against LibTorch

from .torch_abi import check_built_torch

check_built_torch(torch.__version__)  # before _C loads: Note [The torch _C was built with]

from . import _C, _upstream  # noqa: E402
from ._C import ChunkOutOfMemoryError, ChunkRuntimeError  # noqa: E402
from .config import Config, load_config  # noqa: E402
from .engine import PatrickStarEngine  # noqa: E402
from .estimator import estimate_memory  # noqa: E402
from .external_params import (register_external_parameter,  # noqa: E402
                              unregister_external_parameter)
from .full_grad import safe_get_full_grad  # noqa: E402
from .deepspeed_arguments import add_config_arguments  # noqa: E402
from .initializer import initialize, initialize_engine  # noqa: E402
from .profiling.recorder import Profiler, profile  # noqa: E402

__version__ = "0.1.0"

_upstream.install()  # upstream-only module names fail with what to use instead

__all__ = ["ChunkOutOfMemoryError", "ChunkRuntimeError", "Config", "PatrickStarEngine",
           "Profiler", "add_config_arguments", "estimate_memory", "initialize",
           "initialize_engine", "load_config", "profile", "register_external_parameter",
           "safe_get_full_grad", "unregister_external_parameter", "__version__"]
