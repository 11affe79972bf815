"""Chunk-granular data parallelism (ZeRO-3 style) for the engine.

Launch with `torchrun --nproc_per_node=N train.py` (or `python -m torch.distributed.run`); the
engine finds the world through `torch.distributed` (initializing the default process group from
torchrun's environment if the script did not). Each rank owns chunk r of every communication
group (Note [Communication groups] in chunk/chunk_manager_groups.cc): it keeps the fp32 master /
momentum / variance chunks of its own chunks only, updates only those, and sees the other ranks'
parameters only while a gathered copy lives: from an allgather to the group's last use in that
forward or backward (`parallel.reshard_after_forward`, the default: gather_schedule.py, Note
[Resharding after forward]), or to the next optimizer step without it.
The collectives run in C++ (`patrickstar._C.GroupCollectives` over a `Communicator`: a
shared-memory segment for ranks on one host, or the torch.distributed process group's gloo or
NCCL; Note [Transport]), one per chunk group, never one per tensor. Every collective a rank
issues goes through recorded_collectives.py, which records it on the running profiler (Note
[Recording collectives] there).
With pipeline stages or tensor slices (topology.py) all of this runs within the data group, the
ranks with the same pipe and tensor coordinates; "rank" and "world" below mean that group.

Note [A data-independent collective schedule]
A collective needs every rank at the same point of the same sequence, so the sequence must not
depend on the data (a branch taken on one rank only, mixture-of-experts routing). Both kinds of
group collectives therefore follow a fixed order and only their *timing* follows the data:
  * gathers of compute-param groups go in ascending group order, at most once per optimizer
    step: the first access of a remote tensor of group g, or within a forward of any tensor of
    it, gathers every group up to g not yet gathered since the last step; whatever is left is
    gathered when the forward ends. Gathered remote chunks stay (the chunk manager may still
    evict them to host or NVMe) until the optimizer step changes the parameters, when every
    rank releases them all. So a group is
    never re-gathered within a step, which also makes tied weights and modules called twice
    safe, and with gradient accumulation the micro-steps after the first need no gather.
    With `parallel.gather_ahead` = k > 0 (default 1) gathering group g first *starts* the
    allgathers of groups up to g + k (GroupCollectives.start_gather: issued on the
    communicator's thread, the group pinned, Note [Started gathers] in
    chunk/group_collectives.h), so group g + 1's bytes travel while group g computes; the
    first access of any tensor of a started group, local ones included (its chunk is pinned
    for the send), finishes it. Starting changes when a collective is issued, never which one
    comes next: the sequence is still every group once, ascending, on every rank, and a rank
    that starts nothing ahead pairs with one that does. The optimizer step (release_all), the
    end of forward and state_dict() finish whatever is in flight; a started gather that fails
    raises naming its collective where it is waited for.
  * reduce-scatters of gradient groups go in descending group order (backward runs the model in
    reverse), on every micro-step with `parallel.gradient_accumulation` "sharded" (summed into
    the owner's shard, averaged at the boundary: Note [Sharded accumulation] in
    chunk/group_collectives.h), only on the micro-step that ends an accumulation with "full"
    (the full-size gradients accumulate in their chunks until then): group g is started, on the
    communicator's own thread, as soon as every trainable tensor of g and of all groups after it
    in that order got its gradient, so it overlaps the rest of backward; groups whose tensors
    did not all get a gradient on this rank (an unused branch) are started when backward ends.
    All are awaited before backward returns. Gradients are averaged over the (data) world.
    Before a group's first gradient lands and before each gather of backward, a rank waits
    for the pending reduce-scatters that every rank has already issued (those complete without
    anybody's caller), so backward holds one group's gradients at a time; it never waits for
    one a peer has yet to issue past the moment that peer may be waiting for it (Note [Waiting
    for reduce-scatters every rank issued] in chunk/group_collectives.h). Waiting issues
    nothing: the sequence is the same with or without it.
  * after that, one all-reduce of each parameter's has-gradient flag, and at the optimizer step
    one all-reduce of the squared gradient norm and overflow flag (when clipping or fp16 need
    them): a parameter without a gradient on every rank is skipped as torch would skip it.
The optimizer state and master weights are 1/N per rank. With the defaults (resharding,
sharded accumulation) so are the parameters and gradients, plus the groups in use: two
allgathers per group and micro-step (forward and backward, as ZeRO-3) and one reduce-scatter.
Without resharding a step costs one allgather per group and keeps the full compute parameters
of the step on every rank; with "full" accumulation one reduce-scatter per group and step, and
the full-size gradients on every rank between micro-steps.

Note [Transport]
`parallel.transport` picks the communicators' back end once, at attach, the same on every rank
(every rank decides from the same all-gathered facts). "auto" takes the shared-memory
communicator (runtime/shm_communicator.h) when every rank of the data group is on this host --
same boot id and the same /dev/shm file system, compared by all-gathering them over the group --
and the group is gloo (under an NCCL default group the data group is a gloo one anyway: Note
[Host groups for the chunk collectives] in topology.py); else the process group. Over gloo each
collective goes through TCP loopback, several copies through the kernel on the cores that also
compute: backward's re-gathers under resharding cost ~12 ms per few-MiB group that way
(docs/benchmarks.md). Each communicator gets its own segment, named by data rank 0 and
all-gathered; the name is unlinked as soon as every rank attached. The process groups are made
either way (the twin group for backward's gathers included): creating a group is a collective
of the whole world, so no rank may skip it on a decision another data group made differently.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import weakref

import torch
import torch.distributed as dist

from . import _C, process_engines, recorded_collectives, script_collectives, topology
from .gather_schedule import GatherSchedule
from .guards import forked_child_error
from .model_group_calls import ModelGroupCalls, model_group_agreement
from .recorded_collectives import RecordedGroupCollectives
from .utils.logging import logger
from .vocabulary import Tier

__all__ = ["DataParallel", "close_at_exit", "detect_world"]

K = _C.ChunkKind
S = _C.TensorState
# How long a rank waits in backward for its peers to issue a reduce-scatter before it stops
# waiting for the rest of that backward (Note [Waiting for reduce-scatters every rank issued]):
# lockstep ranks are milliseconds apart; a peer later than this is held up by something this
# rank cannot see, and keeping the gradients then costs memory only.
REDUCE_SCATTER_WAIT_S = 1.0


# Note [Closing at exit from the engines' hook]
# Data-parallel sides not closed yet are closed at interpreter exit, while Python is whole: an
# engine never destroyed would otherwise free its collectives and communicator during
# finalization, after the script's destroy_process_group(), dropping the last reference to the
# c10d group in an order torch does not expect (a rank of a 2-rank benchmark aborted once at
# exit, "terminate called without an active exception"). They are closed by `close_at_exit()`,
# which the engines' one exit hook (engine.py, registered at `import patrickstar`) calls before
# it destroys the engines. Each side used to register a hook of its own at initialize(); atexit
# runs the last registered first, so that hook closed the communicator before an exit function
# the script registered between `import patrickstar` and initialize() (an emergency save)
# could read the model: "'NoneType' object has no attribute 'all_reduce'" under torchrun, where
# one process saved.
# A process forked from a rank (os.fork) inherits the sides, but their collectives' and
# communicators' threads exist only in the parent: closing them at the child's exit died of
# SIGSEGV. The child leaves them alone, as its engines leave their runtime (Note [Engine
# lifetime] in engine.py keeps them referenced, so no destructor runs either).
_unclosed: "weakref.WeakSet[DataParallel]" = weakref.WeakSet()


def close_at_exit() -> None:
    """Closes every data-parallel side not closed yet (Note [Closing at exit from the engines'
    hook]), after serving the reads other ranks still make unless an uncaught exception ends
    the script (printed, sys.last_value set: no read is left to serve)."""
    for data_parallel in list(_unclosed):
        if os.getpid() != data_parallel._attached_pid:
            continue  # a forked child's copy: Note [Closing at exit from the engines' hook]
        if not hasattr(sys, "last_value"):
            data_parallel.agree_at_end()  # Note [Reads on one rank are served]
        data_parallel.close()


def _host_identity() -> tuple[str, str, int]:
    """(host name, boot id, device of /dev/shm): equal on two ranks that can share memory
    through /dev/shm (the name only makes the error readable)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        shm_device = os.stat("/dev/shm").st_dev
    except OSError:
        shm_device = -1
    return socket.gethostname(), boot_id, shm_device


def detect_world(config) -> tuple[int, int, object]:
    """(size, rank, group) of this rank's data-parallel group: (1, 0, None) without
    torch.distributed. The group is the ranks with the same pipeline and tensor coordinates
    (topology.py), the whole world without pipeline or tensor parallelism, a gloo group of
    them where the default group is NCCL; the default process group is initialized from
    torchrun's environment when the script did not."""
    parallel = config.parallel
    groups = topology.initialize_parallel(parallel)
    if groups.data_size == 1:
        return 1, 0, None
    # Note [Host groups for the chunk collectives] in topology.py.
    return groups.data_size, groups.coord.data, groups.host_data_group()


# The longest a rank's end waits for each call of the other ranks (their reads to serve, then
# their own end): a bound, so that a rank ending beside a failed or busy one is not held for the
# collective timeout.
END_WAIT_S = 10.0


class DataParallel:
    """The engine's data-parallel side; every method is a no-op for a world of one."""

    def __init__(self, config, world_size: int, rank: int, group=None):
        self.world_size = world_size
        self.group = group  # None: the default group (WORLD)
        self.rank = rank
        self.enabled = world_size > 1
        self.config = config
        self.timeout = float(config.parallel.collective_timeout)
        self._engine_ref = None  # weak: C++ holds our before_access (Note [Engine lifetime])
        self.early_reduce_scatters = 0  # started while backward was still running
        self.gather_ahead = int(config.parallel.gather_ahead)
        self.gathers: GatherSchedule | None = None  # the compute-param gathers (attach)
        self.collectives = None  # _C.GroupCollectives of the steps (attach)
        self.reshard = False  # parallel.reshard_after_forward, for a world of more than one
        self._waits_for_reduce_scatters = False  # in backward (before_grad), from attach
        # parallel.gradient_accumulation "sharded" with more than one micro-step per step.
        self.sharded_accumulation = (
            config.gradient_accumulation_steps > 1
            and config.parallel.gradient_accumulation == "sharded")
        # Note [Accumulation without the key under data parallelism]: whether it applies (set
        # at attach, which knows the model-parallel groups), DDP's require_backward_grad_sync,
        # what the owners' gradient chunks hold ("average", "sum" or None for nothing this
        # step) and whether local gradients wait for a reduction.
        self.open_accumulation = False
        self.sync_gradients = True
        self._owners_hold: str | None = None
        self._unreduced = False
        # The parameters with a gradient on some rank at the last accumulation end
        # (gradients_anywhere: Note [p.grad after zero_grad(set_to_none=False)] in
        # resting_params.py)
        self._agreed_gradients: set[int] = set()
        self.gather_communicator = None  # backward's gathers' own group (resharding)
        self.transport = None  # "shm" or "process_group" (Note [Transport]), from attach
        self._in_forward = False  # between engine.forward's start and after_forward()
        self._buffers_from_first_rank = True  # Note [Buffers follow the first rank]
        self._closing = False  # close_accumulation's reduce-scatters are a boundary's
        # Note [Several engines in one process] in process_engines.py: this engine's slot there
        # (from attach to close) and the data-parallel ranks it spans.
        self.slot: int | None = None
        self.data_ranks: list[int] = []
        self._serving = False  # inside another rank's read: Note [Reads on one rank are served]
        self._served_forward = False  # this rank's evaluation forward, served by the others
        self._backward_follows = False  # the forward's, agreed (before_forward)
        self._attached_pid = None  # the process that attached the communicator
        # The module's forwards issue collectives of their own (embedding renorms): not served.
        self.forwards_have_collectives = False
        # Pipeline stages / tensor slices: the norm and overflow flag span the model group too.
        self.model_parallel: topology.ModelParallelGradStats | None = None
        # Tensor slices on one data rank: Note [Calls on one rank of a model replica] in
        # model_group_calls.py (pipeline stages agree in their own engine).
        self.model_calls: ModelGroupCalls | None = None
        self._group_labels: dict[int, str] | None = None  # made for the first profile

    @property
    def _engine(self):
        return None if self._engine_ref is None else self._engine_ref()

    # ---- Construction --------------------------------------------------------------------------

    def compute_registration_order(self, specs) -> list[int]:
        """Trainable parameters first when sharded: the compute list then packs them exactly as
        the gradient and optimizer-state lists do, so each parameter's compute, gradient and
        state chunks have the same owner (frozen parameters fill in after)."""
        if not self.enabled:
            return list(range(len(specs)))
        trainable = [i for i, spec in enumerate(specs) if spec.requires_grad]
        return trainable + [i for i, spec in enumerate(specs) if not spec.requires_grad]

    def attach(self, engine) -> None:
        """After the chunk lists are built: agree on the layout, check ownership, create the
        communicator. A rank whose layout differs fails here on every rank, with both hashes."""
        self._engine_ref = weakref.ref(engine)
        groups = topology.current()
        if groups is not None and groups.pipe_size * groups.tensor_size > 1:
            self.model_parallel = topology.ModelParallelGradStats(engine, groups)
            if groups.pipe_size == 1:
                self.model_calls = model_group_agreement(
                    groups, self._CALLS, "evaluate on every rank (each gets the same loss) and "
                    "print or log on one.", self.timeout)
        if not self.enabled:
            return
        self.open_accumulation = engine.guard.open_accumulation
        manager = engine.chunks.manager
        hashes = [None] * self.world_size
        dist.all_gather_object(hashes, (int(manager.layout_hash), engine.layout["num_chunks"]),
                               group=self.group)
        if len(set(hashes)) != 1:
            raise RuntimeError(
                "data parallel: the chunk layouts differ between ranks (layout hash, chunks per "
                f"rank: {hashes}); every rank must build the same model with the same config "
                "(default_chunk_size, precision, frozen parameters)")
        for index, ids in enumerate(engine.params.ids):
            owned = {self.owns(manager, t) for t in ids.all()}
            if len(owned) != 1:
                raise RuntimeError(f"data parallel: parameter '{engine.params.names[index]}' has "
                                   "its chunks on different ranks (layout bug)")
        parallel = self.config.parallel
        # Note [Several engines in one process] in process_engines.py: a slot, and for any but
        # the first engine process groups of its own.
        self.data_ranks = list(groups.data_ranks) if groups is not None else []
        self.slot = process_engines.take_slot(
            self, self.all_gather_object(process_engines.busy_slots(), "engine slots"),
            self.data_ranks)
        if self.slot == 0:
            group = dist.group.WORLD if self.group is None else self.group
        else:
            group = groups.host_data_group(self.slot)
        self.transport = self._choose_transport(parallel.transport, group)
        self.communicator = self._make_communicator(group, "steps")
        self.reshard = bool(parallel.reshard_after_forward)
        # Backward finishes reduce-scatters before new gradients land (before_grad) only with
        # resharding and without pipeline stages or tensor slices; only then may a pending one
        # pin gradient chunks where they are (no copy into the host tier). Gathers receive into
        # the compute tier when it has free room (Note [Receiving where the group is computed
        # on] in chunk/group_collectives.h).
        self._waits_for_reduce_scatters = self.reshard and self.model_parallel is None
        # Without pipeline stages forward's started gathers receive into the compute tier too,
        # while it has free room for twice them (Note [Receiving where the group is computed
        # on]).
        self.collectives = RecordedGroupCollectives(_C.GroupCollectives(
            manager, self.communicator, tier=Tier.HOST, timeout_s=self.timeout,
            memory_saving=parallel.memory_saving, gradient_op="avg",
            gradients_in_place=self._waits_for_reduce_scatters,
            compute_tier=engine.compute_tier,
            started_in_compute_tier=self.model_parallel is None), self._group_label)
        _unclosed.add(self)  # Note [Closing at exit from the engines' hook]
        self._attached_pid = os.getpid()  # a forked child's end agrees on nothing
        compute_groups = self.collectives.groups(K.COMPUTE_PARAM)
        position = {first: p for p, first in enumerate(compute_groups)}
        # Compute tensors -> position of their group in the gather order; whether remote.
        gather_position = {}
        remote = set()
        self._owned = []
        self._compute_position = []  # parameter index -> its compute group's position
        trainable = [0] * len(compute_groups)
        frozen = set()
        for ids in engine.params.ids:
            self._owned.append(self.owns(manager, ids.compute))
            p = position[self.collectives.group_of(ids.compute)]
            gather_position[ids.compute] = p
            self._compute_position.append(p)
            if ids.grad is not None:
                trainable[p] += 1
            else:
                frozen.add(p)
            if not self._owned[-1]:
                remote.add(ids.compute)
        gatherer = self.collectives
        if self.reshard:
            # Note [Resharding after forward]: backward's gathers get their own communicator
            # (over their own process group, or their own segment).
            self.gather_communicator = self._make_communicator(
                groups.twin_data_group(self.slot), "gathers")
            gatherer = RecordedGroupCollectives(_C.GroupCollectives(
                manager, self.gather_communicator, tier=Tier.HOST, timeout_s=self.timeout,
                memory_saving=parallel.memory_saving, gradient_op="avg",
                compute_tier=engine.compute_tier,
                started_in_compute_tier=self.model_parallel is None), self._group_label)
        names = {ids.compute: name for ids, name in zip(engine.params.ids, engine.params.names)}
        self.gathers = GatherSchedule(gatherer, compute_groups, gather_position, remote,
                                      self.gather_ahead, reshard=self.reshard,
                                      trainable=trainable, frozen=frozen,
                                      name_of=lambda tensor_id: names.get(tensor_id, tensor_id),
                                      agree=self._agree_on_rank_zeros,
                                      compare=self._compare_next_gathers,
                                      before_backward_gather=self._finish_reduce_scatters,
                                      agree_extent=self._agree_backward_extent)
        # Gradient groups in reduce-scatter order, and which parameters each one waits for.
        self._grad_groups = list(reversed(self.collectives.groups(K.GRADIENT)))
        grad_position = {first: p for p, first in enumerate(self._grad_groups)}
        self._grad_group_of = {}
        self._group_size = [0] * len(self._grad_groups)
        for index, ids in enumerate(engine.params.ids):
            if ids.grad is not None:
                p = grad_position[self.collectives.group_of(ids.grad)]
                self._grad_group_of[index] = p
                self._group_size[p] += 1
        self._reset_accumulation()

    def _group_label(self, first: int) -> str:
        """The name the C++ gives the chunk group whose first chunk is `first` ("compute_param
        group 3"), for profiles: the layout is read once, when a profile first needs it."""
        if self._group_labels is None:
            chunks = json.loads(self._engine.chunks.manager.layout_json())["chunks"]
            self._group_labels = {c["id"]: f"{c['kind']} group {c['group']}" for c in chunks}
        return self._group_labels.get(first, f"chunk {first}")

    def _choose_transport(self, transport: str, group) -> str:
        """"shm" or "process_group" for `parallel.transport` (Note [Transport])."""
        if transport == "process_group":
            return transport
        hosts = self.all_gather_object(_host_identity())
        one_host = len(set(hosts)) == 1 and hosts[0][2] != -1  # -1: no /dev/shm
        if transport == "shm":
            if not one_host:
                raise ValueError(
                    "config key 'parallel.transport': 'shm' needs every data-parallel rank on "
                    f"one host, but they are on {sorted({h[0] for h in hosts})} (or on one host "
                    "without a shared /dev/shm); use 'auto' or 'process_group'")
            return transport
        return "shm" if one_host and dist.get_backend(group) == "gloo" else "process_group"

    def _make_communicator(self, group, purpose: str):
        parallel = self.config.parallel
        if self.transport == "shm":
            # Data rank 0's name for everybody: new for every communicator (and every run).
            name = self.all_gather_object(
                f"/patrickstar-{os.getpid()}-{secrets.token_hex(8)}-{purpose}")[0]
            return _C.shm_communicator(name, rank=dist.get_rank(group),
                                       world_size=dist.get_world_size(group),
                                       timeout_s=self.timeout)
        return _C.process_group_communicator(
            group.group_name, reduce_scatter=parallel.reduce_scatter, timeout_s=self.timeout)

    def close(self) -> None:
        """Waits for started gathers and drops the collectives, then the communicator (and this
        rank's reference to the c10d process group); engine.destroy() and interpreter exit."""
        _unclosed.discard(self)
        process_engines.release(self.slot)
        self.slot = None
        # Closed, not only dropped: a traceback may keep them past the manager's close (Note
        # [Closing the collectives before the manager] in bindings/init_comm.cc).
        for owner in (self.gathers, self.collectives):
            if owner is not None:
                owner.close()  # the collectives wait for started gathers
        self.collectives = None
        self.gathers = None
        self.communicator = None
        self.gather_communicator = None

    def _refuse_in_forked_child(self, what: str) -> None:
        """Raises in a process forked from the one that attached (os.fork, a multiprocessing
        or DataLoader worker): its collective, issued on the parent's communicator, waited
        for peers until the timeout (`model.module(x)`, its state_dict(); save_checkpoint()
        forever), on a shared-memory segment the parent and its peers use too. The engine's
        own calls raise earlier (Note [Training call order] in guards.py)."""
        if self._attached_pid not in (None, os.getpid()):
            raise forked_child_error(what, self._attached_pid)

    def all_gather_object(self, obj, label: str = "objects") -> list:
        """Every rank's picklable `obj` in rank order (`[obj]` for a world of one), over the
        data group with the default group's timeout: a dead peer or one stalled past the
        timeout raises instead of hanging (checkpoints share names, records and failures with
        it). `label` names it in profiles."""
        if not self.enabled:
            return [obj]
        self._refuse_in_forked_child(f"gathering {label}")
        gathered = [None] * self.world_size
        recorded_collectives.all_gather_object(gathered, obj, self.group, label)
        return gathered

    def owns(self, manager, tensor_id: int) -> bool:
        """Whether this rank keeps the chunk of `tensor_id` (always, for a world of one)."""
        return not self.enabled or manager.is_local(manager.tensor_info(tensor_id)["chunk"])

    def keeps(self, chunked, index: int, kind) -> bool:
        """Whether parameter `index` of `chunked` (ChunkedParams) has a tensor of `kind` whose
        chunk this rank keeps."""
        tensor_id = chunked.tensor_id(index, kind)
        return tensor_id is not None and self.owns(chunked.chunks.manager, tensor_id)

    def after_init(self) -> None:
        """Every rank built the whole model; keep only the owned compute chunks (with
        `parallel.remake_compute`, not even those of them that their masters can make again)."""
        if self.enabled:
            remake = self.config.parallel.remake_compute
            if remake is None:  # "auto": not on a GPU yet (it converts on the host)
                remake = self._engine.device.type != "cuda"
            if remake:
                # Note [Compute chunks re-made from the master] in chunk/chunk_manager_remake.cc.
                pairs = [(ids.compute, ids.master) for ids in self._engine.params.ids
                         if ids.master is not None]
                if pairs:
                    self._engine.chunks.manager.set_remake_sources(pairs)
            self.collectives.release_all(K.COMPUTE_PARAM)
            self._engine.chunks.before_access = self._before_access

    # ---- Gathers ------------------------------------------------------------------------------

    def _before_access(self, tensor_id: int) -> None:
        self.gathers.before_access(tensor_id, self._in_forward)

    # Note [Every rank runs the same forwards]
    # Each forward gathers the parameters from every rank, and one followed by a backward
    # reduce-scatters its gradients, so every rank must run the same forwards in the same order;
    # so must every rank read the state dicts (model.state_dict() gathers every group,
    # optimizer.state_dict() every owner's Adam state). A script that evaluates or saves on one
    # rank only (nanoGPT's estimate_loss() and checkpointing under `if master_process:`, fine with
    # DDP, where every rank holds the whole model) makes the ranks' collectives pair up wrongly:
    # on two communicators (gathers and reductions) nothing pairs, and both ranks waited for the
    # collective timeout (300 s by default) before an error that could only guess the cause. So
    # each of these calls starts with one small all-reduce of every rank's count of such calls
    # and what the call is (a forward followed by a backward, one that is not, a state-dict
    # read): ranks that differ raise at once, naming what each rank is running. Cost: one
    # all-reduce of 2 x world floats per call (microseconds over shared memory). The engines of
    # one process (a GAN's two) make one sequence of such calls together: Note [Several engines
    # in one process] in process_engines.py.
    _CALLS = {0: "a forward without backward (eval() or no_grad())",
              1: "a training forward (a backward follows)",
              2: "model.state_dict()", 3: "optimizer.state_dict()",
              **script_collectives.KINDS}
    # A read of a parameter's value by user code at rest (Note [Parameter reads agree] below).
    PARAMETER_READ = 99
    _CALLS[PARAMETER_READ] = ("a read of a parameter's value outside the forward (p.norm(), "
                              "print(p), p.detach(), copy.deepcopy(model.module))")
    # The calls that change what a read reads, or whose collectives a read's would meet (Note
    # [Calls between a read and its serving]).
    BACKWARD, OPTIMIZER_STEP, GRADIENT_CLIP = 100, 101, 102
    GENERATE = 103  # Note [Generating on one rank] in synced_generate.py
    _CALLS[GENERATE] = "model.generate(...)"
    # Note [Writes on one rank are refused]
    # A load writes each rank's own shards only, and a save or a model.apply(fn) makes
    # collectives of its own: called on one rank alone (DDP's habit of loading or saving under
    # `if rank == 0:`, fine where every rank holds the whole model), a load silently left the
    # other ranks' shards as they were (rank 0 trained on a mix of loaded and initial weights),
    # and a save or an apply waited for the collective timeout (300 s) before an error that
    # could only guess the cause. They join the agreement as kinds of their own, never served:
    # on one rank alone they raise at once on every rank, naming what each runs.
    MODEL_LOAD, OPTIMIZER_LOAD, CHECKPOINT_SAVE, MODULE_APPLY = 104, 105, 106, 107
    _CALLS[MODEL_LOAD] = ("model.load_state_dict() (or model.module's, a submodule's, "
                          "vector_to_parameters(): each rank loads its own shards: load on "
                          "every rank)")
    _CALLS[OPTIMIZER_LOAD] = ("optimizer.load_state_dict() (each rank loads its own shards: "
                              "load on every rank)")
    _CALLS[CHECKPOINT_SAVE] = ("model.save_checkpoint() (each rank writes its own shards: save "
                               "on every rank)")
    _CALLS[MODULE_APPLY] = "model.apply(fn) or summon_full_params() (call it on every rank)"
    _CALLS[BACKWARD] = "a backward (model.backward(loss) or loss.backward())"
    _CALLS[OPTIMIZER_STEP] = "optimizer.step()"
    _CALLS[GRADIENT_CLIP] = "clip_grad_norm_()"
    # The profile phase an agreement counts in: issued before its call marks its phase.
    _PHASE_OF = {0: "forward", 1: "forward", BACKWARD: "backward",
                 OPTIMIZER_STEP: "optimizer", GRADIENT_CLIP: "optimizer"}

    def before_forward(self, backward_follows: bool = True, buffers=(),
                       syncs_norms: bool = False) -> None:
        """`buffers`: the module's buffers (an iterable, read only when they are synced),
        which the forwards DDP syncs take from rank 0 (Note [Buffers follow the first rank]).
        `syncs_norms`: a SyncBatchNorm of the module is in train mode (Note [SyncBatchNorm in
        a forward on one rank] in ddp_methods.py)."""
        self._in_forward = self.enabled
        self._backward_follows = backward_follows  # agreed: the same on every rank
        self._served_forward = False  # (an earlier served forward that raised left it set)
        kind = self.forward_kind(backward_follows, syncs_norms)
        if not self.enabled:
            self.agree_on_model_group(kind)
        else:
            served = self.agree_on_call(kind)
            if served:  # Note [Reads on one rank are served]: every group, then no collective
                # (and the buffers left be: Note [Buffers follow the first rank])
                self.gathers.gather_all()
                self._in_forward = False
                self._served_forward = True
            else:
                if self._buffers_from_first_rank:
                    self._broadcast_buffers(list(buffers))
                self._buffers_from_first_rank = backward_follows and self._boundary()
                self.gathers.begin_forward()

    def forward_kind(self, backward_follows: bool, syncs_norms: bool) -> int:
        """The call kind of a forward (before_forward's arguments)."""
        return 1 if backward_follows else self.SYNCED_NORMS_FORWARD if syncs_norms else 0

    # Note [Buffers follow the first rank]
    # Buffers (BatchNorm's running statistics and batch count) are the module's own tensors on
    # every rank, outside the chunks, and each rank's forward updates them from its own batch.
    # Left alone they drifted apart: rank 1 evaluated and saved the statistics of its own shards
    # only. Torch's DDP (broadcast_buffers=True, its default) broadcasts rank 0's buffers before
    # a forward, and decides at the end of each forward whether the next one does: the first
    # forward and every forward after a training forward do. So all ranks train from rank 0's
    # statistics plus their own last batch, and the first evaluation forward after training
    # makes every rank's buffers rank 0's (every rank then evaluates and saves alike); later
    # evaluation forwards, and the training forward after them, broadcast nothing. The engine
    # does the same, with "training forward" meaning one a backward follows, whose kind every
    # rank agreed on just before (agree_on_call), so every rank decides the same. With
    # gradient_accumulation_steps the micro-steps before the last are DDP's under no_sync(),
    # whose forwards leave the next forward unsynced: only a training forward whose backward
    # ends the accumulation makes the next forward broadcast (the first micro-step of each
    # step, or the evaluation after the last), as DDP's. A forward on one rank alone, served by
    # the others (Note [Reads on one rank are served]), is a DDP script's `ddp.module(x)` under
    # `if rank == 0:`, which DDP never sees: it broadcasts nothing and leaves the decision as it
    # was, so the next training forward still gives every rank rank 0's buffers, with what an
    # evaluation in train mode added to them there (it had broadcast them before that
    # evaluation and cleared the decision: rank 1 then trained a step from its own). The buffers
    # go as bytes packed into one float32 tensor (the communicators take float dtypes only; a
    # broadcast copies bytes, so int64 counters and bools come through unchanged).
    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        if not buffers:
            return
        parts = [b.detach().reshape(-1).cpu().contiguous().view(torch.uint8) for b in buffers]
        packed = torch.cat(parts)
        packed = torch.cat([packed, packed.new_zeros(-packed.numel() % 4)])
        values = packed.view(torch.float32)
        recorded_collectives.broadcast(self.communicator, values, 0, "module buffers",
                                       self.timeout)
        if self.rank == 0:
            return
        offset = 0
        with torch.no_grad():
            for buffer, part in zip(buffers, parts):
                data = packed[offset:offset + part.numel()].clone().view(buffer.dtype)
                buffer.copy_(data.view(buffer.shape))
                offset += part.numel()

    @property
    def module_type(self) -> str:
        """The class name of the engine's module, for errors naming the engine."""
        engine = self._engine
        return "module gone" if engine is None else type(engine.module).__name__

    @property
    def in_forward(self) -> bool:
        """Between a forward's start and its end (not a served one's)."""
        return self._in_forward

    def agree_on_script_collective(self, kind: int) -> None:
        """A torch.distributed collective of the script itself, between the engines' calls
        (Note [The script's own collectives] in script_collectives.py): once per process, on
        whichever engine (Note [Several engines in one process] in process_engines.py)."""
        if self.enabled and self.communicator is not None:
            self.agree_on_call(kind)

    # Note [A peer gone before a forward]
    # `model.module.generate(...)` without synced_gpus (Note [Generating on every rank] in
    # synced_generate.py) on ranks generating different numbers of tokens: the rank done first
    # went on to the script's end and left, and the other's next forward failed in this
    # agreement with only the transport's words ("rank 0 closed its communicator before it
    # could publish step ..."), never reaching the mismatch message below that names the
    # remedy. A forward's agreement failing so says what the usual cause is. (Since the
    # engine's end serves the other ranks' forwards, Note [Reads on one rank are served], that
    # generate works; what is left is work on one rank coming after the others' END_WAIT_S,
    # whose remedy is a barrier.)

    # Note [Reads on one rank are served]
    # A DDP script saves under `if rank == 0:` (nanoGPT's `checkpoint = {'model':
    # raw_model.state_dict(), 'optimizer': optimizer.state_dict()}`, Hugging Face's Trainer,
    # whose checkpoints and save_model() read both state dicts on the main process only), logs
    # `p.norm()` there, and evaluates there (nanoGPT's estimate_loss() under `if
    # master_process:`). With DDP every rank holds everything; here those reads gather the
    # other ranks' shards. They are reads: their collectives (gather_all, the optimizer state's
    # all_gather_object) change nothing on the ranks that join them and need nothing but the
    # state every rank shares between calls. A forward without backward is made one too: a
    # served one gathers every group first (broadcasting no buffers: Note [Buffers follow the
    # first rank]) and then runs with no collective at all (no gather schedule, no resharding,
    # no first-forward comparison; the groups stay gathered, as after a state_dict(), until the
    # next training forward or step), so its collectives do not depend on what the module does
    # with the weights. So when the call agreement finds some ranks at one read kind (_SERVED, and a
    # forward without backward or a generate where forwards_served) and every other rank at
    # one other call, the readers go on with their read and the others serve it first, making
    # the read's collectives in the same order (their own agreements skipped: the readers
    # agreed once for the whole read), then agree again on their own call; a reader that reads
    # again (optimizer.state_dict() after model.state_dict()) is served again, until every
    # rank reaches the same call. Two different reads at once (rank 0 evaluating under `if
    # rank == 0:` while the others are already at the state_dict() every rank then makes, or
    # at a p.norm() of their own) serve the read of the lowest rank first: the other readers
    # serve it and agree again on their own read, which that rank's next call meets or serves
    # in turn (before, both raised, though each read alone would have been served). A forward
    # that cannot be served (its module's own collectives, model parallelism) still raises on
    # every rank at once, naming each rank's call. A serving rank's own call may be
    # a forward's start (it is not inside the forward yet for the read's gathers). The engine's
    # end (destroy(), `del`, the exit hooks) agrees too (ENGINE_END, agree_at_end), so a rank
    # whose script ends first still serves what the others read then (Hugging Face's
    # `trainer.save_model()` after train(), on the main process only), but waits at most
    # END_WAIT_S for each of their calls: the collector, not the script, times a `del`, and a
    # rank ending beside a failed or busy one must not wait for the collective timeout. A read
    # that comes later than that finds the rank gone; its error names the barrier to add.
    _SERVED = (2, 3, PARAMETER_READ)
    # The engine's end on this rank (destroy(), `del`, interpreter exit): agree_at_end.
    ENGINE_END = 98
    _CALLS[ENGINE_END] = "the engine's end (model.destroy(), del, or the script's exit)"
    # Note [SyncBatchNorm in a forward on one rank] in ddp_methods.py: never served.
    SYNCED_NORMS_FORWARD = 96
    _CALLS[SYNCED_NORMS_FORWARD] = (
        "a forward without backward with SyncBatchNorm layers in train mode (their own "
        "collectives: it cannot be served by the other ranks; evaluate on every rank, or in "
        "eval mode, whose running statistics make no collective)")
    _PHASE_OF[SYNCED_NORMS_FORWARD] = "forward"
    # Note [A forward's end agrees]
    # A training forward's end agrees how far backward gathers (Note [How far backward
    # gathers] in gather_schedule.py) on the gather communicator, which the next call's
    # agreement does not use: a rank whose forward raised and whose script went on to the next
    # batch met it with its next forward's agreement, and both waited for the collective
    # timeout instead of saying that the ranks' calls differ. So the ranks agree on the call
    # first, as a kind of its own, on the call communicator (one small all-reduce more per
    # training forward). Nothing is served there: every rank started this forward.
    FORWARD_END = 95
    _CALLS[FORWARD_END] = "the end of a training forward"
    _PHASE_OF[FORWARD_END] = "forward"
    # The end of `with model.join():` (Note [DDP's join() for uneven inputs] in ddp_methods.py).
    JOIN_END = 97
    _CALLS[JOIN_END] = ("the end of `with model.join():` (this rank's inputs ran out first: "
                        "uneven inputs are not shadowed here, as DDP's join() does; give every "
                        "rank as many batches, as DistributedSampler's equal shards do)")
    # The calls whose collectives span the tensor slices (Note [Calls on one rank of a model
    # replica] in model_group_calls.py).
    _MODEL_GROUP_CALLS = (0, 1, SYNCED_NORMS_FORWARD, BACKWARD, OPTIMIZER_STEP, GRADIENT_CLIP)

    # Note [Calls between a read and its serving]
    # A read on one rank waits for the other ranks' next agreed call (Note [Reads on one rank
    # are served]), and whatever those ranks run before it must leave the state the read
    # gathers as it was, and issue no collective of its own. optimizer.step() and backward did
    # neither: a DDP script logging or saving on rank 0 after backward and before the step got
    # rank 1's shards *after* rank 1's step beside its own before it (the weights of two
    # different steps, silently; optimizer.state_dict() mixed step counts), and a read between
    # a forward and its backward met rank 1's backward (its non-finite loss check, or under
    # fp16 its gathers on another communicator) and failed. So backward, the step and
    # clip_grad_norm_ (its norm is a collective) join the agreement too, as kinds of their
    # own, and serve a waiting read before they change or issue anything (one small
    # all-reduce more per backward, step and clip); zero_grad() changes nothing a read reads.
    def generates_alone(self) -> bool:
        """model.generate(...) starts: True when the other ranks serve it, this rank alone
        generating (Note [Generating on one rank] in synced_generate.py)."""
        return (self.enabled and self.communicator is not None
                and self.agree_on_call(self.GENERATE))

    def agree_on_training_call(self, kind: int) -> None:
        """A backward, step or clip (Note [Calls between a read and its serving])."""
        if self.enabled and self.communicator is not None:
            self.agree_on_call(kind)
        elif not self.enabled:
            self.agree_on_model_group(kind)

    def agree_on_model_group(self, kind: int) -> None:
        """Without data parallelism, a call whose collectives span the tensor slices (Note
        [Calls on one rank of a model replica] in model_group_calls.py); others agree on
        nothing."""
        if self.model_calls is not None and kind in self._MODEL_GROUP_CALLS:
            self.model_calls.agree(kind)

    def _served_call(self, rows: list[tuple[int, int, int]]) -> tuple[int, int] | None:
        """The read (kind, engine slot) the other ranks serve (Note [Reads on one rank are
        served]; of any engine of the process: Note [Several engines in one process] in
        process_engines.py), or None when the ranks' calls differ otherwise. Decided from what
        every rank shares (the rows, the gather trace, the models), so every rank decides the
        same."""
        if len({count for count, _, _ in rows}) != 1:
            return None
        calls = {(kind, slot) for _, kind, slot in rows}
        reads = [(kind, slot) for kind, slot in calls if self._is_served(kind, slot)]
        if len(calls) != 2 or not reads:
            return None
        # Two reads: the lowest rank's first (rows are in rank order, so every rank picks it).
        return reads[0] if len(reads) == 1 else (rows[0][1], rows[0][2])

    def _is_served(self, kind: int, slot: int) -> bool:
        """Whether a call `kind` of the engine of `slot` alone on some ranks is served."""
        reader = process_engines.party(slot)
        if reader is None:
            return False
        return kind in self._SERVED or (kind in (0, self.GENERATE) and reader.forwards_served())

    def forwards_served(self) -> bool:
        """An evaluation forward on one rank is served unless the module's forward has
        collectives of its own (embedding renorms) or model parallelism spans the forward."""
        return (self.model_parallel is None and not self.forwards_have_collectives
                and self.gathers is not None)

    def serve(self, kind: int) -> None:
        """Makes the collectives of another rank's read `kind` of this engine, as that read
        makes them (agree_on_call of any engine of the process calls it)."""
        engine = self._engine
        in_forward, self._in_forward, self._serving = self._in_forward, False, True
        try:
            if kind == 3:
                engine.optimizer.state_dict()
            elif kind != self.GENERATE:  # a generate's forwards, each served as one, follow
                self.gathers.gather_all()  # state dicts, parameter reads, served forwards
        finally:
            self._in_forward, self._serving = in_forward, False

    def agree_at_end(self) -> None:
        """The engine's end on this rank: serves the reads the other ranks still make (a
        final `trainer.save_model()` on the main process while this rank's script ends) until
        every rank reaches its end, waiting at most END_WAIT_S for each of their calls (Note
        [Reads on one rank are served]). A peer gone, a peer that does not come in time or calls
        that differ end it with a log line: the end goes on."""
        if not self.enabled or self.communicator is None or os.getpid() != self._attached_pid:
            return
        timeout, self.timeout = self.timeout, min(self.timeout, END_WAIT_S)
        try:
            self.agree_on_call(self.ENGINE_END)
        except Exception as error:  # noqa: BLE001 (the end goes on; the other ranks raise)
            logger.info("the engine's end: the ranks' last agreement: %s", error)
        finally:
            self.timeout = timeout

    def agree_on_call(self, kind: int) -> bool:
        """Every rank is at the same collective call (a key of _CALLS) of the same engine, or
        serves another rank's read first (Note [Reads on one rank are served]), whichever
        engine of the process it reads (Note [Several engines in one process] in
        process_engines.py); a no-op for one rank. True when the other ranks serve this rank's
        call."""
        if not self.enabled or self._serving:
            return False
        self._refuse_in_forked_child(self._CALLS.get(kind, "a call"))
        while True:
            rows = self._agree_once(kind)
            if all(row == rows[self.rank] for row in rows):
                return False
            served = self._served_call(rows)
            if served is None:
                self._raise_calls_differ(kind, rows)
            if served == (kind, self.slot):
                return True  # this rank reads; the others serve it
            process_engines.party(served[1]).serve(served[0])

    # A row's second value is the call's kind plus this multiple of its engine's slot (Note
    # [Several engines in one process]): two values per rank, exact in fp32, as before.
    _SLOT_STRIDE = 256

    def _agree_once(self, kind: int) -> list[tuple[int, int, int]]:
        """(call count, kind, engine slot) of every rank, agreed on the leader's communicator
        (Note [Several engines in one process] in process_engines.py)."""
        calls = process_engines.next_call()
        slot = self.slot or 0
        leader = process_engines.leader() or self
        # The count is exact in fp32 and wraps on every rank alike. A forward's agreement
        # precedes its first hook: profiles count it in the forward (a backward's and a
        # step's in theirs).
        try:
            rows = [(int(count), int(what) % self._SLOT_STRIDE, int(what) // self._SLOT_STRIDE)
                    for count, what in self._every_ranks_row(
                        (calls % (1 << 23), slot * self._SLOT_STRIDE + kind),
                        leader.communicator, "call count and kind", self._PHASE_OF.get(kind))]
        except Exception as error:
            # Note [A peer gone before a forward], Note [Reads on one rank are served]
            if kind in (0, 1, self.GENERATE) or kind in self._SERVED:
                error.add_note(
                    f"PatrickStar: this rank was starting {self._CALLS[kind]} (call "
                    f"{calls}) when another rank failed or left. If that rank finished "
                    f"its work normally, its engine's end served this rank's work for "
                    f"END_WAIT_S ({END_WAIT_S:g}) seconds per call only: work on one rank that "
                    f"comes later (sampling, evaluating or saving on the main process after "
                    f"the others are done) needs torch.distributed.barrier() (or "
                    f"accelerator.wait_for_everyone()) on every rank after it, before the "
                    f"ranks part; model.save_checkpoint(dir) on every rank writes each rank's "
                    f"shards")
            raise
        return rows

    def _describe_engine(self, slot: int) -> str:
        party = process_engines.party(slot)
        module = "" if party is None else f" (a {party.module_type})"
        return f" of the engine in slot {slot}{module}"

    def _raise_calls_differ(self, kind: int, rows: list[tuple[int, int, int]]) -> None:
        several = len(process_engines.parties()) > 1 or any(slot for _, _, slot in rows)
        described = "; ".join(
            f"rank {r}: call {count}, {self._CALLS.get(what, what)}"
            + (self._describe_engine(slot) if several else "")
            for r, (count, what, slot) in enumerate(rows))
        mine = self._CALLS[kind] + (self._describe_engine(self.slot or 0) if several else "")
        raise RuntimeError(
            f"{mine}: the ranks are not making the same call ({described}). Every "
            f"rank must run the same training forwards in the same order, since parameters are "
            f"sharded. Work on one rank alone (an evaluation forward, as nanoGPT's "
            f"estimate_loss() under `if master_process:`, state-dict reads, p.norm()) is served "
            f"by the other ranks' next call, one kind at a time, but not with embeddings that "
            f"renormalize (max_norm) or pipeline/tensor parallelism: there run evaluation on "
            f"every rank (each on its own batches, as many on every rank, as "
            f"DistributedSampler's equal shards give) and read on every rank; the script's own "
            f"torch.distributed collectives count as calls too; Hugging Face's "
            f"model.module.generate(...) needs synced_gpus=True (model.generate(...) passes "
            f"it)")

    # Note [Parameter reads agree]
    # User code reads a parameter's value at rest (`p.norm()`, `print(p)`: Note [Parameters at
    # rest] in resting_params.py) through gather_all(), a collective when some group is not
    # gathered since the last step. A DDP script's logging under `if rank == 0:` made rank 0
    # wait in that gather while rank 1 went on to its next forward's agreement, on another
    # communicator: both waited for the collective timeout (300 s by default). Such a read
    # therefore joins the call agreement first, when it is about to gather (only then: a read
    # that needs no collective, every group gathered by an earlier state_dict() on every rank,
    # stays a local read), and the ranks raise at once, naming what each is running. (Since Note
    # [Reads on one rank are served] the other ranks serve such a read instead.)
    def gather_all(self, agree_as: int | None = None) -> None:
        """Gathers every group not gathered since the last step (the end of a forward, and
        state_dict(): every rank calls these at the same point). `agree_as`: the call kind
        every rank agrees on first when this gathers (Note [Parameter reads agree])."""
        if self.enabled:
            if agree_as is not None and not self.gathers.all_gathered:
                self.agree_on_call(agree_as)
            self.gathers.gather_all()

    def after_forward(self) -> None:
        self._in_forward = False
        if self._served_forward:
            self._served_forward = False
        elif self.enabled:
            self.gathers.end_forward(self._backward_follows)

    @property
    def gathers_ahead(self) -> int:
        """Gathers started before any tensor of their group was needed."""
        return 0 if self.gathers is None else self.gathers.gathers_ahead

    @property
    def collectives_issued(self) -> int:
        """Collectives of the chunk groups this rank issued (gathers and reduce-scatters)."""
        return self._sum_counter("collectives_issued")

    @property
    def bytes_communicated(self) -> int:
        return self._sum_counter("bytes_communicated")

    def _sum_counter(self, name: str) -> int:
        if not self.enabled or self.gathers is None:
            return 0
        total = getattr(self.collectives, name)
        if self.gathers.collectives is not self.collectives:
            total += getattr(self.gathers.collectives, name)
        return total

    @property
    def compute_group_count(self) -> int:
        return 0 if self.gathers is None else len(self.gathers.groups)

    @property
    def grad_group_count(self) -> int:
        return len(getattr(self, "_grad_groups", ()))

    # ---- Gradients ----------------------------------------------------------------------------

    def _reset_backward(self) -> None:
        self._missing = list(self._group_size)
        self._seen: set[int] = set()
        self._rs_cursor = 0
        self._last_grad_group = None
        self._wait_for_reduce_scatters = self._waits_for_reduce_scatters

    def _reset_accumulation(self) -> None:
        self._reset_backward()
        self._had_grad: set[int] = set()  # parameters with a local gradient since the last step

    def _agree_on_rank_zeros(self, order: list[int]) -> list[int]:
        """Rank 0's backward gather order, on every rank (a broadcast on the gather group at
        the end of the first forward; Note [Resharding after forward])."""
        values = torch.tensor(order, dtype=torch.float32)
        recorded_collectives.broadcast(self.gather_communicator, values, 0,
                                       "backward gather order", self.timeout)
        return [int(v) for v in values.tolist()]

    def _agree_backward_extent(self, extent: int) -> int:
        """The most groups of backward's order any rank's backward may gather (Note [How far
        backward gathers] in gather_schedule.py). The ranks first agree that each is at a
        training forward's end (Note [A forward's end agrees]), never serving a read there."""
        rows = self._agree_once(self.FORWARD_END)
        if any(row != rows[self.rank] for row in rows):
            self._raise_calls_differ(self.FORWARD_END, rows)
        return int(max(self._every_ranks(float(extent), self.gather_communicator,
                                         "compute groups backward may gather", "forward")))

    def _compare_next_gathers(self, position: int) -> list[float]:
        """Every rank's next gather of the first forward (Note [Resharding after forward])."""
        mine = f"compute_param group {position}" if position >= 0 else "the forward's end"
        return self._every_ranks(float(position), self.gather_communicator,
                                 f"first forward's next gather, here {mine}")

    # Note [Accumulation without the key under data parallelism]
    # A DDP loop accumulates without telling anyone how many backward calls a step has: each
    # backward all-reduces (averages) and adds into p.grad, or `with model.no_sync():` (nanoGPT:
    # `model.require_backward_grad_sync = False`) skips the reduction of all but the last, whose
    # reduction then carries the sum. Without the config key gradient_accumulation_steps the
    # engine does the same, keeping one rule for what the owners' gradient chunks hold:
    #  * a backward with sync on is a boundary: its reduce-scatter averages what every rank's
    #    chunks hold, and the owners then hold this step's average so far ("average");
    #  * a backward under no_sync reduces nothing: its gradients add to the local chunks
    #    (`_unreduced`), full-size on every rank as DDP's p.grad are;
    #  * a backward that starts while the owners hold an average first multiplies their owned
    #    gradients by the world size ("sum"): the next averaging reduce-scatter divides the
    #    owner's part again, so the result is the old average plus the average of what came
    #    since, as in DDP's p.grad. (Exact for a world of a power of two; fp16 gradients near
    #    their range can overflow, which the loss scaler then handles as any overflow.)
    #  * optimizer.step() and the clips close the step (close_accumulation): local gradients
    #    still unreduced (a last backward under no_sync, which DDP would step with each rank's
    #    own gradients) are reduced as at a boundary; owners holding a sum are divided back.
    # With the key the engine keeps counting backward calls and no_sync changes nothing.
    def before_backward(self) -> None:
        if not self.enabled:
            return
        if self._owners_hold == "average":
            optimizer = self._engine.optimizer
            optimizer.scale_gradients(float(self.world_size))
            # The boundary's agreement forgot them: every owner adds its own back.
            self._had_grad.update(i for i, has in enumerate(optimizer.has_grad) if has)
            self._owners_hold = "sum"
        self.gathers.begin_backward()

    @property
    def gradients_unreduced(self) -> bool:
        """Local gradients of backward calls under no_sync() wait for their reduction (Note
        [Accumulation without the key under data parallelism])."""
        return self._unreduced

    def _boundary(self) -> bool:
        if self._closing:
            return True
        if self.open_accumulation:
            return self.sync_gradients
        return self._engine.guard.ends_accumulation

    def _reduces_now(self) -> bool:
        """Whether this micro-step reduce-scatters its gradients."""
        return self.sharded_accumulation or self._boundary()

    @property
    def ends_param_access_at_grad(self) -> bool:
        """Whether the engine's gradient hook ends its parameter's access before before_grad
        (with resharding: GatherSchedule.before_grad can then release the compute group before
        its last gradient lands)."""
        return self.enabled and self.reshard

    def before_grad(self, index: int) -> None:
        """Called by the engine's gradient hook before the gradient goes into its chunk. The
        first gradient of a group (and every gather in backward: GatherSchedule's
        before_backward_gather) waits for the reduce-scatters every rank has issued, so that
        their full-size gradients are gone before this group's land (Note [Waiting for
        reduce-scatters every rank issued] in chunk/group_collectives.h); only with resharding,
        whose gathers' communicator tells when a peer may be waiting for this rank, and without
        pipeline stages or tensor slices, whose own collectives in backward it cannot see."""
        if not self.enabled or index in self._seen:
            return
        # Its compute group goes before the gradient lands when this is the group's last.
        self.gathers.before_grad(self._compute_position[index])
        if not self._reduces_now():
            return
        group = self._grad_group_of.get(index)
        if group == self._last_grad_group:
            return  # its chunks already hold gradients: nothing new lands
        self._last_grad_group = group
        self._finish_reduce_scatters()

    def _finish_reduce_scatters(self) -> None:
        """Before new full-size data lands in backward (a group's first gradient, a gather):
        finishes the reduce-scatters every rank issued, or those done."""
        if not self._reduces_now():
            return
        if self._wait_for_reduce_scatters:
            _, gave_up = self.collectives.finish_reduce_scatters_issued_everywhere(
                self.gather_communicator, REDUCE_SCATTER_WAIT_S)
            # A peer is behind by more than the bound or may wait for us: the rest of this
            # backward keeps the old behaviour (memory, not correctness).
            self._wait_for_reduce_scatters = not gave_up
        else:
            self.collectives.finish_completed_reduce_scatters()

    def on_grad(self, index: int) -> None:
        """Called by the engine's gradient hook once the gradient is in its chunk."""
        if not self.enabled or index in self._seen:
            return
        self._seen.add(index)
        self._had_grad.add(index)
        self.gathers.on_grad(self._compute_position[index])
        if not self._reduces_now():
            return
        # Done reduce-scatters drop their full-size remote gradients now, not at the end.
        self.collectives.finish_completed_reduce_scatters()
        self._missing[self._grad_group_of[index]] -= 1
        while (self._rs_cursor < len(self._grad_groups)
               and self._missing[self._rs_cursor] == 0):
            self._start_reduce_scatter()
            self.early_reduce_scatters += 1

    # Note [A backward that raised under data parallelism]
    # A backward that raised partway (an error in a backward hook, Ctrl-C) has started the
    # reduce-scatters of the groups whose gradients were all in, and they pin those groups'
    # gradient tensors (COMPUTE) until finished; after_backward, which finishes them, never ran.
    # The zero_grad() the raised backward asks for (Note [Training call order] in guards.py)
    # then failed with "tensor '...#grad': COMPUTE -> FREE enters or leaves COMPUTE", and where a
    # reduce-scatter had finished, a rank not owning the group failed with "FREE -> FREE": its
    # copy was dropped by the reduce-scatter while its optimizer still counted the gradient. So
    # the raised backward finishes what it started (every rank that raised at the same point,
    # as a hook failing on every rank does, started the same ones; a rank that raised alone
    # meets the others' next collective as any call the ranks do not share does), and each
    # reduced group's gradients are counted as its reduce-scatter left them: every tensor of
    # the owned chunk, none of the others. The backward's own bookkeeping starts afresh.
    def backward_raised(self) -> None:
        """Note [A backward that raised under data parallelism]."""
        if not self.enabled or self._engine is None:
            return
        try:
            self.collectives.finish_reduce_scatters()
        finally:
            has_grad = self._engine.optimizer.has_grad
            for index, group in self._grad_group_of.items():
                if group < self._rs_cursor:
                    has_grad[index] = self._owned[index]
            self._reset_backward()

    def _start_reduce_scatter(self) -> None:
        # Sharded accumulation sums into the owner's shard until the boundary averages it.
        op = "avg" if self._boundary() else "sum"
        self.collectives.start_reduce_scatter(self._grad_groups[self._rs_cursor], op=op)
        self._rs_cursor += 1

    def after_backward(self) -> None:
        """Finishes the reduce-scatters of an accumulation boundary; afterwards the optimizer's
        `has_grad` says
        which *owned* parameters have a gradient on some rank."""
        if not self.enabled:
            return
        if self.reshard:
            # Backward's gathers first (Note [Resharding after forward]): a rank still gathering
            # must not wait for another that waits for its reduce-scatters. How far: Note [How
            # far backward gathers] in gather_schedule.py.
            if self.gathers.backward_extent_agreed:
                self.gathers.end_backward()
            else:
                issued = self._every_ranks(self.gathers.backward_gathers_issued,
                                           self.gather_communicator,
                                           "compute groups gathered in backward")
                self.gathers.end_backward(int(max(issued)))
        if not self._reduces_now():
            self._seen.clear()
            self._unreduced = True
            return
        try:
            while self._rs_cursor < len(self._grad_groups):
                self._start_reduce_scatter()
        finally:
            self.collectives.finish_reduce_scatters()
        if not self._boundary():
            # Sharded accumulation between micro-steps: an owned gradient chunk holds the sum so
            # far (every tensor of it), which the next micro-step's gradients add to; a remote
            # one was dropped, and the next gradient stored there starts it afresh.
            has_grad = self._engine.optimizer.has_grad
            for index in self._grad_group_of:
                has_grad[index] = self._owned[index]
            self._reset_backward()
            return
        self._agree_on_gradients()
        self._owners_hold, self._unreduced = "average", False

    # Note [A short accumulation]
    # optimizer.step() after fewer backward calls than gradient_accumulation_steps (an epoch's
    # last, short accumulation: Note [Training call order] in guards.py), or a clip before it,
    # needs the gradients a boundary would have left: averaged over the ranks, on their owners.
    # With sharded accumulation every micro-step already reduce-scattered with "sum" into the
    # owners' chunks, so the owners divide by the world size (the boundary's "avg" would have);
    # with full accumulation nothing was reduced yet, so every group is reduce-scattered now,
    # as the boundary's after_backward does (`_closing` makes them the boundary's "avg"). Then
    # the ranks agree on which parameters have a gradient, as at a boundary. Every rank calls
    # step() (and a clip) at the same point of its loop, so the collectives match.
    def close_accumulation(self, what: str) -> None:
        """Ends this step's accumulation before its last backward (Note [A short
        accumulation]); nothing without data parallelism or outside an accumulation."""
        engine = self._engine  # None once the engine is gone: the step's own check says so
        if not self.enabled or engine is None:
            return
        if self.open_accumulation:
            self._close_open_accumulation(engine)
            return
        if not engine.guard.in_accumulation:
            return
        if self.sharded_accumulation:
            engine.optimizer.scale_gradients(1.0 / self.world_size)
        else:
            self._reduce_the_rest()
        self._agree_on_gradients()
        engine.guard.close_accumulation(what)

    def _reduce_the_rest(self) -> None:
        """Reduce-scatters, as a boundary's ("avg"), every group this backward has not."""
        self._closing = True
        try:
            while self._rs_cursor < len(self._grad_groups):
                self._start_reduce_scatter()
        finally:
            self._closing = False
            self.collectives.finish_reduce_scatters()

    def _close_open_accumulation(self, engine) -> None:
        """Note [Accumulation without the key under data parallelism]: the owners end with
        the step's average. Later backward calls of the same step may follow (as in PyTorch,
        a backward after a clip adds to the clipped gradients)."""
        if self._unreduced:
            self._reduce_the_rest()
        elif self._owners_hold == "sum":
            engine.optimizer.scale_gradients(1.0 / self.world_size)
        else:
            return
        self._agree_on_gradients()
        self._owners_hold, self._unreduced = "average", False

    def _agree_on_gradients(self) -> None:
        """At the end of an accumulation: afterwards the optimizer's `has_grad` says which
        *owned* parameters have a gradient on some rank."""
        has_grad = self._engine.optimizer.has_grad
        flags = torch.tensor([1.0 if index in self._had_grad else 0.0
                              for index in range(len(has_grad))])
        recorded_collectives.all_reduce(self.communicator, flags, "sum", "has-gradient flags",
                                        self.timeout)
        totals = flags.tolist()
        for index, total in enumerate(totals):
            has_grad[index] = total > 0 and self._owned[index]
        self._agreed_gradients = {index for index, total in enumerate(totals) if total > 0}
        self._reset_accumulation()

    def gradients_anywhere(self, has_grad: list[bool]) -> set[int]:
        """The parameters with a gradient on some rank, alike on every rank: `has_grad`'s
        without data parallelism, else the last accumulation end's agreement since the
        gradients were last dropped (none before it)."""
        if not self.enabled:
            return {index for index, has in enumerate(has_grad) if has}
        return set(self._agreed_gradients)

    def gradients_dropped(self, backwards_dropped: bool) -> None:
        """A step applied the gradients, or optimizer.zero_grad() dropped them (every rank
        calls either); `backwards_dropped`: between steps, so the next backward starts a fresh
        accumulation."""
        if not self.enabled:
            return
        self._agreed_gradients = set()
        if backwards_dropped:
            self._reset_accumulation()
        self._owners_hold, self._unreduced = None, False

    def ranks_with(self, flag: bool, label: str = "non-finite loss flags",
                   phase: str | None = "backward") -> list[int]:
        """The ranks of the group whose `flag` is set; a collective every rank must call.
        `phase` is the profile's for it: the loss check that opens a backward by default."""
        if not self.enabled:
            return [self.rank] if flag else []
        values = self._every_ranks(1.0 if flag else 0.0, self.communicator, label, phase)
        return [rank for rank, value in enumerate(values) if value > 0]

    def _every_ranks(self, value: float, communicator, label: str,
                     phase: str | None = None) -> list[float]:
        """Every rank's `value` in rank order (one small all-reduce on `communicator`)."""
        return [row[0] for row in self._every_ranks_row((value,), communicator, label, phase)]

    def _every_ranks_row(self, row: tuple[float, ...], communicator, label: str,
                         phase: str | None = None) -> list[tuple[float, ...]]:
        """Every rank's `row` (as fp32) in rank order, in one small all-reduce."""
        self._refuse_in_forked_child(f"the all-reduce of {label}")
        width = len(row)
        values = torch.zeros(self.world_size * width, dtype=torch.float32)
        values[self.rank * width:(self.rank + 1) * width] = torch.tensor(row, dtype=torch.float32)
        recorded_collectives.all_reduce(communicator, values, "sum", label, self.timeout, phase)
        return [tuple(r) for r in values.view(self.world_size, width).tolist()]

    def all_reduce_grad_powers(self, overflow: bool, value: float,
                               maximum: bool) -> tuple[bool, float]:
        """all_reduce_grad_stats for torch's other norm orders: sums the owned gradients'
        `value` (their sum of |g|^p), or takes the largest (`maximum`: the inf norm), and ORs
        the overflow flags. Not with pipeline stages or tensor slices (the optimizer refuses
        other orders than 2 there)."""
        if not self.enabled:
            return overflow, value
        rows = self._every_ranks_row((value, 1.0 if overflow else 0.0), self.communicator,
                                     "gradient norm and overflow")
        values = [row[0] for row in rows]
        return any(row[1] > 0 for row in rows), max(values) if maximum else sum(values)

    @property
    def model_parallel_enabled(self) -> bool:
        """Pipeline stages or tensor slices: all_reduce_grad_stats reduces over the model group
        too, which every stage's step must join."""
        return self.model_parallel is not None

    def all_reduce_grad_stats(self, overflow: bool, squared: float) -> tuple[bool, float]:
        """Sums the squared norms of the owned gradients and ORs the overflow flags (over the
        model group too with pipeline stages or tensor slices: topology.py's Note [Gradient
        norm over stages and slices])."""
        if self.model_parallel is not None:
            squared -= self.model_parallel.local_duplicate_squares()
        if self.enabled:
            stats = torch.tensor([squared, 1.0 if overflow else 0.0], dtype=torch.float32)
            recorded_collectives.all_reduce(self.communicator, stats, "sum",
                                            "gradient norm and overflow", self.timeout)
            overflow, squared = stats[1].item() > 0, float(stats[0].item())
        if self.model_parallel is not None:
            overflow, squared = self.model_parallel.all_reduce(overflow, squared)
        return overflow, squared

    def release_gathered(self) -> None:
        """Drops this rank's gathered copies of other ranks' parameters (finishing a gather
        still in flight first); the next forward gathers them again."""
        if self.enabled:
            self.gathers.release_all()

    def parameters_changed(self) -> None:
        """The owners' parameters changed (a step, loaded weights): every rank drops its
        gathered copies (finishing a gather still in flight first), which would be stale."""
        self.release_gathered()
