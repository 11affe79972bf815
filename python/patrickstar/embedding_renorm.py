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
    is dropped after the forward, so only the owner's lookups are kept, and which rows are
    renormalized depends on how the batch was split. (torch's DDP diverges here too: each rank
    rescales only its own rows and nothing syncs them, so the ranks' weights drift apart.)
Either way training would go on silently with weights PyTorch would not have, so initialize()
refuses such a module, naming it and what works.
"""
from __future__ import annotations

from torch import nn

__all__ = ["refuse_lost_renorms"]


def refuse_lost_renorms(root: nn.Module, precision: str, master_weights: bool,
                        world_size: int) -> None:
    """Raises if a module under `root` renormalizes its weight in its forward where the engine
    would lose that (Note [Renormalizing embeddings]); `master_weights` is false when the 16-bit
    parameters are themselves the weights the optimizer updates (bf16.master_weights)."""
    if (precision == "fp32" or not master_weights) and world_size == 1:
        return
    for name, module in root.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            where = (f"{precision} training" if world_size == 1 else
                     f"data parallelism ({world_size} ranks)" if precision == "fp32" else
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
