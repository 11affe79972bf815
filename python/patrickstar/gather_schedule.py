"""When the compute-param groups of a data-parallel engine are gathered and released (Note [A
data-independent collective schedule] in data_parallel.py): the ascending forward cursor, the
gathers started ahead of use, and the release at the optimizer step. `DataParallel` owns one
and hands it the accesses; nothing else touches the gather collectives."""
from __future__ import annotations

from . import _C

__all__ = ["GatherSchedule"]

K = _C.ChunkKind


class GatherSchedule:
    """The gather side of data parallelism over `collectives` (a `_C.GroupCollectives`).

    `groups` are the compute-param groups (their first chunks) in gather order;
    `position_of` maps a compute tensor id to its group's position; `remote` holds the compute
    tensors another rank owns."""

    def __init__(self, collectives, groups, position_of: dict, remote: set, gather_ahead: int):
        self.collectives = collectives
        self.groups = list(groups)
        self.position_of = position_of
        self.remote = remote
        self.gather_ahead = gather_ahead
        self.gathers_ahead = 0  # gathers started before any tensor of their group was needed
        self._cursor = 0  # groups before it are gathered
        self._started = 0  # groups before it are gathered or started (gather_ahead > 0)

    def before_access(self, tensor_id: int, in_forward: bool) -> None:
        position = self.position_of.get(tensor_id)
        if position is None or position < self._cursor:
            return
        # A remote tensor needs its group's bytes; a local one needs its chunk unpinned by a
        # started gather (Note [Started gathers] in chunk/group_collectives.h). Within a forward
        # a local tensor gathers its group too: it must not be in use (COMPUTE) when a later
        # access gathers the group and pins its chunk for the send (a weight that filled a chunk
        # exactly, with its bias in the other rank's chunk of the group, crashed so). Only
        # within a forward, which every rank ends with gather_all(): elsewhere an owner may read
        # its own tensors alone (checkpoints, tied pipeline weights), and a gather there would be
        # a collective the other ranks never issue.
        if in_forward or tensor_id in self.remote or position < self._started:
            self.gather_through(position)

    def gather_through(self, position: int) -> None:
        """Gathers the groups up to `position` in order, first starting the next
        `gather_ahead` ones after it, so that their collectives run while this rank computes."""
        groups = self.groups
        while self._cursor <= position:
            if self.gather_ahead > 0:  # at most gather_ahead + 1 groups in flight
                end = min(self._cursor + 1 + self.gather_ahead, len(groups))
                while self._started < end:
                    declined = self.collectives.gathers_declined
                    if self.collectives.start_gather(groups[self._started]) and (
                            self._started > position):
                        self.gathers_ahead += 1
                    if self.collectives.gathers_declined != declined:
                        # No room to start this group now: start nothing after it either, or
                        # a later group's collective would be issued before this one's (which
                        # the gather below or a later start issues), and the ranks would pair
                        # different groups. Next time round it is tried again.
                        break
                    self._started += 1
            self.collectives.gather(groups[self._cursor])
            self._cursor += 1
        self._started = max(self._started, self._cursor)

    def gather_all(self) -> None:
        """Gathers every group not gathered since the last release (the end of a forward, and
        state_dict(): every rank calls these at the same point)."""
        self.gather_through(len(self.groups) - 1)

    def release_all(self) -> None:
        """Every rank drops its gathered copies (finishing a gather still in flight first)."""
        try:
            self.collectives.release_all(K.COMPUTE_PARAM)
        finally:
            self._cursor = self._started = 0
