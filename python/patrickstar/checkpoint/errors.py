"""The one error every checkpoint module raises for an unusable checkpoint."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, or written for another
    model, layout or precision. The message names the file or the difference."""
