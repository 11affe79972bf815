"""slab_budget(): the budget it gives a set of chunk blocks holds them in the runtime's own tier
(its slab pool), through the phases a host tier goes through: initialization's masters and
compute chunks, the compute chunks leaving for the device, then the Adam moments beside the
masters (Note [Budgets bound the slab pool] in slab_budget.py)."""
from __future__ import annotations

import collections

import pytest

from patrickstar import _C
from patrickstar.slab_budget import BLOCK_ALIGNMENT, block_bytes, slab_budget

KiB = 1024


def _reserved_through_the_phases(budget, masters, compute):
    """The bytes a tier of `budget` reserves holding `masters` and `compute` blocks, then the
    masters and two moments per master once the compute blocks are freed (an allocation the
    pool refuses is retried after returning empty slabs, as ChunkManager does), or None when it
    cannot hold them."""
    tier = _C.EmulatedDeviceTier(budget=budget)
    held = []
    try:
        held += [tier.allocate(size) for size in masters]
        leaving = [tier.allocate(size) for size in compute]
        for block in leaving:
            tier.free(block)
        for size in masters:
            for _ in range(2):
                try:
                    held.append(tier.allocate(size))
                except MemoryError:
                    tier.trim()
                    held.append(tier.allocate(size))
        tier.trim()
        return tier.stats()["reserved_bytes"]
    except MemoryError:
        return None
    finally:
        for block in held:
            tier.free(block)


@pytest.mark.parametrize("masters,compute,non_model", [
    # Found by a search over small block sets: each ran out of room, or left no room for its
    # non-model data, at the budget whole slabs per size (ceil(count / per_slab)) gave.
    ([32 * KiB] * 4 + [12 * KiB] * 4, [8 * KiB] * 4, 16 * KiB),
    ([24 * KiB] * 4 + [32 * KiB] * 4 + [48 * KiB], [12 * KiB] * 3 + [16 * KiB], 0),
    ([4 * KiB] * 5, [8 * KiB] * 5 + [12 * KiB] * 3 + [4 * KiB] * 3, 56 * KiB),
])
def test_the_budget_holds_the_blocks_in_the_runtimes_tier(masters, compute, non_model):
    state = [size for size in masters for _ in range(3)]  # each master and its two moments
    budget = max(slab_budget(masters + compute), slab_budget(state, non_model))
    reserved = _reserved_through_the_phases(budget, masters, compute)
    assert reserved is not None, f"a tier of {budget} bytes could not hold the blocks"
    assert reserved + non_model <= budget


def test_slab_budget_of_blocks_of_one_slab_each_is_their_bytes():
    # Blocks larger than a slab (an eighth of the budget) take a slab each: nothing is
    # reserved beyond them, and the non-model data comes on top.
    assert slab_budget(collections.Counter({1 << 20: 2})) == 2 << 20
    assert slab_budget([1 << 20, 1 << 20], 4096) == (2 << 20) + 4096
    assert block_bytes(1) == BLOCK_ALIGNMENT and block_bytes(8192) == 8192
