"""GatherSchedule (gather_schedule.py, Note [Resharding after forward]) against a recording
stand-in for the C++ group collectives: which gathers each rank issues, in which order, and what
it releases. The multi-process runs that train against PyTorch are in test_data_parallel.py."""
from __future__ import annotations

import pytest

from patrickstar.gather_schedule import GatherSchedule, ScheduleDepartureError


class RecordingCollectives:
    """GroupCollectives' gather interface, recording the order in which collectives would be
    issued; `decline` lists groups whose first start finds no room (StartGather returns false
    and counts a decline). Refuses to release a group listed in `in_use` (a tensor of it is
    COMPUTE)."""

    def __init__(self, decline=()):
        self.issued, self.started, self.gathered = [], set(), set()
        self.decline = set(decline)
        self.gathers_declined = 0
        self.released: list[int] = []
        self.in_use: set[int] = set()

    def start_gather(self, group):
        if group in self.started or group in self.gathered:
            return False
        if group in self.decline:
            self.decline.discard(group)
            self.gathers_declined += 1
            return False
        self.started.add(group)
        self.issued.append(group)
        return True

    def gather(self, group):
        if group in self.gathered:
            return False
        if group not in self.started:
            self.issued.append(group)
        self.gathered.add(group)
        return True

    def release(self, group):
        if group in self.in_use:
            return False
        self.started.discard(group)
        self.gathered.discard(group)
        self.released.append(group)
        return True

    def release_all(self, kind):
        self.started.clear()
        self.gathered.clear()


GROUPS = 5


def make_schedule(agree=None, gather_ahead=0, compare=None, agree_extent=None):
    # Tensor t is in group t // 2; every tensor is remote and trainable.
    position_of = {t: t // 2 for t in range(2 * GROUPS)}
    return GatherSchedule(RecordingCollectives(), list(range(GROUPS)), position_of,
                          remote=set(position_of), gather_ahead=gather_ahead, reshard=True,
                          trainable=[2] * GROUPS, agree=agree, compare=compare,
                          agree_extent=agree_extent)


class Comparisons:
    """The first forward's all-reduce of every rank's next gather, for one rank: records what
    this rank compared and answers with the other ranks' scripted values (by default its own)."""

    def __init__(self, others=None):
        self.compared: list[int] = []
        self.others = others

    def __call__(self, position):
        self.compared.append(position)
        other = position if self.others is None else self.others[len(self.compared) - 1]
        return [float(position), float(other)]


def forward(schedule, tensors):
    schedule.begin_forward()
    for t in tensors:
        schedule.before_access(t, in_forward=True)
    schedule.end_forward()


def test_the_second_forward_releases_each_group_after_its_traced_last_use():
    schedule = make_schedule()
    plain = list(range(2 * GROUPS))
    forward(schedule, plain)  # no trace yet: nothing released before the forward ends
    assert schedule.released_in_forward == 0
    collectives = schedule.collectives
    schedule.end_backward(0)
    collectives.released.clear()
    schedule.begin_forward()
    for t in plain:
        schedule.before_access(t, in_forward=True)
        # A group is dropped once the forward moved past its last use; the window stays small.
        assert len(collectives.gathered) <= 2, (t, collectives.gathered)
    assert schedule.released_in_forward == GROUPS - 1


def test_a_group_reused_late_stays_gathered_and_a_new_late_reuse_is_a_named_error():
    schedule = make_schedule()
    tied = list(range(2 * GROUPS)) + [0]  # tensor 0 (group 0) used again at the end: tied
    forward(schedule, tied)
    schedule.end_backward(0)
    forward(schedule, tied)  # the trace knows: group 0 stays until its last use
    schedule.end_backward(0)
    schedule.begin_forward()
    for t in range(2 * GROUPS):
        schedule.before_access(t, in_forward=True)
    assert 0 in schedule.collectives.gathered  # its traced last use is still to come
    with pytest.raises(ScheduleDepartureError, match=r"'tensor 2' \(compute group 1 of 5\).*"
                                                     r"reshard_after_forward"):
        schedule.before_access(2, in_forward=True)  # group 1: released after its last use


def test_backward_gathers_follow_the_agreed_order_on_every_rank():
    # The last forward access is of group 0 (a late layer's small tensors packed into the first
    # chunk): backward needs group 0 first. Rank 0's order is every rank's.
    orders = []

    def agree(order):
        orders.append(order)
        return orders[0]

    ranks = [make_schedule(agree), make_schedule(agree)]
    accesses = list(range(2, 2 * GROUPS)) + [0, 1]
    for schedule in ranks:
        forward(schedule, accesses)
    assert orders[0][0] == 0
    for rank, schedule in enumerate(ranks):
        schedule.collectives.issued.clear()
        # Rank 1 skips group 2 in backward (a branch it did not take): same gathers, in order.
        wanted = [0, 1, 4, 3, 2] if rank == 0 else [0, 1, 4, 3]
        for position in wanted:
            schedule.before_access(2 * position, in_forward=False)
    issued = [schedule.backward_gathers_issued for schedule in ranks]
    for schedule in ranks:
        schedule.end_backward(max(issued))
    assert ranks[0].collectives.issued == ranks[1].collectives.issued == orders[0][1:]



def test_a_backward_needing_a_group_only_another_ranks_forward_used_gathers_alike():
    # Note [How far backward gathers]: rank 0's forward routes no token to the expert in group 2,
    # so rank 0's order (every rank's) puts group 2 last; rank 1's does and needs it in
    # backward. The ranks agreed how far backward gathers at the forward's end (the largest
    # extent: rank 1's, the whole order), so rank 0 gathers group 2 too when its backward ends,
    # without a count agreed at that end (which met rank 1's allgather of group 2).
    orders, extents = [], []

    def agree(order):
        orders.append(order)
        return orders[0]

    def agree_extent(extent):
        extents.append(extent)
        return GROUPS  # rank 1's forward used every group

    ranks = [GatherSchedule(RecordingCollectives(), list(range(GROUPS)),
                            {t: t // 2 for t in range(2 * GROUPS)}, remote=set(range(2 * GROUPS)),
                            gather_ahead=0, reshard=True, trainable=[2] * GROUPS, agree=agree,
                            agree_extent=agree_extent) for _ in range(2)]
    used = [[t for t in range(2 * GROUPS) if t // 2 != 2], list(range(2 * GROUPS))]
    for schedule, tensors in zip(ranks, used):
        schedule.begin_forward()
        for t in tensors:
            schedule.before_access(t, in_forward=True)
        schedule.end_forward(backward_follows=True)
    assert orders[0][-1] == 2 and extents == [GROUPS - 1, GROUPS]
    for schedule, tensors in zip(ranks, used):
        assert schedule.backward_extent_agreed
        schedule.collectives.issued.clear()
        for t in reversed(tensors):
            schedule.before_access(t, in_forward=False)
        schedule.end_backward()
    # (the order's first group stays gathered from the forward)
    assert ranks[0].collectives.issued == ranks[1].collectives.issued == orders[0][1:]
    # A backward reading a group no rank's forward used departs, naming the parameter.
    schedule = ranks[0]
    schedule.begin_forward()
    for t in used[0]:
        schedule.before_access(t, in_forward=True)
    extents.clear()
    schedule._agree_extent = lambda extent: extent  # every rank's forward skipped group 2
    schedule.end_forward(backward_follows=True)
    with pytest.raises(ScheduleDepartureError, match="tensor 4.*no rank's forward used"):
        schedule.before_access(4, in_forward=False)


def test_a_backward_after_two_forwards_may_gather_what_either_used():
    # Note [How far backward gathers]: the extent covers every forward since the last backward
    # (a contrastive loss over two forwards, the second using fewer groups).
    schedule = make_schedule(agree_extent=lambda extent: extent)
    for tensors in (range(2 * GROUPS), range(6, 2 * GROUPS)):
        schedule.begin_forward()
        for t in tensors:
            schedule.before_access(t, in_forward=True)
        schedule.end_forward(backward_follows=True)
    schedule.before_access(0, in_forward=False)  # group 0: last in the order, the first's only
    schedule.end_backward()
    assert schedule.collectives.issued[-GROUPS + 1:] == [3, 2, 1, 0]

def test_backward_releases_a_group_once_its_gradients_are_in_and_nothing_uses_it():
    schedule = make_schedule()
    forward(schedule, list(range(2 * GROUPS)))
    collectives = schedule.collectives
    collectives.released.clear()
    for position in reversed(range(GROUPS)):
        schedule.before_access(2 * position, in_forward=False)
        collectives.in_use = {position}
        schedule.on_grad(position)
        schedule.on_grad(position)  # both tensors in: ready, but still in use
        assert position not in collectives.released
        collectives.in_use = set()
    # The next access releases what is ready, but not the group it accesses (used again after
    # its gradients are in: releasing it would make this access a departure from the schedule).
    schedule.before_access(0, in_forward=False)
    assert sorted(collectives.released) == list(range(1, GROUPS))
    assert schedule.released_in_backward == GROUPS - 1


@pytest.mark.parametrize("declined", [[], [0], [2], [1, 3]])
def test_a_declined_start_never_reorders_the_gathers(declined):
    # Note [Started gathers]: a rank without room declines to start a group; it must then start
    # nothing after it either, or a later group's allgather is issued first and pairs with
    # another rank's gather of the declined one.
    schedule = GatherSchedule(RecordingCollectives(declined), list(range(6)), position_of={},
                              remote=set(), gather_ahead=2)
    schedule.gather_through(0)
    schedule.gather_through(3)
    schedule.gather_all()
    assert schedule.collectives.issued == list(range(6))
    assert schedule.collectives.gathers_declined == len(declined)


def test_the_first_forward_releases_groups_whose_tensors_were_all_used():
    compare = Comparisons()
    schedule = make_schedule(compare=compare, gather_ahead=1)
    collectives = schedule.collectives
    schedule.begin_forward()
    for t in range(2 * GROUPS):
        schedule.before_access(t, in_forward=True)
        assert len(collectives.gathered) <= 2, (t, collectives.gathered)
    assert schedule.released_in_forward == GROUPS - 1
    schedule.end_forward()
    # Each gather was compared first, then the end of the forward; nothing started ahead.
    assert compare.compared == list(range(GROUPS)) + [-1]
    assert collectives.issued == list(range(GROUPS))
    assert schedule.gathers_ahead == 0
    # Every group released at its end: the first backward gathers from the start of its order.
    assert not collectives.gathered
    collectives.issued.clear()
    schedule.before_access(2 * (GROUPS - 1), in_forward=False)
    assert collectives.issued == [GROUPS - 1]
    schedule.end_backward(schedule.backward_gathers_issued)
    # The second forward follows the trace and compares nothing.
    forward(schedule, list(range(2 * GROUPS)))
    assert len(compare.compared) == GROUPS + 1


def test_a_group_used_again_in_the_first_forward_is_gathered_again_after_a_comparison():
    compare = Comparisons()
    schedule = make_schedule(compare=compare)
    tied = list(range(2 * GROUPS)) + [0]  # tensor 0 (group 0) used again at the end: tied
    forward(schedule, tied)
    assert schedule.regathered_in_first_forward == 1
    assert schedule.collectives.issued == list(range(GROUPS)) + [0]
    assert compare.compared == list(range(GROUPS)) + [0, -1]


def test_ranks_that_disagree_on_a_gather_of_the_first_forward_fail_naming_each_rank():
    # This rank uses group 0 again; the other rank's forward has ended.
    compare = Comparisons(others=list(range(GROUPS)) + [-1])
    schedule = make_schedule(compare=compare)
    schedule.begin_forward()
    for t in range(2 * GROUPS):
        schedule.before_access(t, in_forward=True)
    issued = list(schedule.collectives.issued)
    with pytest.raises(ScheduleDepartureError,
                       match=r"rank 0 gathers compute group 0, rank 1 ends its forward "
                             r"\(this rank uses parameter 'tensor 1' again\)"):
        schedule.before_access(1, in_forward=True)
    assert schedule.collectives.issued == issued  # no collective was issued unpaired
