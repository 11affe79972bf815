"""How a tensor-parallel parameter is cut into its ranks' slices and joined again: the layout
that tensor_parallel's layers build, checkpoints record and consolidation or a load under
another `parallel.tensor` size undo (Note [Strided slices] in tensor_parallel.py). Plain
tensor operations, below every module that needs them."""
from __future__ import annotations

import torch

__all__ = ["split_tensor", "join_slices"]


def split_tensor(full: torch.Tensor, dim: int, size: int, rank: int, stride: int = 1):
    """Rank `rank`'s slice of `full` along `dim` (Note [Strided slices])."""
    if size == 1:
        return full
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(size, dim=dim)[rank] for block in blocks], dim=dim)


def join_slices(parts, dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of split_tensor over all ranks' parts, in rank order."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    pieces = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([pieces[r][b] for b in range(stride) for r in range(len(parts))], dim=dim)
