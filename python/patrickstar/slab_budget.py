"""The budget a tier needs to hold a set of chunk blocks: what its slab pool reserves for them,
not their bytes. One owner for the rule the profile report's findings (profiling/summary.py)
and `estimate_memory()` (estimator.py) both size budgets by."""
from __future__ import annotations

import collections
from typing import Iterable

__all__ = ["BLOCK_ALIGNMENT", "SLAB_TARGET_BYTES", "block_bytes", "slab_budget"]

# Note [Budgets bound the slab pool]
# A tier's budget bounds the bytes its slab pool reserves, not its chunk bytes (Note [Tier slab
# pool] in runtime/tier.h): the blocks of each size (a chunk's bytes, rounded up to 4 KiB) are
# carved from slabs that grow with the size's use, each as large as the size's slabs so far (one
# block first) up to min(64 MiB, budget / 8) bytes (Tier::GrowLocked, Note [Slabs grow with their
# size's use] in runtime/tier.cc), so a tier holding blocks of several sizes (int8 Adam state's
# uint8 moments and small float32 scale chunks beside float32 parameters and gradients) reserves up
# to a slab per size more than its chunks. A need counted in chunk bytes alone said "raising
# memory.host_budget by 1.2 MiB (to 4.4 MiB) removes them" of a 2-layer Llama with int8 state
# spilling to NVMe; at 4.4 MiB its host still spilled every iteration, and stopped only past 5 MiB.
# estimate_memory() made the same mistake: a 2-layer GPT given its "host: peak" as
# memory.host_budget ran out of host memory in its first optimizer step. So a budget is one whose
# slabs hold those chunks beside the non-model data: raised from the chunk bytes until the slabs it
# implies fit.
#
# How many slabs: a tier grows a size's slabs only when its free list is empty, i.e. when every
# slab of that size is full, and a new slab (at most min(per_slab, the size's blocks so far, at
# least one)) is cut short to the room left under the budget. So when the most blocks of a size
# held at once is n, its slabs hold at most n - 1 + min(per_slab, max(1, n - 1)) blocks: the
# n - 1 in use when the n-th asked for a new slab, and that slab. (Counting whole slabs,
# ceil(count / per_slab), missed a slab cut short to one block before full ones, and a bf16
# GPT at its estimated host budget reserved one 64 KiB block more and ran out of host memory.)
SLAB_TARGET_BYTES = 64 << 20  # Tier::Options::slab_target_bytes (the engine keeps the default)
BLOCK_ALIGNMENT = 4096  # kBlockAlignment in runtime/tier.h


def block_bytes(nbytes: int) -> int:
    """The bytes of the block a chunk of `nbytes` takes in a tier: rounded up to 4 KiB."""
    return -(-nbytes // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT


def slab_budget(blocks: collections.Counter | Iterable[int], non_model: int = 0) -> int:
    """A budget whose slab pool holds `blocks` (a Counter of count per block size, or the
    blocks' sizes) at once beside `non_model` bytes (Note [Budgets bound the slab pool])."""
    if not isinstance(blocks, collections.Counter):
        blocks = collections.Counter(blocks)
    budget = sum(size * count for size, count in blocks.items()) + non_model
    for _ in range(64):  # a few rounds: the slab size stops growing at SLAB_TARGET_BYTES
        reserved = 0
        for size, count in blocks.items():
            per_slab = max(1, min(SLAB_TARGET_BYTES, budget // 8) // size)
            if count > 0:
                reserved += (count - 1 + min(per_slab, max(1, count - 1))) * size
        if reserved + non_model <= budget:
            break
        budget = reserved + non_model
    return budget
