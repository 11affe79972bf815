"""Process topology of 3D parallelism: pipeline stages x data-parallel replicas x tensor slices.

Every rank has coordinates (pipe, data, tensor); the tensor axis varies fastest, so the ranks of
one tensor-parallel group are neighbours (on one node, where their frequent all-reduces belong)
and a pipeline stage is a contiguous block of data * tensor ranks:

    rank = (pipe * data_size + data) * tensor_size + tensor

which is DeepSpeed's `PipeModelDataParallelTopology` with its "model" axis named "tensor".
`initialize_parallel(config.parallel)` checks `data * pipeline * tensor == world size` and builds
one torch.distributed group per line of each axis (the ranks that differ only in that axis):
  * data groups: same pipe and tensor coordinates (the engine's chunk data parallelism),
  * pipe groups: same data and tensor coordinates (activations pass along them),
  * tensor groups: same pipe and data coordinates (Megatron's slices all-reduce in them),
  * model groups: same data coordinate (every stage and slice of one replica).
`dist.new_group` is a collective over the whole world, so every rank builds every group in the
same order; the groups of one shape are kept and reused by later engines. An axis of size 1 has
no groups, one whose lines are the whole world uses the default group.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import os
import weakref

import torch
import torch.distributed as dist

from . import _C

__all__ = ["ProcessTopology", "PipeDataTensorTopology", "ParallelGroups", "initialize_parallel",
           "current", "tensor_parallel_group", "ModelParallelGradStats", "comm_device"]

AXES = ("pipe", "data", "tensor")


class ProcessTopology:
    """Ranks <-> coordinates on a grid of named axes; the last axis varies fastest."""

    def __init__(self, axes, dims):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} must be distinct "
                             "names, one per dimension")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dimension must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        self.Coord = collections.namedtuple("Coord", axes)
        self._coords = [self.Coord(*c) for c in itertools.product(*(range(d) for d in dims))]
        self._rank_of = {c: r for r, c in enumerate(self._coords)}

    @property
    def world_size(self) -> int:
        return len(self._coords)

    def get_dim(self, axis: str) -> int:
        return self.dims[self._axis(axis)]

    def get_coord(self, rank: int):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the topology of {self.world_size} ranks")
        return self._coords[rank]

    def get_rank(self, **coords) -> int:
        if set(coords) != set(self.axes):
            raise ValueError(f"get_rank needs exactly the coordinates {self.axes}, got "
                             f"{sorted(coords)}")
        for axis, value in coords.items():
            if not 0 <= value < self.get_dim(axis):
                raise ValueError(f"coordinate {axis}={value} is outside "
                                 f"0..{self.get_dim(axis) - 1}")
        return self._rank_of[self.Coord(**coords)]

    def filter_match(self, **coords) -> list[int]:
        """The ranks whose coordinates equal all of `coords` (a partial assignment)."""
        for axis in coords:
            self._axis(axis)
        return [r for r, c in enumerate(self._coords)
                if all(getattr(c, a) == v for a, v in coords.items())]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One list per line along `axis`: the ranks that differ only in that coordinate, in
        ascending order of it."""
        index = self._axis(axis)
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            coords = dict(zip(others, fixed))
            lists.append([self._rank_of[self.Coord(**coords, **{axis: i})]
                          for i in range(self.dims[index])])
        return lists

    def _axis(self, axis: str) -> int:
        try:
            return self.axes.index(axis)
        except ValueError:
            raise ValueError(f"unknown topology axis {axis!r}; the axes are {self.axes}") from None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={d}" for a, d in zip(self.axes, self.dims))
        return f"ProcessTopology({sizes})"


class PipeDataTensorTopology(ProcessTopology):
    """(pipe, data, tensor), tensor fastest: DeepSpeed's PipeModelDataParallelTopology."""

    def __init__(self, num_pp: int, num_dp: int, num_tp: int):
        super().__init__(AXES, [num_pp, num_dp, num_tp])


@dataclasses.dataclass
class ParallelGroups:
    """This rank's place in the topology and its groups (None where a line has one rank: an
    axis of size 1, or no torch.distributed). `*_ranks` are global ranks in ascending order of
    the axis."""

    topology: PipeDataTensorTopology
    rank: int
    data_group: object = None
    pipe_group: object = None
    tensor_group: object = None
    model_group: object = None
    data_ranks: list = dataclasses.field(default_factory=lambda: [0])
    pipe_ranks: list = dataclasses.field(default_factory=lambda: [0])
    tensor_ranks: list = dataclasses.field(default_factory=lambda: [0])
    model_ranks: list = dataclasses.field(default_factory=lambda: [0])
    _extra: dict = dataclasses.field(default_factory=dict)

    @property
    def coord(self):
        return self.topology.get_coord(self.rank)

    @property
    def data_size(self) -> int:
        return self.topology.get_dim("data")

    @property
    def pipe_size(self) -> int:
        return self.topology.get_dim("pipe")

    @property
    def tensor_size(self) -> int:
        return self.topology.get_dim("tensor")

    @property
    def stage(self) -> int:
        return self.coord.pipe

    def stage_rank(self, stage: int) -> int:
        """The global rank of `stage` with this rank's data and tensor coordinates."""
        coord = self.coord
        return self.topology.get_rank(pipe=stage, data=coord.data, tensor=coord.tensor)

    def new_groups(self, rank_lists, purpose: str = "", backend: str | None = None) -> object:
        """Builds one group per list (a world collective: every rank passes the same lists in
        the same order) and returns this rank's, None if it is in none. Cached by the lists
        and `purpose` (a second set of groups over the same ranks needs its own); `backend`:
        the default group's when None."""
        key = (purpose,) + tuple(tuple(ranks) for ranks in rank_lists)
        if key not in self._extra:
            mine = None
            for ranks in key[1:]:
                group = dist.new_group(list(ranks), backend=backend) \
                    if dist.is_initialized() else None
                if self.rank in ranks:
                    mine = group
            self._extra[key] = mine
        return self._extra[key]

    # Note [Host groups for the chunk collectives]
    # Data parallelism's chunk collectives run on host memory (GroupCollectives on the host
    # tier, over the shared-memory communicator or a process group's), and so do its small
    # agreements. Under torchrun on GPUs the default group is NCCL (topology._world makes it so,
    # and so do DeepSpeed's and most scripts' init_process_group("nccl")), which takes only
    # device tensors: initialize() then failed ("the nccl communicator needs device memory").
    # Where the data group's backend cannot take host tensors, data parallelism runs over gloo
    # groups of the same ranks instead, built on every rank in the same order like every group
    # (the decision depends only on the default group's backend, the same everywhere). Pipeline
    # and tensor-parallel collectives keep the default group: they move device tensors.
    def _host_backend(self) -> str | None:
        """The backend data parallelism's own groups need: None (the default group's) where the
        data group takes host tensors, else "gloo" (Note [Host groups for the chunk
        collectives])."""
        if self.data_group is None or takes_host_tensors(self.data_group):
            return None
        return "gloo"

    def host_data_group(self, slot: int = 0) -> object:
        """This rank's data-parallel group if it takes host tensors, else a gloo group of the
        same ranks (Note [Host groups for the chunk collectives]). `slot` k > 0: a group of
        the same ranks for the engine of that slot alone (Note [Several engines in one
        process] in process_engines.py), built once per process and slot."""
        if slot == 0 and self._host_backend() is None:
            return self.data_group
        purpose = "host data" if slot == 0 else f"host data of engine slot {slot}"
        return self.new_groups(self.topology.get_axis_comm_lists("data"), purpose=purpose,
                               backend=self._host_backend())

    def twin_data_group(self, slot: int = 0) -> object:
        """A second process group over this rank's data-parallel ranks: backward's gathers run
        on it, apart from the reduce-scatters (gather_schedule.py, Note [Resharding after
        forward]). Built once per process and engine slot, on every rank; gloo where
        host_data_group is."""
        purpose = "gathers" if slot == 0 else f"gathers of engine slot {slot}"
        return self.new_groups(self.topology.get_axis_comm_lists("data"), purpose=purpose,
                               backend=self._host_backend())


def takes_host_tensors(group) -> bool:
    """Whether collectives of `group` take CPU tensors: gloo or MPI, or a per-device backend
    map with a CPU entry ("cpu:gloo,cuda:nccl"); not NCCL alone."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return any(part.strip().startswith("cpu:") for part in backend.split(","))
    return backend in ("gloo", "mpi")


_CURRENT: ParallelGroups | None = None


def current() -> ParallelGroups | None:
    """The groups of the last `initialize_parallel()`, None before any."""
    return _CURRENT


def tensor_parallel_group():
    """(group, size, rank) of this rank's tensor-parallel group: (None, 1, 0) when tensor
    parallelism is off."""
    groups = _CURRENT
    if groups is None or groups.tensor_size == 1:
        return None, 1, 0
    return groups.tensor_group, groups.tensor_size, groups.coord.tensor


def comm_device(group=None) -> torch.device:
    """Where a tensor for a collective of `group` must live: NCCL takes CUDA tensors only,
    gloo (here) CPU tensors."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(timeout: float) -> tuple[int, int]:
    """(world size, rank), initializing the default group from torchrun's environment when the
    script did not."""
    if not dist.is_available():
        return 1, 0
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            # Note [The current device is the local rank's] in chunk_runtime.py: before NCCL
            # starts, or every rank's communicator starts on GPU 0.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def _dims(parallel, world: int) -> tuple[int, int, int]:
    pipe, tensor, data = parallel.pipeline, parallel.tensor, parallel.data
    if pipe == 1 and tensor == 1:
        if data is not None and data != world:
            raise ValueError(f"config key 'parallel.data': {data} data-parallel ranks asked for, "
                             f"but torch.distributed has a world of {world} (launch with "
                             f"torchrun --nproc_per_node={data}, or leave the key out)")
        return 1, world, 1
    if data is None:
        if world % (pipe * tensor):
            raise ValueError(f"config keys 'parallel.pipeline' ({pipe}) x 'parallel.tensor' "
                             f"({tensor}) = {pipe * tensor} ranks per replica do not divide the "
                             f"torch.distributed world of {world} ranks")
        data = world // (pipe * tensor)
    if data * pipe * tensor != world:
        raise ValueError(f"config keys 'parallel.data' ({data}) x 'parallel.pipeline' ({pipe}) "
                         f"x 'parallel.tensor' ({tensor}) = {data * pipe * tensor} ranks, but "
                         f"torch.distributed has a world of {world} (launch with torchrun "
                         f"--nproc_per_node={data * pipe * tensor}, or change the keys)")
    return pipe, data, tensor


def initialize_parallel(parallel) -> ParallelGroups:
    """Builds (or reuses) the 3D groups for `parallel` (a `ParallelConfig`; the `parallel`
    section of a config dict is accepted too) and makes them current."""
    global _CURRENT
    if not hasattr(parallel, "pipeline"):
        from .config import load_config
        parallel = load_config({"parallel": dict(parallel)}).parallel
    world, rank = _world(parallel.collective_timeout)
    pipe, data, tensor = _dims(parallel, world)
    # The same shape (so the same world) and rank: the groups exist already.
    if _CURRENT is not None and _CURRENT.topology.dims == [pipe, data, tensor] \
            and _CURRENT.rank == rank:
        return _CURRENT
    topology = PipeDataTensorTopology(pipe, data, tensor)
    groups = ParallelGroups(topology, rank)
    if world > 1:
        whole = dist.group.WORLD
        for axis in ("data", "pipe", "tensor"):
            lists = topology.get_axis_comm_lists(axis)
            mine = next(ranks for ranks in lists if rank in ranks)
            setattr(groups, f"{axis}_ranks", mine)
            # A line that is the whole world uses the default group (pure data parallelism
            # keeps running on WORLD exactly as before topologies existed); a line of one rank
            # needs no group (nothing uses it).
            if len(mine) == 1:
                group = None
            else:
                group = whole if len(mine) == world else groups.new_groups(lists)
            setattr(groups, f"{axis}_group", group)
        coord = topology.get_coord(rank)
        model_lists = [topology.filter_match(data=d) for d in range(data)]
        groups.model_ranks = model_lists[coord.data]
        if pipe * tensor > 1:
            groups.model_group = whole if data == 1 else groups.new_groups(model_lists)
    _CURRENT = groups
    return groups


class ModelParallelGradStats:
    """The global gradient norm and overflow flag of a model split over pipeline stages and
    tensor slices (gradient clipping, fp16 loss scaling).

    Note [Gradient norm over stages and slices]
    Each engine sums the squared norms of the gradients it owns (after data parallelism's
    reduce-scatter, every data rank owns distinct chunks, and the data all-reduce adds them up).
    Across the model group (the stages and slices of one replica) the per-engine sums are added
    once more, but some gradients exist on several of those ranks and must count once:
    parameters that tensor slicing does not slice (norms, row-parallel biases, position
    embeddings) are the same on every tensor rank and count on tensor rank 0 only, and tied
    weights are the same on every stage holding them (after the tied gradient sum) and count on
    the lowest such stage only. `duplicates` holds this rank's parameters that do not count;
    their squares are taken out before the data all-reduce, the model all-reduce follows it.
    The overflow flag is OR-ed over the model group, so every stage skips the same steps.
    """

    def __init__(self, engine, groups: ParallelGroups):
        # Weak: the data-parallel side holding this is reachable from C++ (Note [Engine
        # lifetime] in engine.py).
        self._engine = weakref.ref(engine)
        self.groups = groups
        self.duplicates: set[int] = set()
        if groups.tensor_size > 1 and groups.coord.tensor != 0:
            self.duplicates.update(
                index for index, param in enumerate(engine.params.params)
                if not getattr(param, "tensor_model_parallel", False))

    @property
    def engine(self):
        return self._engine()

    def local_duplicate_squares(self) -> float:
        params, has_grad = self.engine.params, self.engine.optimizer.has_grad
        total = 0.0
        for index in sorted(self.duplicates):
            if not has_grad[index]:
                continue
            with params.view(index, _C.ChunkKind.GRADIENT) as view:
                total += float(view.float().pow(2).sum())
        return total

    def all_reduce(self, overflow: bool, squared: float) -> tuple[bool, float]:
        stats = torch.tensor([squared, 1.0 if overflow else 0.0], dtype=torch.float64,
                             device=comm_device(self.groups.model_group))
        dist.all_reduce(stats, group=self.groups.model_group)
        return stats[1].item() > 0, float(stats[0].item())
