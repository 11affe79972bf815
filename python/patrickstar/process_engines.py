"""The data-parallel engines that live in one process together: their slots and the one call
sequence they share.

Note [Several engines in one process]
A GAN trains a generator and a discriminator, distillation a student beside a teacher: two
engines, each `patrickstar.initialize(...)`, in every rank's process. Each engine's data-parallel
side (DataParallel) issues its chunk collectives on communicators of its own, and agrees with
the other ranks on each call it makes (Note [Every rank runs the same forwards] in
data_parallel.py). Two things assumed one engine per process:
  * The call agreement ran on each engine's own communicator, so it could only pair calls of
    the same engine. A read of the discriminator on rank 0 alone (logging `p.norm()`, a
    `state_dict()` to save, an evaluation) while rank 1's next call was the generator's forward
    left rank 0 in the discriminator's agreement and rank 1 in the generator's: neither could
    finish, and both waited for `parallel.collective_timeout`, where one engine serves such a
    read at once (Note [Reads on one rank are served]). The script's own collectives joined the
    agreement of every live engine in a weak set's order, an order of object addresses that
    nothing keeps the same between processes.
    So the engines of a process agree on one sequence: one call counter for the process, and
    every agreement on the communicator of one engine (the leader, below), each row naming
    the engine (its slot) besides the call. Ranks at calls of different engines then pair
    up: a read of one engine is served by the other ranks whatever engine their own next
    call belongs to, and calls that differ otherwise raise at once, naming each rank's call
    and engine. A script's collective joins the agreement once, through the
    leader. Between two agreed calls no engine changes what a read reads or issues a
    collective a read's would meet, for every engine, as Note [Calls between a read and its
    serving] says for one.
  * With `parallel.transport` "process_group" every engine's communicators ran over the same
    two torch.distributed groups (the data group and its twin). Each communicator issues from
    its own thread, so two engines' collectives in flight at once (both engines' backward
    collectives, in the generator's loss through the discriminator) reached the shared group
    in an order that differed between ranks, and gloo paired one engine's chunks with the
    other's: the weights came out wrong, silently.
    So each engine takes a slot, the lowest one no engine of any rank holds (agreed at attach:
    an engine collected on one rank and not yet on another still holds its slot), and the
    engine of slot k > 0 runs on groups of its own, built for that slot once per process
    (topology.ParallelGroups.host_data_group / twin_data_group). Slot 0 keeps the groups a
    single engine always had. (The shared-memory transport makes a segment per communicator
    anyway.)
Every rank must create its engines in the same order (creation is a collective), so the slots,
the leader and the groups are the same on every rank. The leader is the lowest slot among the
engines that were live on every rank at the last attach (all-gathered there): an engine still
uncollected on one rank alone leads nothing. The call counter starts afresh when no engine is
live on every rank (a process that ran engines of other topologies before, one after another,
counted other calls on each rank), as each lone engine's counter always did.
"""
from __future__ import annotations

import weakref

__all__ = ["busy_slots", "take_slot", "release", "party", "parties", "leader", "next_call"]

# slot -> weak reference to the DataParallel holding it (C++ holds the engine's hooks, which
# hold the DataParallel; Note [Engine lifetime] in engine.py: nothing here may keep it alive).
_SLOTS: dict[int, weakref.ref] = {}
_calls = 0  # the process's agreed calls, of every engine
# The slots whose engines live on every rank, as far as the last attach could tell: an engine
# closed on the other ranks but not yet collected here (a reference cycle) leads nothing.
_EVERYWHERE: set[int] = set()


def busy_slots() -> list[int]:
    """The slots of this process's live engines."""
    return sorted(slot for slot, ref in _SLOTS.items() if ref() is not None)


def take_slot(data_parallel, busy_on_ranks: list[list[int]], data_ranks) -> int:
    """The lowest slot no rank's live engine holds (`busy_on_ranks`: every rank's busy_slots(),
    all-gathered), now `data_parallel`'s. Every engine of the process must span the same
    data-parallel ranks, as their agreements share one communicator."""
    for other in parties():
        if list(other.data_ranks) != list(data_ranks):
            raise RuntimeError(
                "data parallel: two engines in one process must have the same data-parallel "
                f"group, but a live engine's spans ranks {list(other.data_ranks)} and the new "
                f"one's {list(data_ranks)} (different parallel.pipeline / parallel.tensor); "
                "destroy the first (model.destroy()) before creating the second")
    global _calls
    taken = {slot for slots in busy_on_ranks for slot in slots}
    everywhere = set.intersection(*(set(slots) for slots in busy_on_ranks))
    slot = next(s for s in range(len(taken) + 1) if s not in taken)
    _SLOTS[slot] = weakref.ref(data_parallel)
    _EVERYWHERE.intersection_update(everywhere)
    if not _EVERYWHERE:
        _calls = 0  # a fresh sequence on every rank, as a lone engine's always was
    _EVERYWHERE.add(slot)
    return slot


def release(slot: int | None) -> None:
    """The engine of `slot` is closing: it takes no more part in the agreement."""
    if slot is not None:
        _SLOTS.pop(slot, None)
        _EVERYWHERE.discard(slot)


def party(slot: int):
    """The live DataParallel of `slot`, or None."""
    ref = _SLOTS.get(slot)
    return None if ref is None else ref()


def parties() -> list:
    """The live DataParallel sides, by slot."""
    return [p for p in (party(slot) for slot in sorted(_SLOTS)) if p is not None]


def leader():
    """The live DataParallel whose communicator carries every engine's agreements: the lowest
    slot's of those live on every rank (None when there is none)."""
    for slot in sorted(_EVERYWHERE):
        found = party(slot)
        if found is not None:
            return found
    return None


def next_call() -> int:
    """Counts one more agreed call of this process; its number."""
    global _calls
    _calls += 1
    return _calls
