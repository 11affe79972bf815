"""Point-to-point transfers between pipeline stages: shape-tagged tensors over torch.distributed.

Note [Shape-tagged transfers]
A receiver cannot know the shape of what comes (sequence lengths vary, a stage may return a
tuple), and a receive into a buffer of the wrong size is undefined with gloo (a hang or garbage).
So every tensor travels as a fixed-size int64 header, then its payload:

    [MAGIC, kind, micro batch, count, index, dtype, ndim, dim0 .. dim8]

kind is ACTIVATION (stage s -> s+1) or GRADIENT (s+1 -> s); count/index number the tensors of
one tuple. The receiver checks the magic, the kind and the micro batch against what its schedule
expects, so two stages running different schedules or accumulation counts fail at once with
both sides named instead of pairing the wrong tensors. Sends are asynchronous (isend) and
awaited at the end of a batch; every receive waits at most `parallel.collective_timeout`
seconds and then raises `TimeoutError` naming the peer stage and rank; a peer whose process
died is `PipelinePeerError` (gloo notices the closed connection at once). Each direction of a
stage pair carries one kind only, so gloo's in-order delivery per (pair, tag) keeps the headers
and payloads of consecutive micro batches in order.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import dtypes, recorded_collectives, topology
from ..profiling.recorder import now_ns

__all__ = ["ACTIVATION", "GRADIENT", "P2P", "PipelinePeerError", "check_gradients"]

ACTIVATION, GRADIENT = 1, 2
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient"}
MAGIC = 0x50535450  # "PSTP"
MAX_DIMS = 9
HEADER = 7 + MAX_DIMS
# A dtype travels as its position in the one dtype table.
_DTYPES = list(dtypes.BY_NAME.values())
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class PipelinePeerError(RuntimeError):
    """A transfer with another stage failed because that stage's process is gone."""


def describe(tensors) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


def check_gradients(stage: int, peer: str, micro: int, outputs, grads) -> None:
    """The gradients a stage receives must match the activations it sent, tensor by tensor."""
    if len(grads) != len(outputs) or any(
            tuple(g.shape) != tuple(o.shape) or g.dtype != o.dtype
            for g, o in zip(grads, outputs)):
        raise ValueError(
            f"pipeline stage {stage}: the gradients received from {peer} for micro batch {micro} "
            f"are [{describe(grads)}], but the activations this stage sent are "
            f"[{describe(outputs)}]; the stages disagree on the model between them")


class P2P:
    """Transfers of one stage with its neighbours (global ranks from `rank_of(stage)`)."""

    def __init__(self, stage: int, rank_of, timeout: float, device=None):
        self.stage = stage
        self.rank_of = rank_of
        self.timeout = timeout
        self.wire = topology.comm_device()  # what the back end sends from and receives into
        self.device = torch.device("cpu") if device is None else device  # what recv returns
        # (work, tensor kept alive, description, its profile record's (started, bytes, peer)
        # on a tensor's last part, else None)
        self._pending: list[tuple] = []

    def peer(self, stage: int) -> str:
        return f"stage {stage} (rank {self.rank_of(stage)})"

    # ---- Sending -------------------------------------------------------------------------------

    def send(self, tensors, to_stage: int, kind: int, micro: int) -> None:
        rank = self.rank_of(to_stage)
        what = f"the {_KIND_NAMES[kind]} of micro batch {micro} to {self.peer(to_stage)}"
        for index, tensor in enumerate(tensors):
            if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPE_CODE:
                raise ValueError(f"pipeline stage {self.stage}: cannot send {what}: tensor "
                                 f"{index} is {describe([tensor])} (at most {MAX_DIMS} dimensions "
                                 f"of {', '.join(str(d) for d in _DTYPES)})")
            header = [0] * HEADER
            header[:7] = [MAGIC, kind, micro, len(tensors), index, _DTYPE_CODE[tensor.dtype],
                          tensor.dim()]
            header[7:7 + tensor.dim()] = list(tensor.shape)
            header = torch.tensor(header, dtype=torch.int64, device=self.wire)
            payload = tensor.detach().to(self.wire).contiguous()
            # The profile's record goes with the payload: finished once both parts are sent.
            record = (recorded_collectives.transfer_started(),
                      header.numel() * header.element_size()
                      + payload.numel() * payload.element_size(), rank)
            for part, part_record in ((header, None), (payload, record)):
                self._pending.append((self._call(dist.isend, what, part, dst=rank, tag=kind),
                                      part, what, part_record))

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        wait_start = now_ns()
        for work, _, what, record in pending:
            self._wait(work, f"sending {what}")
            if record is not None:  # Note [Recording collectives] in recorded_collectives.py
                started, nbytes, rank = record
                recorded_collectives.transfer_finished(started, "pipeline_send", nbytes,
                                                       wait_start, label=what, peer=rank)

    # ---- Receiving -----------------------------------------------------------------------------

    def recv(self, from_stage: int, kind: int, micro: int) -> tuple:
        rank = self.rank_of(from_stage)
        what = f"the {_KIND_NAMES[kind]} of micro batch {micro} from {self.peer(from_stage)}"
        tensors = []
        count = 1
        started, nbytes = recorded_collectives.transfer_started(), 0
        while len(tensors) < count:
            header = torch.empty(HEADER, dtype=torch.int64, device=self.wire)
            self._wait(self._call(dist.irecv, what, header, src=rank, tag=kind),
                       f"receiving {what}")
            values = header.tolist()
            magic, got_kind, got_micro, count, index, code, ndim = values[:7]
            if magic != MAGIC or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS:
                raise RuntimeError(f"pipeline stage {self.stage}: expected a tensor header for "
                                   f"{what}, got {values[:7]}: the stages are out of step")
            if got_kind != kind or got_micro != micro or index != len(tensors):
                raise RuntimeError(
                    f"pipeline stage {self.stage}: expected {what} (tensor {len(tensors)}), got "
                    f"the {_KIND_NAMES.get(got_kind, got_kind)} of micro batch {got_micro} "
                    f"(tensor {index}): do all stages run the same schedule and "
                    f"gradient_accumulation_steps?")
            payload = torch.empty(values[7:7 + ndim], dtype=_DTYPES[code], device=self.wire)
            self._wait(self._call(dist.irecv, what, payload, src=rank, tag=kind),
                       f"receiving {what}")
            tensors.append(payload.to(self.device))
            nbytes += header.numel() * header.element_size() + \
                payload.numel() * payload.element_size()
        recorded_collectives.transfer_finished(started, "pipeline_recv", nbytes, label=what,
                                               peer=rank)
        return tuple(tensors)

    # ---- Errors --------------------------------------------------------------------------------

    def _call(self, fn, what, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:
            raise PipelinePeerError(f"pipeline stage {self.stage}: {what} failed: "
                                    f"{error}") from error

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            message = str(error)
            if recorded_collectives.timed_out(message):
                raise TimeoutError(
                    f"pipeline stage {self.stage}: {what} did not complete within "
                    f"{self.timeout:g} s (config key 'parallel.collective_timeout'); is that "
                    f"stage alive and running the same schedule?") from None
            raise PipelinePeerError(
                f"pipeline stage {self.stage}: {what} failed; that stage's process has probably "
                f"died (see its log): {message.splitlines()[0] if message else error!r}") from None
