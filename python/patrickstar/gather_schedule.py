"""When the compute-param groups of a data-parallel engine are gathered and released (Note [A
data-independent collective schedule] in data_parallel.py): the ascending forward cursor, the
gathers started ahead of use, and, with `parallel.reshard_after_forward`, the release after the
last use in forward, the gathers of backward in an agreed order and the release once a group's
gradients are in. `DataParallel` owns one and hands it the accesses and gradients; nothing else touches the
gather collectives.

Note [Resharding after forward]
Keeping every gathered group until the optimizer step holds the full compute parameters on
every rank; ZeRO-3 and FSDP2 release a group after its use and gather it again in backward.
What must agree between ranks is the sequence of gathers, never the releases: dropping a
group's remote payloads is local (Note [Releasing one group] in chunk/group_collectives.h). So:
  * forward gathers ascend with one cursor, exactly as without resharding (every group once,
    gather_all() at the end). Each rank releases a group once its forward has moved past the
    group's last use, known from its own trace of the forwards before (for every group, the
    highest group accessed so far at its last access). The first forward has no trace: see
    the next point. A later access of a remote tensor of a group released in
    this pass is a departure from the trace that no rank can honour (a gather there is a
    collective the others do not issue): ScheduleDepartureError names the parameter and the
    group at once, on that rank; the others fail in their next collective within
    `parallel.collective_timeout`. Traces only grow (a group's last use is the latest seen in
    any forward), so a departure happens at most once per new pattern, and it cannot happen at
    all to a model whose forward reuses no earlier group late (tied weights and modules called
    twice are in every trace, so they stay gathered until their last use).
  * the first forward (no trace yet) releases a group once every tensor of it was used in
    this forward, the forward moved on to a later group and none of its tensors is in use; a
    group used again after that (tied weights, a module called twice) is gathered again. Such
    a re-gather is a collective the other ranks must issue at the same point, which only a
    model whose forward is the same on every rank guarantees, so in the first forward every
    gather is preceded by one small all-reduce on the gather group in which the ranks compare
    the group they are about to gather (or that their forward ended): the same everywhere, or
    a ScheduleDepartureError naming every rank's next group on every rank, never two groups
    paired in one allgather. The first forward starts no gather ahead (each start would need
    its own check). At its end every group is released on every rank alike (which ones a rank
    still holds depends on its accesses), so the first backward gathers from the start of its
    order. Later forwards follow the trace, checked by nothing: their sequence of gathers is
    the ascending one whatever the accesses.
  * backward gathers follow one order agreed by every rank: the reverse of the groups' last
    use in the first forward (rank 0's, broadcast when that forward ends; until then
    descending group order). A chunk layout packs a late layer's small tensors into early
    chunks, so descending order alone made the first backward access gather the whole model.
    The end of a forward gathers what is left (the agreed count), then releases every group
    but the first of that order on every rank: backward starts with the same gathered set
    everywhere, and the group it needs first needs no second gather.
  * in backward the same cursor walks that order (gather_through): the first access of a
    tensor of group g (local ones too: a collective must not find a tensor of its group in
    use) gathers every group of the order up to g. Backward starts no gather ahead: a started
    group stays pinned where it is until its first use, and the gradients the current group's
    backward stores need that room (a 1F1B pipeline stage under a tight device budget ran out
    of it). Before this was written down, backward did start one group ahead, but issued it
    before the group it gathered and then finished both at once: no overlap, and a rank whose
    start was declined would have issued the two in the other order.
    Backward's accesses depend on autograd and may differ between ranks (an unused branch)
    or between iterations, but the sequence of gathers is still a prefix of the one order:
    a different need only gathers earlier. A group is released once every trainable tensor
    of it got its gradient in this backward (and no frozen tensor needs it for an input
    gradient), at the first access after that which finds none of its tensors in use, before
    that access gathers anything (the group used last and the next one are then not held
    together: a third of backward's window for the block stack of docs/benchmarks.md), or
    already before its last gradient lands when none of its tensors is in use then (the
    engine ends a parameter's access at torch's gradient hook, which runs once every use of
    the parameter in this backward is done): the group and its gradients are then not held
    together either (2 MiB of bf16 at the end of backward in docs/benchmarks.md). A model
    that still reads a parameter in backward after its gradient is complete (a detached use
    of it saved for backward, whose node autograd may run after the parameter's own gradient
    hook) then finds a remote group released: ScheduleDepartureError names it, and
    reshard_after_forward: false is the way out. Backward's end makes every rank issue the
    same gathers: Note [How far backward gathers].
  * the gathers of backward run on their own process group (data_parallel.py creates it):
    reduce-scatters start as soon as a rank's own gradients of a group are in, which depends
    on its control flow, so on one communicator gloo could pair one rank's allgather with
    another's reduce-scatter. Backward's remaining gathers go before its reduce-scatters are
    awaited, or a rank waiting for a reduce-scatter and one waiting in a gather deadlock.

Note [How far backward gathers]
Each rank's backward gathers a prefix of the agreed order, as far as its own accesses need; at
its end every rank must have issued the same prefix. The ranks used to agree on its length at
the end of backward (one all-reduce on the gather group of how many groups any of them
issued), but a rank whose backward needs a group further along the order than any group
another rank needs is still gathering when the other issues that all-reduce: the all-reduce
met an allgather on the same communicator ("the ranks' sequences of collectives differ"). A
mixture of experts whose experts are modules of their own (Switch Transformers, NLLB-MoE)
does that at once: the order puts the groups rank 0's first forward did not use last, and the
rank that routed a token to such an expert needs them in its backward. So the length is agreed
at the end of a forward that a backward follows instead, where every rank stands at the same
point of its collectives: backward reads only parameters its forward used (the engine's hooks
access a module's parameters in backward only if it ran in the forward), so the largest
position in the order of a group any rank's forward used (any forward since the last
backward: a backward may follow two forwards) bounds every rank's backward, and every rank
gathers through it when its backward ends. The count of collectives is the same
(the all-reduce moved); what costs more is a group every rank's forward used and no rank's
backward needs past the last one needed (a frozen embedding, used first in forward, last in
the order), now gathered at backward's end. A backward reaching past the agreed length (a
parameter read in backward that the forward did not use) raises ScheduleDepartureError naming
it. A backward that no forward's end prepared (pipeline stages, a forward with the module in
eval mode) agrees at its end as before.
"""
from __future__ import annotations

from . import _C

__all__ = ["GatherSchedule", "ScheduleDepartureError"]

K = _C.ChunkKind


class ScheduleDepartureError(RuntimeError):
    """A rank needs a group it released on the strength of the warm-up trace (Note [Resharding
    after forward])."""


class GatherSchedule:
    """The gather side of data parallelism over `collectives` (a `_C.GroupCollectives`).

    `groups` are the compute-param groups (their first chunks) in gather order;
    `position_of` maps a compute tensor id to its group's position; `remote` holds the compute
    tensors another rank owns. With `reshard`, `trainable` counts the trainable tensors of each
    group, `frozen` holds the positions of groups with a frozen tensor and `name_of` names a
    compute tensor for errors."""

    def __init__(self, collectives, groups, position_of: dict, remote: set, gather_ahead: int,
                 reshard: bool = False, trainable=None, frozen=(), name_of=None, agree=None,
                 compare=None, before_backward_gather=None, agree_extent=None):
        self.collectives = collectives
        self.groups = list(groups)
        self.position_of = position_of
        self.remote = remote
        self.gather_ahead = gather_ahead
        self.reshard = reshard
        self.gathers_ahead = 0  # gathers started before any tensor of their group was needed
        self.released_in_forward = 0  # groups released before their forward ended (counter)
        self.released_in_backward = 0  # groups released before their backward ended (counter)
        # One cursor walks the current sequence of gathers: group order in forward (and
        # outside a pass), backward's agreed order in backward. _sequence[:_next] is gathered,
        # _sequence[:_started] gathered or started (gather_ahead > 0).
        self._forward_order = list(range(len(self.groups)))
        self._sequence = self._forward_order
        self._next = 0
        self._started = 0
        # Resharding.
        self._trainable = list(trainable or [0] * len(self.groups))
        self._frozen = set(frozen)
        self._name_of = name_of or (lambda tensor_id: f"tensor {tensor_id}")
        self._trace: dict[int, int] = {}  # group -> highest group accessed at its last use
        self._pass_trace: dict[int, int] = {}
        self._traced = False  # a forward ended: the trace and backward's order exist
        self._frontier = -1  # the highest group accessed in this forward
        self._accesses = 0  # accesses in this forward
        self._last_access: dict[int, int] = {}  # group -> its last access in this forward
        self._released: set[int] = set()  # released in this pass
        self._in_backward = False
        self._in_forward = False  # between begin_forward and end_forward (resharding)
        # Backward's gather sequence: descending until the first forward's trace gives the
        # order in which backward needs the groups, agreed between the ranks by `agree(order)`.
        self._agree = agree
        self._set_order(list(reversed(range(len(self.groups)))))
        self._missing: list[int] = []
        self._ready: set[int] = set()
        # The first forward (Note [Resharding after forward]): tensors of each group, those used
        # in this forward, and `compare(value)`, every rank's value (an all-reduce on the gather
        # group), checking each gather.
        self._tensors_in = [0] * len(self.groups)
        for position in position_of.values():
            self._tensors_in[position] += 1
        self._used: dict[int, set] = {}
        self._compare = compare
        self.regathered_in_first_forward = 0  # counter
        # Called before a gather in backward: the gradients of the groups done with go before
        # the next group's parameters arrive (data_parallel.py's reduce-scatters).
        self._before_backward_gather = before_backward_gather
        # How far this backward gathers (Note [How far backward gathers]): `agree_extent(n)`
        # is the largest `n` of every rank; None when no forward's end agreed it.
        self._agree_extent = agree_extent
        self._extent = None
        # Groups the forwards since the last backward used (a backward may follow several).
        self._used_since_backward: set[int] = set()

    def close(self) -> None:
        """Closes its collectives (DataParallel.close(): before the chunk manager closes)."""
        self.collectives.close()

    # ---- Accesses -----------------------------------------------------------------------------

    def before_access(self, tensor_id: int, in_forward: bool) -> None:
        position = self.position_of.get(tensor_id)
        if position is None:
            return
        if self._in_backward:
            self._backward_access(tensor_id, position)
            return
        if in_forward and position in self._released:
            if self._checking:
                self._regather(tensor_id, position)
            elif tensor_id in self.remote:
                self._depart(tensor_id, position, "forward")
        # A remote tensor needs its group's bytes; a local one needs its chunk unpinned by a
        # started gather (Note [Started gathers] in chunk/group_collectives.h). Within a forward
        # a local tensor gathers its group too: it must not be in use (COMPUTE) when a later
        # access gathers the group and pins its chunk for the send (a weight that filled a chunk
        # exactly, with its bias in the other rank's chunk of the group, crashed so). Only
        # within a forward, which every rank ends with gather_all(): elsewhere an owner may read
        # its own tensors alone (checkpoints, tied pipeline weights), and a gather there would be
        # a collective the other ranks never issue.
        if in_forward and self.reshard and self._traced and position > self._frontier:
            # The groups the trace says this forward is done with go before the gathers below
            # land beside them (the group in use, the next, the one started ahead).
            self._frontier = position
            self._release_passed()
        if position >= self._next and (
                in_forward or tensor_id in self.remote or position < self._started):
            self.gather_through(position)
        if in_forward and self.reshard:
            self._used.setdefault(position, set()).add(tensor_id)
            if position > self._frontier:
                self._frontier = position
                self._release_passed()
            self._pass_trace[position] = self._frontier
            self._last_access[position] = self._accesses
            self._used_since_backward.add(position)
            self._accesses += 1

    def _depart(self, tensor_id: int, position: int, phase: str) -> None:
        raise ScheduleDepartureError(
            f"data parallel: parameter '{self._name_of(tensor_id)}' (compute group {position} "
            f"of {len(self.groups)}) is used again in this {phase} after this rank released the "
            f"group, following the previous iterations' trace (parallel.reshard_after_forward; "
            f"Note [Resharding after forward]); gathering it again here would be a collective "
            f"the other ranks do not issue. Set parallel.reshard_after_forward to false for a "
            f"model whose {phase} reuses parameters in an order that changes between iterations"
            + ("; a reentrant torch.utils.checkpoint(..., use_reentrant=True) whose function "
               "uses a parameter also used outside it does this too: pass use_reentrant=False "
               "(Note [A second gradient in one backward] in backward_pass.py)"
               if phase == "backward" else ""))

    def gather_through(self, index: int) -> None:
        """Gathers the groups of the current sequence up to `index` in order (in forward the
        index is the group's position). In forward it first starts the next `gather_ahead`
        groups, so that their collectives run while this rank computes; backward starts none
        (Note [Resharding after forward]: a started group stays pinned where it is until its
        first use, and backward's gradient stores need that room)."""
        sequence = self._sequence
        ahead = 0 if self._in_backward or self._checking else self.gather_ahead
        while self._next <= index:
            if ahead > 0:  # at most gather_ahead + 1 groups in flight
                end = min(self._next + 1 + ahead, len(sequence))
                while self._started < end:
                    if not self._start(sequence[self._started], ahead=self._started > index):
                        break
                    self._started += 1
            if self._checking:
                self._check_next(sequence[self._next], None)
            self.collectives.gather(self.groups[sequence[self._next]])
            self._next += 1
        self._started = max(self._started, self._next)

    # ---- The first forward --------------------------------------------------------------------

    @property
    def _checking(self) -> bool:
        """In the first forward with resharding: gathers are compared between the ranks."""
        return self.reshard and self._in_forward and not self._traced and \
            self._compare is not None

    def _check_next(self, position: int, tensor_id) -> None:
        """Every rank's next gather of the first forward (a group position, -1: its forward
        ended) must be the same (Note [Resharding after forward])."""
        values = [int(v) for v in self._compare(position)]
        if all(v == position for v in values):
            return
        def describe(value):
            return "ends its forward" if value < 0 else f"gathers compute group {value}"
        mine = "" if tensor_id is None else \
            f" (this rank uses parameter '{self._name_of(tensor_id)}' again)"
        raise ScheduleDepartureError(
            "data parallel: in the first forward the ranks disagree on the next gather: "
            + ", ".join(f"rank {rank} {describe(v)}" for rank, v in enumerate(values))
            + f"{mine}. A group released after its use and used again (tied weights, a module "
            f"called twice) is gathered again, which needs every rank's forward to use it "
            f"again at the same point (Note [Resharding after forward]). Set "
            f"parallel.reshard_after_forward to false for a model whose forward differs "
            f"between ranks in this way")

    def _regather(self, tensor_id: int, position: int) -> None:
        """The first forward uses a group it released again: gathered again, checked."""
        self._check_next(position, tensor_id)
        self.collectives.gather(self.groups[position])
        self._released.discard(position)
        self.regathered_in_first_forward += 1

    def _start(self, position: int, ahead: bool) -> bool:
        """Starts the gather of one group; False when the collectives declined it for want of
        room: then nothing after it may be started either, or a later group's collective would
        be issued before this one's (which a later gather or start issues) and the ranks would
        pair different groups. Next time round it is tried again."""
        declined = self.collectives.gathers_declined
        if self.collectives.start_gather(self.groups[position]) and ahead:
            self.gathers_ahead += 1
        return self.collectives.gathers_declined == declined

    def gather_all(self) -> None:
        """Gathers every group not gathered since the last release (the end of a forward, and
        state_dict(): every rank calls these at the same point)."""
        self.gather_through(len(self.groups) - 1)

    @property
    def all_gathered(self) -> bool:
        """Whether gather_all() would issue no collective."""
        return self._next >= len(self.groups)

    def release_all(self) -> None:
        """Every rank drops its gathered copies (finishing a gather still in flight first)."""
        try:
            self.collectives.release_all(K.COMPUTE_PARAM)
        finally:
            self._sequence = self._forward_order
            self._next = self._started = 0
            self._released.clear()
            self._in_backward = False
            self._extent = None

    # ---- Resharding: forward ------------------------------------------------------------------

    def begin_forward(self) -> None:
        if not self.reshard:
            return
        self.release_all()  # local: every rank starts each forward from nothing gathered
        self._in_forward = True
        self._frontier = -1
        self._used = {}
        self._pass_trace = {}
        self._accesses = 0
        self._last_access = {}

    def end_forward(self, backward_follows: bool = False) -> None:
        """Gathers what is left (agreed); with resharding then releases every group but the
        one backward needs first, on every rank, and sets up backward's gathers: with
        `backward_follows` (the same on every rank), how far they go (Note [How far backward
        gathers])."""
        self.gather_all()
        if not self.reshard or not self.groups:
            self._in_forward = False
            return
        first = self._checking
        if first:
            self._check_next(-1, None)
        self._in_forward = False
        if not self._traced:
            # The first forward's trace: backward needs the groups in the reverse order of
            # their last use (a layout that packs a late layer's small tensors into an early
            # chunk makes that group needed first, not last).
            local = sorted(range(len(self.groups)),
                           key=lambda p: (-self._last_access.get(p, -1), -p))
            self._set_order(self._agree(local) if self._agree is not None else local)
        # The first forward released groups by what this rank used: every rank releases all.
        keep = None if first else self._order[0]
        for position in range(len(self.groups)):
            if position != keep and position not in self._released and \
                    not self._release(position):
                raise RuntimeError(
                    f"data parallel: compute group {position} still has a tensor in use when "
                    f"the forward ends, so it cannot be released on this rank while the others "
                    f"release it (Note [Resharding after forward])")
        for position, frontier in self._pass_trace.items():
            self._trace[position] = max(frontier, self._trace.get(position, -1))
        self._traced = True
        self._enter_backward(0 if first else 1)
        if backward_follows and self._agree_extent is not None:
            used = [self._index_in_order[p] + 1 for p in self._used_since_backward]
            self._extent = max(int(self._agree_extent(max(used, default=0))), self._next)

    def _set_order(self, order) -> None:
        if sorted(order) != list(range(len(self.groups))):
            raise RuntimeError(f"data parallel: backward's gather order {order} is not a "
                               f"permutation of the {len(self.groups)} compute groups")
        self._order = list(order)
        self._index_in_order = {position: i for i, position in enumerate(self._order)}

    def begin_backward(self) -> None:
        """A backward that no forward's end prepared (a pipeline stage runs several backwards
        in a row): it starts from nothing gathered, on every rank alike."""
        if self.reshard and not self._in_backward and self.groups:
            self.release_all()
            self._enter_backward(0)

    def _enter_backward(self, gathered: int) -> None:
        """Backward's gathers continue after the first `gathered` groups of the order."""
        self._released.clear()
        self._in_backward = True
        self._extent = None
        self._sequence = self._order
        self._next = self._started = gathered
        self._missing = list(self._trainable)
        self._ready.clear()

    def _release_passed(self) -> None:
        """Releases the groups the trace says this forward is done with (never the one
        backward needs first); in the first forward, those whose tensors were all used."""
        if not self._traced:
            if self._checking:
                for position in range(min(self._next, self._frontier)):
                    if (position not in self._released
                            and len(self._used.get(position, ())) == self._tensors_in[position]
                            and self._release(position)):
                        self.released_in_forward += 1
            return
        keep = self._order[0]
        for position in range(self._next):  # forward: the gathered groups
            if (position != keep and position not in self._released
                    and self._trace.get(position, -1) < self._frontier
                    and self._release(position)):
                self.released_in_forward += 1

    def _release(self, position: int) -> bool:
        if not self.collectives.release(self.groups[position]):
            return False  # a tensor of it is in use: tried again at the next moment
        self._released.add(position)
        return True

    # ---- Resharding: backward -----------------------------------------------------------------

    def _backward_access(self, tensor_id: int, position: int) -> None:
        index = self._index_in_order[position]
        # Groups done with go first, so that the next one's gather does not land beside them;
        # not the one accessed now (a tensor of it used again after its gradients are in).
        self._release_ready(keep=position)
        if index < self._next:
            if position in self._released and tensor_id in self.remote:
                self._depart(tensor_id, position, "backward")
        else:
            if self._extent is not None and index >= self._extent:
                raise ScheduleDepartureError(
                    f"data parallel: parameter '{self._name_of(tensor_id)}' (compute group "
                    f"{position} of {len(self.groups)}) is used in this backward, but no "
                    f"rank's forward used its group, so no other rank gathers it (Note [How "
                    f"far backward gathers]). Set parallel.reshard_after_forward to false for "
                    f"a model whose backward reads parameters its forward did not")
            if self._before_backward_gather is not None:
                self._before_backward_gather()
            self.gather_through(index)
            self._release_ready()

    def before_grad(self, position: int) -> None:
        """A trainable tensor of group `position` is about to get its gradient in this backward
        (its access already ended: the engine ends it at torch's gradient hook): when it is the
        group's last, the group is released now, before the gradient lands beside it (Note
        [Resharding after forward]); a tensor of it still in use defers that to on_grad."""
        if (self._in_backward and self._missing[position] == 1 and position not in self._frozen
                and self._index_in_order[position] < self._next
                and position not in self._released and self._release(position)):
            self.released_in_backward += 1

    def on_grad(self, position: int) -> None:
        """A trainable tensor of group `position` got its gradient in this backward."""
        if not self._in_backward:
            return
        self._missing[position] -= 1
        if self._missing[position] == 0 and position not in self._frozen and \
                position not in self._released:
            self._ready.add(position)
            self._release_ready()

    def _release_ready(self, keep: int | None = None) -> None:
        for position in sorted(self._ready):
            if position != keep and self._index_in_order[position] < self._next and \
                    position not in self._released and self._release(position):
                self._ready.discard(position)
                self.released_in_backward += 1

    @property
    def backward_extent_agreed(self) -> bool:
        """Whether this backward's gathers end where a forward's end agreed (Note [How far
        backward gathers]): end_backward() then needs no count."""
        return self._in_backward and self._extent is not None

    @property
    def backward_gathers_issued(self) -> int:
        """In backward: how many groups of the order this rank issued gathers for (started
        ones count); 0 outside backward."""
        return self._started if self._in_backward else 0

    def end_backward(self, issued: int | None = None) -> None:
        """Gathers the first `issued` groups of the order (agreed between the ranks: the most
        any of them issued; by default the length the forward's end agreed) so that every rank
        issued the same gathers, then releases everything."""
        if not self._in_backward:
            return
        self.gather_through((self._extent if issued is None else issued) - 1)
        self.release_all()
        self._used_since_backward.clear()
