"""Every data-parallel rank starts from the first rank's initial weights, as DDP and DeepSpeed.

Note [The first rank's initial weights]
Under data parallelism every rank builds the whole model once and each parameter then keeps
its owner's values. Ranks seeded differently before building (nanoGPT seeds each rank with
`1337 + seed_offset` so that its batches differ, and builds the model after that) so trained a
model of mixed origins: rank 0's values for the parameters it owns, rank 1's for the others.
It trains, but not as the same script under DDP, whose constructor broadcasts rank 0's
parameters and buffers, or DeepSpeed's zero.Init, which broadcasts each parameter from rank 0.
So:
  * a model_func builds under rank 0's torch RNG state: it is broadcast (one small object
    collective), and a rank whose state differs builds under it and then gets its own state
    back, so the batches it draws later are still its own (rank 0 and ranks seeded alike
    change nothing);
  * a module built before initialize() (Note [Modules built before initialize()] in
    init_context.py) gets rank 0's parameters and buffers before anything is planned, as DDP's
    constructor does (one object collective per tensor: model-sized traffic, once).
Initialization that reads something other than torch's RNG (numpy, Python's random, a file
that differs per rank) is not covered: the ranks build from what they read.

Note [A seed set inside model_func]
A model_func that seeds before building (`torch.manual_seed(0)` or Hugging Face's `set_seed`
first, as a Trainer's model_init does) leaves every rank, under DDP or one process, at the
seeded stream: the dropout masks after it repeat run to run. Rank 1 got its own state from
before initialize() back instead, unseeded (this torch seeds each process randomly), so its
dropout masks, losses and weights differed on every run. A build that set a seed (torch's
initial seed changed while it ran: the same on every rank, which all built from the first
rank's state) now leaves every rank where the build left it, as each rank building for
itself would have.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["first_rank_rng", "take_first_rank_state"]


def _broadcast(value, group):
    """Rank 0's `value` (of `group`, None: the default group) on every rank."""
    holder = [value]
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(holder, src=source, group=group)
    return holder[0]


@contextlib.contextmanager
def first_rank_rng(enabled: bool, group) -> Iterator[None]:
    """Runs the block under the first rank's torch CPU RNG state (Note [The first rank's
    initial weights]); a no-op unless `enabled`."""
    if not enabled:
        yield
        return
    own = torch.get_rng_state()
    first = _broadcast(own, group)
    if torch.equal(first, own):
        yield
        return
    torch.set_rng_state(first)
    seed = torch.initial_seed()  # the first rank's, restored with its state
    reseeded = False
    try:
        yield
        reseeded = torch.initial_seed() != seed
    finally:
        if not reseeded:  # Note [A seed set inside model_func]
            torch.set_rng_state(own)


def take_first_rank_state(module: nn.Module, group) -> None:
    """The first rank's parameters and buffers into `module`, in place (a built module)."""
    is_first = dist.get_rank() == (0 if group is None else dist.get_global_rank(group, 0))
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(_broadcast(tensor.detach().cpu() if is_first else None, group))
