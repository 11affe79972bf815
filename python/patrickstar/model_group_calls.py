"""The call agreement of a model cut into pipeline stages or tensor slices without data
parallelism: the ranks holding one replica's stages and slices check that they make the same
call before its collectives.

Note [Calls on one rank of a model replica]
A script with DDP evaluates under `if rank == 0:` (nanoGPT's estimate_loss(), DeepSpeed's
eval_batch() after train_batch()). Under data parallelism the engine's call agreement
(DataParallel.agree_on_call) serves such work or refuses it at once on every rank. Without data
parallelism there was no agreement, and the model group's collectives paired different calls:
  * pipeline stages: rank 0's eval_batch() sent its activations to stage 1, which was in
    train_batch() and took them as training input; stage 1's gradient then went to a rank
    waiting for no gradient, and both ranks waited for the collective timeout;
  * tensor slices: rank 0's evaluation forward all-reduced its partial sums with rank 1's
    training forward (a wrong loss, silently), then the next all-reduces of different sizes
    aborted gloo.
So with pipeline stages or tensor slices and one data rank, the calls whose collectives span the
model group first agree on it: one all-gather of (call count, call kind), raising on every rank
at once, naming each rank's call, when they differ. The pipeline engine agrees at train_batch()
and eval_batch() (its stage engines' own forwards and backwards run inside those, in the
schedule's order, and do not agree again); an engine of tensor slices alone agrees at each
forward's start, backward, optimizer step and gradient clip (DataParallel hands it those calls).
Reads (state_dict(), a parameter's value) and saves are each rank's own there, with no
collective across the group: they agree on nothing, so `if rank == 0:` still works for them.
With data parallelism as well the engine's agreement runs within each data group, as before.
"""
from __future__ import annotations

import torch

from . import recorded_collectives, topology

__all__ = ["ModelGroupCalls", "model_group_agreement"]


class ModelGroupCalls:
    """The agreement of one replica's ranks (Note [Calls on one rank of a model replica])."""

    def __init__(self, groups: topology.ParallelGroups, calls: dict[int, str], remedy: str,
                 timeout: float, peer_error: type = RuntimeError):
        """`calls`: every call kind's description; `remedy`: what the error tells to do;
        `timeout`: how long a call waits for the other ranks; `peer_error`: the error type of
        a peer gone."""
        self._group = groups.model_group
        self._ranks = list(groups.model_ranks)
        self._calls = dict(calls)
        self._remedy = remedy
        self._peers = ", ".join(_describe(groups, rank) for rank in self._ranks
                                if rank != groups.rank)
        self._timeout = float(timeout)
        self._peer_error = peer_error
        self._count = 0  # calls agreed on; the same on every rank of the group

    def agree(self, kind: int) -> None:
        """Every rank of the model group is at call `kind`; raises on each otherwise."""
        count, self._count = self._count, self._count + 1
        device = topology.comm_device(self._group)
        mine = torch.tensor([count, kind], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in self._ranks]
        try:
            recorded_collectives.group_all_gather(rows, mine, self._group, "model_all_gather",
                                                  "call count and kind", self._timeout)
        except RuntimeError as error:
            raise self._peer_failure(self._calls[kind], str(error)) from None
        rows = [tuple(int(value) for value in row.cpu()) for row in rows]
        if all(row == rows[0] for row in rows):
            return
        described = "; ".join(f"rank {rank}: call {row[0]}, {self._calls.get(row[1], row[1])}"
                              for rank, row in zip(self._ranks, rows))
        raise RuntimeError(
            f"{self._calls[kind]}: the ranks holding this model's pipeline stages or tensor "
            f"slices are not making the same call ({described}). Their collectives pass "
            f"activations and partial sums between them, so every one of them must make each "
            f"such call: {self._remedy}")

    def _peer_failure(self, call: str, message: str) -> Exception:
        """The agreement's collective failed: a peer stalled past the timeout, or died."""
        if recorded_collectives.timed_out(message):
            return TimeoutError(
                f"{call}: {self._peers} did not reach the same call within {self._timeout:g} s "
                f"(config key 'parallel.collective_timeout'); is it alive and making the same "
                f"calls?")
        first_line = message.splitlines()[0] if message else "no message"
        return self._peer_error(
            f"{call}: the call agreement with {self._peers} failed; that process has probably "
            f"died (see its log): {first_line}")


def _describe(groups: topology.ParallelGroups, rank: int) -> str:
    """A rank of the model group by the stage and slice it holds ("stage 1 (rank 1)")."""
    coord = groups.topology.get_coord(rank)
    parts = ([f"stage {coord.pipe}"] if groups.pipe_size > 1 else []) + \
        ([f"tensor slice {coord.tensor}"] if groups.tensor_size > 1 else [])
    return f"{' '.join(parts)} (rank {rank})"


def model_group_agreement(groups: topology.ParallelGroups | None, calls: dict[int, str],
                          remedy: str, timeout: float,
                          peer_error: type = RuntimeError) -> ModelGroupCalls | None:
    """The agreement for a model cut into stages or slices on one data rank, else None (one
    rank, no cut, or data parallelism, whose own agreement covers the calls)."""
    if groups is None or groups.model_group is None or groups.data_size != 1:
        return None
    return ModelGroupCalls(groups, calls, remedy, timeout, peer_error)
