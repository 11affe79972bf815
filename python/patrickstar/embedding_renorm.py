"""`nn.Embedding(max_norm=...)` / `nn.EmbeddingBag(max_norm=...)`: refused where the engine
cannot keep the weights' renormalization.

Note [Renormalizing embeddings]
With `max_norm` set, each forward of nn.Embedding rescales, in place and under no_grad
(`torch.embedding_renorm_`), the rows of its weight that the batch looks up and whose norm
exceeds max_norm: the weight itself changes during the forward, outside autograd and the
optimizer. The engine hands the module a view of the chunk that holds the weight's compute copy,
so in fp32 on one process the rescale lands in the chunk and trains as in PyTorch (tested), and so
in bf16 without fp32 masters (bf16.master_weights false), whose bf16 weight is the one updated. It
is lost where that view is not the weight the optimizer updates:
  * fp16/bf16 (with fp32 masters): the rescale reaches only the 16-bit compute copy; the next
    optimizer step writes the unscaled master over it (a bf16 run trained on rows of norm 2-3
    where PyTorch's stayed at 1);
  * data parallelism: a rank that does not own the weight's chunk rescales a gathered copy that
    is dropped after the forward, so only the owner's lookups were kept, and which rows were
    renormalized depended on how the batch was split. (torch's DDP diverges here: each rank
    rescales only its own rows and nothing syncs them, so the ranks' weights drift apart.)
    In fp32 the owner's view is the weight the optimizer updates, so each such module gets a
    forward pre-hook (after the engine's access, `RenormAcrossRanks`) that gathers every rank's
    indices and rescales the rows of all of them before the module's own forward: every rank
    computes with, and the owner keeps, the weight one process would have after the whole
    batch (the module's own rescale of its rows is then a no-op, up to rounding at max_norm).
    The gather is a collective inside the module's forward, which every rank runs (forwards
    are collectives already).
In fp16/bf16 with masters, and under data parallelism in 16 bits (not tested), training would go
on silently with weights PyTorch would not have, so initialize() refuses such a module, naming
it and what works.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .hooks import HookSet

__all__ = ["RenormAcrossRanks", "refuse_lost_renorms"]


def _renormalizes(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None


def refuse_lost_renorms(root: nn.Module, precision: str, master_weights: bool,
                        world_size: int) -> None:
    """Raises if a module under `root` renormalizes its weight in its forward where the engine
    would lose that (Note [Renormalizing embeddings]); `master_weights` is false when the 16-bit
    parameters are themselves the weights the optimizer updates (bf16.master_weights)."""
    if precision == "fp32" or (not master_weights and world_size == 1):
        return
    for name, module in root.named_modules():
        if _renormalizes(module):
            where = (f"{precision} training" if world_size == 1 else
                     f"{precision} training with data parallelism ({world_size} ranks)")
            raise ValueError(
                f"module '{name}' is {type(module).__name__}(max_norm={module.max_norm}), whose "
                f"forward rescales rows of its weight in place: under {where} PatrickStar "
                f"cannot keep that rescale (it would reach only a 16-bit or gathered copy of "
                f"the weight, not the one the optimizer updates), and training would silently "
                f"differ from PyTorch. Build it without max_norm (renormalize the looked-up "
                f"vectors in the forward instead, e.g. "
                f"`v * (max_norm / v.norm(dim=-1, keepdim=True).clamp(min=max_norm))`), or "
                f"train it on one process in fp32 (or bf16 with 'master_weights': false), where max_norm works as in PyTorch")


class RenormAcrossRanks(HookSet):
    """Under fp32 data parallelism, rescales the rows every rank looks up before each forward of
    an embedding with max_norm (Note [Renormalizing embeddings]). Install after the engine's
    access hooks, so the weight holds its gathered values when this runs."""

    def __init__(self, root: nn.Module, group):
        super().__init__()
        self._group = group
        for module in root.modules():
            if _renormalizes(module):
                self._add(module.register_forward_pre_hook(self._renorm))

    def _renorm(self, module: nn.Module, args) -> None:
        indices = args[0].detach().reshape(-1)
        world = dist.get_world_size(self._group)
        count = torch.tensor([indices.numel()], dtype=torch.int64, device=indices.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self._group)
        sizes = [int(c) for c in counts]
        padded = indices.new_zeros(max(sizes))
        padded[:indices.numel()] = indices
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=self._group)
        every = torch.cat([part[:size] for part, size in zip(parts, sizes)])
        with torch.no_grad():
            torch.embedding_renorm_(module.weight, every, module.max_norm, module.norm_type)
