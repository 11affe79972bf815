"""Rank and world size, with the single-process answers when torch.distributed is not set up."""
from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["get_local_world_size", "get_rank", "get_world_size"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def get_local_world_size() -> int:
    """Processes on this machine: torchrun's LOCAL_WORLD_SIZE, else the world size."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else get_world_size()
