"""The data-parallel layer's collectives, recorded on the running profiler (profiling/recorder.py);
also the torch.distributed collectives of tensor slicing and of pipeline stages (`group_*`) and
the stages' point-to-point transfers (`transfer_started` / `transfer_finished`).

Every collective a data-parallel rank issues goes through this file: the chunk groups' gathers
and reduce-scatters (`RecordedGroupCollectives`, wrapping a `_C.GroupCollectives`), the small
all-reduces and broadcasts on a `_C.Communicator` (`all_reduce`, `broadcast`) and the pickled
objects of torch.distributed (`all_gather_object`). With no profiler running each call costs one
`active_profiler()` None check more than the bare call.

Note [Recording collectives]
What a record says (Profiler.record_collective):
  * bytes: the collective's payload on this rank, the size of the buffers it fills. For a
    chunk group that is the whole group, world x chunk bytes (one chunk for an oversize tensor
    held by one rank), read as the change of GroupCollectives.bytes_communicated across the
    issuing call, so the profile and that counter agree. This rank sends and receives
    (world - 1) / world of it over the wire for an allgather or a reduce-scatter (its own chunk
    stays); the record keeps the payload because the wire traffic depends on the transport
    (a ring, shared memory, NCCL). For a tensor all-reduce / broadcast: the tensor's bytes; for
    all_gather_object: world x this rank's pickled size (torch pads every rank's object to the
    largest, so this is a lower bound when they differ).
  * start_ns / end_ns (now_ns(), the chunk manager's steady clock): a synchronous collective
    spans its call. A started one (GroupCollectives.start_gather, start_reduce_scatter) runs on
    the communicator's thread: it starts when the issuing call starts and ends when the call
    that finished it returned -- a gather() or release of its group, finish_gathers(),
    release_all(), finish_*reduce_scatters*(). That is when this rank was done with it, not
    when its bytes stopped moving: the C++ handle keeps no completion time, and a
    reduce-scatter that finish_completed_reduce_scatters() found already done may have ended
    well before. The span therefore overlaps the compute it hides behind.
  * wait_start_ns: when the call that finished it began; this rank was blocked in
    [wait_start_ns, end_ns] (one wait can finish several: their intervals coincide). The
    profile's "waiting for collectives" time is the union of these intervals, never the spans.
  * phase: the profiler's phase when the collective was issued (a gather started in forward
    stays a forward gather even if the optimizer step finishes it). Two are issued before the
    module's hooks mark their pass and are counted in it by their caller: a forward's call
    agreement (DataParallel.agree_on_call) and the non-finite loss check that opens a backward
    (DataParallel.ranks_with).
  * args: "group" (the C++ label, e.g. "compute_param group 3") and "collectives" (handles
    issued: under parallel.memory_saving a group's gather is world broadcasts and its
    reduce-scatter world reduces, one record each) for chunk groups;
    "label" for the small ones; "op" for reduce-scatters.
Records of started collectives wait here, in issue order, until a call finishes them. The C++
finishes started gathers (and reduce-scatters) strictly oldest first, so a queue mirrors its
own. A collective issued while no profiler ran is not in the queue; one whose profiler stopped
before it finished is dropped (that profile is written already).
"""
from __future__ import annotations

import collections
import pickle
from typing import Any, Callable

from . import _C
from .profiling.recorder import Profiler, active_profiler, now_ns

__all__ = ["RecordedGroupCollectives", "all_reduce", "broadcast", "all_gather_object",
           "group_all_reduce", "group_all_gather", "group_broadcast", "timed_out",
           "transfer_started", "transfer_finished"]


class _Started:
    """A started collective's record, waiting for the call that finishes it."""
    __slots__ = ("profiler", "name", "first", "nbytes", "start_ns", "phase", "args")

    def __init__(self, profiler: Profiler, name: str, first: int, nbytes: int, start_ns: int,
                 args: dict[str, Any]):
        self.profiler = profiler
        self.name = name
        self.first = first
        self.nbytes = nbytes
        self.start_ns = start_ns
        self.phase = profiler.current_phase
        self.args = args

    def finish(self, wait_start_ns: int, end_ns: int) -> None:
        if self.profiler.running:  # else its profile is written already
            self.profiler.record_collective(self.name, self.nbytes, self.start_ns, end_ns,
                                            phase=self.phase, wait_start_ns=wait_start_ns,
                                            **self.args)


class RecordedGroupCollectives:
    """A `_C.GroupCollectives` whose calls that issue or finish collectives are recorded on the
    running profiler (Note [Recording collectives]); everything else is the wrapped object's.
    `label_of(first_chunk)` names a group for the records ("compute_param group 3")."""

    def __init__(self, collectives, label_of: Callable[[int], str]):
        self.inner = collectives
        self._label_of = label_of
        self._gathers: collections.deque[_Started] = collections.deque()
        self._reduce_scatters: collections.deque[_Started] = collections.deque()

    def __getattr__(self, name: str):
        # Queries and counters (groups, group_of, pending_gathers, collectives_issued...).
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- Gathers ------------------------------------------------------------------------------

    def gather(self, group: int) -> bool:
        profiler = active_profiler()
        if profiler is None:
            self._gathers.clear()  # any left belong to a stopped profiler
            return self.inner.gather(group)
        start, issued, sent = now_ns(), self.inner.collectives_issued, \
            self.inner.bytes_communicated
        try:
            ran = self.inner.gather(group)
        except BaseException:
            self._gathers.clear()  # the C++ abandoned every started gather
            raise
        end = now_ns()
        if self.inner.collectives_issued != issued:
            # Issued and waited for here, after every gather started before it.
            self._finish_gathers_through(len(self._gathers) - 1, start, end)
            self._record_group(profiler, "allgather", group, issued, sent, start, end)
        else:
            self._finish_gathers_through(self._index_of(group), start, end)
        return ran

    def start_gather(self, group: int) -> bool:
        profiler = active_profiler()
        if profiler is None:
            self._gathers.clear()
            return self.inner.start_gather(group)
        start, issued, sent = now_ns(), self.inner.collectives_issued, \
            self.inner.bytes_communicated
        started = self.inner.start_gather(group)
        if self.inner.collectives_issued != issued:
            self._gathers.append(self._started(profiler, "allgather", group, issued, sent, start))
        return started

    def finish_gathers(self) -> None:
        if not self._gathers:
            self.inner.finish_gathers()
            return
        start = now_ns()
        self.inner.finish_gathers()
        self._finish_gathers_through(len(self._gathers) - 1, start, now_ns())

    def release(self, group: int) -> bool:
        """Releasing a group finishes its started gather first (and those started before it)."""
        if not self._gathers:
            return self.inner.release(group)
        start = now_ns()
        released = self.inner.release(group)
        self._finish_gathers_through(self._index_of(group), start, now_ns())
        return released

    def release_all(self, kind) -> None:
        if kind != _C.ChunkKind.COMPUTE_PARAM or not self._gathers:
            self.inner.release_all(kind)
            return
        start = now_ns()
        self.inner.release_all(kind)  # finishes every started gather first
        self._finish_gathers_through(len(self._gathers) - 1, start, now_ns())

    def close(self) -> None:
        self._gathers.clear()
        self._reduce_scatters.clear()
        self.inner.close()

    def _index_of(self, group: int) -> int:
        for index, started in enumerate(self._gathers):
            if started.first == group:
                return index
        return -1

    def _finish_gathers_through(self, index: int, wait_start: int, end: int) -> None:
        for _ in range(index + 1):
            self._gathers.popleft().finish(wait_start, end)

    # ---- Reduce-scatters ----------------------------------------------------------------------

    def start_reduce_scatter(self, group: int, op: str | None = None) -> None:
        profiler = active_profiler()
        if profiler is None:
            self._reduce_scatters.clear()
            self.inner.start_reduce_scatter(group, op=op)
            return
        start, issued, sent = now_ns(), self.inner.collectives_issued, \
            self.inner.bytes_communicated
        self.inner.start_reduce_scatter(group, op=op)
        self._reduce_scatters.append(self._started(profiler, "reduce_scatter", group, issued,
                                                   sent, start, op=op))

    def finish_reduce_scatters(self) -> None:
        if not self._reduce_scatters:
            self.inner.finish_reduce_scatters()
            return
        start = now_ns()
        self.inner.finish_reduce_scatters()
        self._finish_reduce_scatters(len(self._reduce_scatters), start, now_ns())

    def finish_completed_reduce_scatters(self) -> int:
        if not self._reduce_scatters:
            return self.inner.finish_completed_reduce_scatters()
        start, untracked = now_ns(), self._untracked_reduce_scatters()
        finished = self.inner.finish_completed_reduce_scatters()
        self._finish_reduce_scatters(finished - untracked, start, now_ns())
        return finished

    def finish_reduce_scatters_issued_everywhere(self, watched, bound_s: float):
        if not self._reduce_scatters:
            return self.inner.finish_reduce_scatters_issued_everywhere(watched, bound_s)
        start, untracked = now_ns(), self._untracked_reduce_scatters()
        finished, gave_up = self.inner.finish_reduce_scatters_issued_everywhere(watched, bound_s)
        self._finish_reduce_scatters(finished - untracked, start, now_ns())
        return finished, gave_up

    def _untracked_reduce_scatters(self) -> int:
        """Pending ones started before the profiler: the C++ finishes those first."""
        return self.inner.pending_reduce_scatters - len(self._reduce_scatters)

    def _finish_reduce_scatters(self, count: int, wait_start: int, end: int) -> None:
        for _ in range(max(0, min(count, len(self._reduce_scatters)))):
            self._reduce_scatters.popleft().finish(wait_start, end)

    # ---- Records ------------------------------------------------------------------------------

    def _started(self, profiler: Profiler, name: str, group: int, issued: int, sent: int,
                 start: int, **args: Any) -> _Started:
        count = self.inner.collectives_issued - issued
        args = dict(group=self._label_of(group), collectives=count,
                    **{k: v for k, v in args.items() if v is not None})
        return _Started(profiler, name, group, self.inner.bytes_communicated - sent, start, args)

    def _record_group(self, profiler: Profiler, name: str, group: int, issued: int, sent: int,
                      start: int, end: int) -> None:
        self._started(profiler, name, group, issued, sent, start).finish(start, end)


# ---- Collectives on tensors and objects ---------------------------------------------------------

def _recorded(run: Callable[[], Any], name: str, nbytes: Callable[[], int], **args: Any) -> None:
    """Runs `run` (a collective, waited for) and, while a profiler runs, records it as `name`
    of `nbytes()` bytes (sized only then) with `args`."""
    profiler = active_profiler()
    if profiler is None:
        run()
        return
    size = nbytes()
    start = now_ns()
    run()
    profiler.record_collective(name, size, start, now_ns(), **args)


def _tensor_bytes(tensor) -> Callable[[], int]:
    return lambda: tensor.numel() * tensor.element_size()


def all_reduce(communicator, tensor, op: str, label: str, timeout: float,
               phase: str | None = None) -> None:
    """`communicator.all_reduce(tensor)`, waited for, recorded (in `phase`, default the
    profiler's current one)."""
    _recorded(lambda: communicator.all_reduce(tensor, op=op, label=label).wait(timeout),
              "all_reduce", _tensor_bytes(tensor), phase=phase, label=label, op=op)


def broadcast(communicator, tensor, root: int, label: str, timeout: float) -> None:
    """`communicator.broadcast(tensor, root)`, waited for, recorded."""
    _recorded(lambda: communicator.broadcast(tensor, root=root, label=label).wait(timeout),
              "broadcast", _tensor_bytes(tensor), label=label, root=root)


def all_gather_object(gathered: list, obj, group, label: str, phase: str | None = None) -> None:
    """`torch.distributed.all_gather_object(gathered, obj, group)`, recorded (pickling `obj`
    once more to size it, only while a profiler runs)."""
    import torch.distributed as dist
    _recorded(lambda: dist.all_gather_object(gathered, obj, group=group), "all_gather_object",
              lambda: len(gathered) * len(pickle.dumps(obj)), phase=phase, label=label)


# ---- torch.distributed collectives of the tensor-parallel and pipeline layers -------------------

def group_all_reduce(tensor, group, name: str, label: str, op=None) -> None:
    """`torch.distributed.all_reduce(tensor, op, group)` (op default SUM), recorded as `name`
    ("tensor_all_reduce", "pipeline_all_reduce": Note [Recording collectives]) with `label`:
    the tensor slicing's and the pipeline's collectives appear in the profile beside the data
    parallel ones, under names of their own."""
    import torch.distributed as dist
    op = dist.ReduceOp.SUM if op is None else op
    _recorded(lambda: dist.all_reduce(tensor, op=op, group=group), name, _tensor_bytes(tensor),
              label=label, op=str(op).rsplit(".", 1)[-1].lower())


def group_all_gather(parts: list, tensor, group, name: str, label: str,
                     timeout: float | None = None) -> None:
    """`torch.distributed.all_gather(parts, tensor, group)`, recorded as `name` (its payload:
    the parts it fills); waited for at most `timeout` seconds when given (the group's own
    timeout otherwise)."""
    import datetime

    import torch.distributed as dist

    def run():
        if timeout is None:
            dist.all_gather(parts, tensor, group=group)
        else:
            dist.all_gather(parts, tensor, group=group, async_op=True).wait(
                timeout=datetime.timedelta(seconds=timeout))
    _recorded(run, name, lambda: len(parts) * tensor.numel() * tensor.element_size(),
              label=label)


def timed_out(message: str) -> bool:
    """Whether a torch.distributed back end's error `message` says a wait timed out (gloo's
    "Timed out waiting ...", a work's "timed out"), rather than a peer gone."""
    return "Timed out" in message or "timed out" in message or "Timeout" in message


def group_broadcast(tensor, src: int, group, name: str, label: str) -> None:
    """`torch.distributed.broadcast(tensor, src, group)`, recorded as `name`."""
    import torch.distributed as dist
    _recorded(lambda: dist.broadcast(tensor, src=src, group=group), name, _tensor_bytes(tensor),
              label=label, root=src)


# ---- Point-to-point transfers of pipeline stages -------------------------------------------------

def transfer_started():
    """What `transfer_finished` needs of a transfer issued now: (the running profiler, now, its
    phase), or None without a profiler."""
    profiler = active_profiler()
    return None if profiler is None else (profiler, now_ns(), profiler.current_phase)


def transfer_finished(started, name: str, nbytes: int, wait_start_ns: int | None = None,
                      **args: Any) -> None:
    """Records a transfer (pipe/p2p.py's isend / irecv) from its issue (`started`) to now, in
    the phase it was issued in; this rank waited for it from `wait_start_ns` (default: the
    whole span, a receive). Nothing when no profiler ran at the issue or it stopped since."""
    if started is None:
        return
    profiler, start, phase = started
    if profiler.running:
        end = now_ns()
        wait_start = start if wait_start_ns is None else min(max(wait_start_ns, start), end)
        profiler.record_collective(name, nbytes, start, end, phase=phase,
                                   wait_start_ns=wait_start, **args)
