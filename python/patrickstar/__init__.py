"""PatrickStar-C++: train models larger than GPU memory by keeping parameters, gradients and
optimizer state in chunks that move between GPU memory, host memory and NVMe."""

import torch  # noqa: F401  (must precede _C, which links against LibTorch)

from . import _C
from ._C import ChunkOutOfMemoryError, ChunkRuntimeError

__version__ = "0.1.0"

__all__ = ["ChunkOutOfMemoryError", "ChunkRuntimeError", "__version__"]
