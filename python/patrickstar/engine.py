"""The training engine behind `patrickstar.initialize()`.

The user's module keeps its structure; its parameters become views of chunk memory while a
module uses them and empty placeholders otherwise. The chunk manager (C++) decides where chunks
live; this file drives it from PyTorch's module hooks, moves gradients into gradient chunks as
autograd produces them, and runs the optimizer over chunk memory.

Note [Parameter data swapping]
A parameter's `.data` is a view of its compute chunk only between `Access` and `Release` (the
chunk may move once released, which would leave a view dangling). Outside that window `.data` is
an empty placeholder of the compute dtype. Autograd saves parameters (leaves) by reference, so a
module's backward sees whatever `.data` holds when it runs: the pre-backward hook re-accesses the
module's parameters first (Note [Backward hooks through autograd functions] in hooks.py).
Accesses are reference-counted per parameter because a tied parameter can be in use by two
modules at once. The counts, the swaps and the gradient stores live in C++ (`_C.ParameterSlots`,
Note [Parameter slots] in bindings/parameter_slots.cc): one call per module or gradient.

Note [Saved views of parameters]
Autograd saves leaves by reference, but many ops save a *view* made in forward: `F.linear` saves
`weight.t()`, whose storage is the chunk memory the weight was a view of at that moment. When the
chunk moves between forward and backward (eviction, prefetch) that memory is freed and reused by
another chunk, so the backward would read another tensor's bytes. The engine therefore runs the
forward under `saved_tensors_hooks`: a saved tensor whose storage is a parameter's chunk view is
packed as (parameter, offset, sizes, strides) and rebuilt in backward over wherever the
parameter's chunk lives then (re-accessing it if no hook did). DeepSpeed ZeRO-3 patches
`F.linear` for the same reason; the hooks cover every op, not just linear.

Note [Optimizer sweep]
`optimizer.step()` updates parameters row by row, a row being the parameters whose optimizer
state shares a momentum chunk (so a row touches a handful of chunks: their params or masters,
gradients, momentum, variance). Each tensor is updated where its chunk already is whenever the
kernel can reach it there: on a CPU build every memory tier is host memory (the device tier is
emulated), so nothing moves; with CUDA a parameter whose chunks are all on the GPU is updated by
the GPU kernel there, anything else on the host. Chunks on NVMe stream through host memory: while
row k is updated, the NVMe chunks of row k+1 are already being read (`start_move`, Note [Started
moves] in chunk_manager.cc) and those of row k-1 written back, so disk reads, Adam and disk writes
overlap, and the host holds about three rows of NVMe state at a time. A failed read or write-back
raises out of `step()` with the file, offset and bytes; the chunk keeps its bytes in memory and its
NVMe slot stays invalid (never read back torn), and the engine refuses to train on until a
checkpoint is loaded, since the rows before the failure were already updated.

Note [Chunk kinds per precision]
  fp32:       compute (fp32, also the master copy), gradient (fp32), momentum, variance
  fp16/bf16:  compute (16-bit), master (fp32), gradient (16-bit; fp32 when accumulating over
              micro-steps), momentum, variance
Only trainable parameters get master, gradient and optimizer-state tensors, so frozen ones cost
just their compute copy.
"""
from __future__ import annotations

import json
import math
from typing import Callable

import torch
from torch import nn

from . import _C, checkpoint
from .config import Config, load_config
from .data_parallel import DataParallel, detect_world
from .guards import TrainingGuard, check_budgets
from .hooks import ModuleHooks
from .init_context import InitResidency, ParameterPlacer, plan_parameters
from .loss_scaler import make_loss_scaler
from .optimizer import PatrickStarOptimizer, build_param_groups, clip_coefficient
from .profiler import ActivationCounter, profiler_from_config

__all__ = ["PatrickStarEngine", "initialize", "initialize_engine"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
K = _C.ChunkKind
S = _C.TensorState


class T:  # the chunk manager's tier names
    DEVICE = "device"
    HOST = "host"


PREFETCH_MOMENTS = 2


class _ChunkManager:
    """The C++ chunk manager with `access` returning a torch view (valid until release)."""

    def __init__(self, tiers, copy_engine, world_size=1, rank=0):
        # Prefetch looks PREFETCH_MOMENTS moments ahead in the warm-up trace (Note [Prefetch] in
        # chunk_manager.cc). It was off while prefetch moves corrupted backward; the cause was
        # autograd's saved views of moved chunks (Note [Saved views of parameters]), not the
        # manager. Data parallelism prefetches too: a group's gather pins its local chunk where a
        # prefetch in flight takes it (Note [Pinning a group for a collective]), and the pins
        # and gathers are accesses in the trace like any other.
        self.manager = _C.ChunkManager(tiers=tiers, copy_engine=copy_engine,
                                       world_size=world_size, rank=rank,
                                       prefetch_moments=PREFETCH_MOMENTS)
        self.before_access = None  # data parallelism: gathers a remote group first
        # The calls of every moment and every optimizer update, bound once: __getattr__ runs
        # only after a failed normal lookup, which costs more than the call itself.
        for name in ("tick", "release", "release_tensors", "chunk_tier", "chunk_tiers", "set_tensor_state", "start_move", "end_iteration"):
            setattr(self, name, getattr(self.manager, name))

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def access(self, tensor_id: int, tier: str) -> torch.Tensor:
        if self.before_access is not None:
            self.before_access(tensor_id)
        return self.manager.access_tensor(tensor_id, tier)

    def access_tensors(self, tensor_ids: list[int], tiers: list[str]) -> list[torch.Tensor]:
        """access() of each tensor on its tier, all or none."""
        if self.before_access is not None:
            for tensor_id in tensor_ids:
                self.before_access(tensor_id)
        return self.manager.access_tensors(tensor_ids, tiers)

    def stats(self) -> list[dict]:
        return json.loads(self.manager.tier_stats_json())


class _UpdateRow:
    """Parameters whose optimizer state shares a momentum chunk, and every chunk their update
    touches (Note [Optimizer sweep])."""

    __slots__ = ("indices", "chunks")

    def __init__(self):
        self.indices: list[int] = []
        self.chunks: set[int] = set()


class _SavedParamView:
    """A saved tensor that is a view of a parameter's chunk memory (Note [Saved views of
    parameters])."""

    __slots__ = ("index", "offset", "size", "stride")

    def __init__(self, index: int, offset: int, size, stride):
        self.index = index
        self.offset = offset
        self.size = size
        self.stride = stride


class _Tensors:
    """The chunk-manager tensor ids of one parameter."""

    __slots__ = ("compute", "master", "grad", "momentum", "variance")

    def __init__(self):
        self.compute = self.master = self.grad = self.momentum = self.variance = None


def chunk_dtypes(precision: str, accumulation_steps: int) -> dict[str, str | None]:
    """The dtype name of each chunk tensor of a parameter, by `_Tensors` slot (None: not used);
    Note [Chunk kinds per precision]."""
    mixed = precision != "fp32"
    compute = _DTYPE_NAMES[_DTYPES[precision]]
    return {"compute": compute, "master": "float32" if mixed else None,
            "grad": "float32" if accumulation_steps > 1 or not mixed else compute,
            "momentum": "float32", "variance": "float32"}


def register_chunk_tensors(manager, specs, dtypes: dict[str, str | None],
                           chunk_size: int | None, compute_order=None):
    """Registers every chunk tensor of `specs` with `manager` and builds the chunk lists, as the
    engine lays out a model (also used by `estimate_memory`, so its figures are the runtime's).
    Returns the per-parameter `_Tensors` ids and the layout report."""
    ids = [_Tensors() for _ in specs]
    for i in (range(len(specs)) if compute_order is None else compute_order):
        ids[i].compute = manager.register_tensor(specs[i].name, list(specs[i].shape),
                                                 K.COMPUTE_PARAM, dtypes["compute"])
    trainable = [i for i, spec in enumerate(specs) if spec.requires_grad]
    # Registered kind by kind so each list packs in registration order.
    for kind, attr in ((K.MASTER_PARAM, "master"), (K.GRADIENT, "grad"),
                       (K.MOMENTUM, "momentum"), (K.VARIANCE, "variance")):
        if dtypes[attr] is None:
            continue
        for i in trainable:
            setattr(ids[i], attr, manager.register_tensor(
                f"{specs[i].name}#{attr}", list(specs[i].shape), kind, dtypes[attr]))
    if chunk_size is None:
        largest = max(math.prod(spec.shape) or 1 for spec in specs)
        low = max(1 << 16, largest // 4)
        layout = manager.search_chunk_lists(low, max(low, 4 * largest), max(1, low // 4))
    else:
        layout = manager.build_chunk_lists(chunk_size)
    return ids, layout


class PatrickStarEngine(nn.Module):
    """What `initialize()` returns as `model`: call it like the module, then
    `model.backward(loss)`. `model.module` is the user's module."""

    def __init__(self, model_func: Callable[[], nn.Module], config: Config, local_rank: int,
                 param_groups=None):
        super().__init__()
        self.config = config
        self.local_rank = local_rank
        self.precision = config.precision
        self.compute_dtype = _DTYPES[self.precision]
        self.mixed = self.precision != "fp32"
        self.grad_dtype = getattr(torch, chunk_dtypes(
            self.precision, config.gradient_accumulation_steps)["grad"])
        self.loss_scaler = make_loss_scaler(config)
        self._guard = TrainingGuard(config)  # Note [Training call order] in guards.py
        self._micro_step = 0
        self._iteration = 0
        self._warmup_done = False

        # Before the model is built: tensor-parallel layers size their slices by the groups.
        self._dp = DataParallel(config, *detect_world(config))
        specs, survives = plan_parameters(model_func)
        if not specs:
            raise ValueError("model_func built a module without parameters; nothing to train")
        self._build_runtime(specs)

        self._init_views: dict[int, int] = {}
        self._init_residency = InitResidency(
            lambda index: self.chunks.access(self._init_views[index], T.HOST),
            lambda index: self.chunks.release(self._init_views[index], S.HOLD),
            _C.ChunkOutOfMemoryError)
        placer = ParameterPlacer(survives, self._place_at_init)
        module = placer.build(model_func)
        self.add_module("module", module)
        self._params: list[nn.Parameter] = placer.parameters
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._shapes = [spec.shape for spec in specs]
        self._names = [spec.name for spec in specs]
        self._dp.attach(self)
        self._finish_init()
        self._dp.after_init()
        # The warm-up trace is one training iteration: initialization's host accesses would
        # otherwise be replayed by the prefetcher every iteration.
        self.chunks.restart_warmup()

        # Every other saved tensor: the CPU measure of non-model data (Note [Measured non-model
        # data] in profiler.py).
        self.activations = ActivationCounter()
        self._has_grad = [False] * len(self._params)
        self._module_params = {
            module: [self._param_index[id(p)] for p in module.parameters(recurse=False)]
            for module in self.module.modules()}
        placeholder = self._placeholder()
        for index, param in enumerate(self._params):
            param.data = placeholder
        # Note [Parameter slots] in bindings/parameter_slots.cc: access counts, .data swaps and
        # gradient stores in one C++ call per module or gradient.
        self._slots = _C.ParameterSlots(
            self.chunks.manager, self._params, [ids.compute for ids in self._ids],
            [ids.grad for ids in self._ids], self._device_tier(), placeholder)
        self._slots.set_before_access(self.chunks.before_access)  # set by _dp.after_init()
        # Where the activations really are: GPU memory with CUDA; host memory on a CPU build,
        # whose device tier only emulates a GPU's budget for chunks.
        self._non_model_tier = T.DEVICE if self.device.type == "cuda" else T.HOST
        for index, param in enumerate(self._params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._make_grad_hook(index))
        self._hooks = ModuleHooks([m for m, owned in self._module_params.items() if owned],
                                  self._access_module, self._release_module, self._tick)
        defaults = {"lr": config.optimizer.lr, "betas": config.optimizer.betas,
                    "eps": config.optimizer.eps, "weight_decay": config.optimizer.weight_decay}
        groups = build_param_groups(self.module, param_groups, defaults)
        self._group_of = {}
        for group_index, group in enumerate(groups):
            for param in group["params"]:
                self._group_of[self._param_index[id(param)]] = group_index
        self._step_count = [0] * len(self._params)
        self.optimizer = PatrickStarOptimizer(self, groups, config.optimizer.decoupled_weight_decay)
        self.profiler = profiler_from_config(self)  # None unless config profile.enabled

    # ---- Construction --------------------------------------------------------------------------

    def _build_runtime(self, specs) -> None:
        config = self.config
        memory = config.memory
        tiers = []
        if _C.cuda_available():
            self.device = torch.device("cuda", self.local_rank)
            tiers.append(_C.DeviceTier(self.local_rank, budget=memory.device_budget or 0,
                                       name=f"cuda:{self.local_rank}"))
        else:
            self.device = torch.device("cpu")
            tiers.append(_C.EmulatedDeviceTier(budget=memory.device_budget or 0, name="device"))
        tiers.append(_C.HostTier(budget=memory.host_budget or 0, name="host",
                                 pinned=_C.cuda_available()))
        if memory.nvme.path is not None:
            tiers.append(_C.NvmeTier(memory.nvme.path, budget=memory.nvme.budget,
                                     queue_depth=memory.nvme.queue_depth,
                                     block_size=memory.nvme.block_size, name="nvme"))
        self.tiers = tiers
        self._has_nvme = memory.nvme.path is not None
        self._rows: list[_UpdateRow] | None = None  # built at the first step
        self._tensor_chunk: dict[int, int] = {}
        self.copy_engine = _C.CopyEngine(host_threads=2, device=self.local_rank)
        self.chunks = _ChunkManager(tiers, self.copy_engine, self._dp.world_size, self._dp.rank)
        self._ids, self.layout = register_chunk_tensors(
            self.chunks, specs, chunk_dtypes(self.precision, config.gradient_accumulation_steps),
            config.default_chunk_size, self._dp.compute_registration_order(specs))
        check_budgets(config, self.chunks.layout_json(), [spec.name for spec in specs],
                      [spec.requires_grad for spec in specs], self.mixed,
                      device_is_host_memory=self.device.type == "cpu")

    def _init_storage_ids(self, index: int) -> int | None:
        ids = self._ids[index]
        if ids.master is not None and not self._dp.owns(self.chunks.manager, ids.master):
            return None  # data parallel: another rank keeps this master copy
        return ids.master if ids.master is not None else ids.compute

    def _place_at_init(self, index: int, param: nn.Parameter) -> torch.Tensor:
        # The fp32 copy (master in mixed precision) receives the module's own initialization.
        tensor_id = self._init_storage_ids(index)
        if tensor_id is None:  # the fp32 initialization lands in a temporary
            view = torch.empty(param.shape, dtype=torch.float32)
            self._init_views[index] = view
            return view
        self._init_views[index] = tensor_id
        return self._init_residency.place(index, param)

    def _finish_init(self) -> None:
        self._init_residency.finish()
        # Parameters released early while the model was built (Note [Initialization under a host
        # budget]); 0 when every slot fit on the host.
        self.init_deferrals = self._init_residency.deferrals
        if self.mixed:  # in fp32 the slots written at init are the compute chunks themselves
            self._compute_from_masters()
        del self._init_views, self._init_residency

    def _compute_from_masters(self) -> None:
        """Writes each parameter's 16-bit compute copy from the fp32 values built at init."""
        with torch.no_grad():
            for index, tensor_id in sorted(self._init_views.items(), key=lambda item: item[0]):
                ids = self._ids[index]
                # One parameter at a time, so the host needs room for two chunks, not the model.
                if isinstance(tensor_id, torch.Tensor):
                    master = tensor_id
                else:
                    master = self.chunks.access(tensor_id, T.HOST)
                try:
                    compute = self.chunks.access(ids.compute, T.HOST)
                    compute.copy_(master.view_as(compute))
                    self.chunks.release(ids.compute, S.HOLD)
                finally:
                    if not isinstance(tensor_id, torch.Tensor):
                        self.chunks.release(tensor_id, S.HOLD)

    def _placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.compute_dtype, device=self.device)

    # ---- Access and release --------------------------------------------------------------------

    def _device_tier(self):
        return T.DEVICE

    def _access_module(self, module: nn.Module, phase: str) -> None:
        indices = self._module_params.get(module)
        if indices:
            self._slots.access(indices)

    def _release_module(self, module: nn.Module, phase: str) -> None:
        indices = self._module_params.get(module)
        if indices:
            self._slots.release(indices, S.HOLD_AFTER_FWD if phase == "fwd" else S.HOLD_AFTER_BWD)

    def _release_all(self, state) -> None:
        self._slots.release_all(state)

    def _tick(self, event: str) -> None:
        if self.profiler is not None:
            self.profiler.on_tick(event)
        self.chunks.tick(self._non_model_tier, self.non_model_bytes())

    def non_model_bytes(self) -> int:
        """Non-model data now: Note [Measured non-model data] in profiler.py."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.activations.bytes

    # ---- Forward / backward --------------------------------------------------------------------

    def _pack_saved(self, tensor: torch.Tensor):
        index = self._slots.saved_index(tensor)
        if index < 0:
            return self.activations.pack(tensor)
        return _SavedParamView(index, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _unpack_saved(self, packed):
        if not isinstance(packed, _SavedParamView):
            return self.activations.unpack(packed)
        if self._slots.access_count(packed.index) == 0:
            # No hook accessed it for this backward (a parameter used outside its module's
            # forward); backward() releases it when it ends.
            self._slots.access([packed.index])
        data = self._params[packed.index].data
        return data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset)

    def forward(self, *args, **kwargs):
        self._guard.check_alive("model(...)")
        self._dp.before_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved):
                output = self.module(*args, **kwargs)
        finally:
            if not torch.is_grad_enabled() or not self.module.training:
                # No backward follows: give everything back now.
                self._release_all(S.HOLD_AFTER_FWD)
        self._dp.after_forward()
        return output

    def backward(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward(loss) expects a scalar loss tensor")
        if not self._guard.before_backward(loss, self.precision):
            return
        scale = self.loss_scaler.scale / self.config.gradient_accumulation_steps
        self._run_backward([loss.float() * scale], None)

    def backward_from(self, tensors, grads) -> None:
        """Backward from non-scalar `tensors` given their gradients: a pipeline stage other
        than the last (pipe/engine.py), whose received gradients already carry the loss scale
        and 1/gradient_accumulation_steps. Counts as one `backward()` call."""
        if not self._guard.before_backward(torch.zeros(()), self.precision):
            return
        self._run_backward(tensors, grads)

    def _run_backward(self, tensors, grads) -> None:
        try:
            if tensors:
                torch.autograd.backward(tensors, grads)
        finally:
            # Modules whose inputs need no grad never see their post-backward hook.
            self._release_all(S.HOLD_AFTER_BWD)
        self._guard.after_backward()
        self._dp.after_backward()
        self._micro_step += 1

    def _make_grad_hook(self, index: int):
        def hook(param: nn.Parameter) -> None:
            grad = param.grad
            param.grad = None  # its memory goes back to torch right away
            if grad is None:
                return
            self._slots.store_grad(index, grad, self._has_grad[index])
            self._has_grad[index] = True
            self._dp.on_grad(index)
        return hook

    # ---- Optimizer -----------------------------------------------------------------------------

    def _grad_views(self):
        """Yields (index, grad view) of every parameter that has a gradient this step, each
        read where its chunk is (Note [Optimizer sweep]); COMPUTE until the generator moves on."""
        for index, has in enumerate(self._has_grad):
            if not has:
                continue
            grad_id = self._ids[index].grad
            view = self.chunks.access(grad_id, self._update_tiers([grad_id])[0])
            try:
                yield index, view
            finally:
                self.chunks.release(grad_id, S.HOLD)

    def _gradient_statistics(self) -> tuple[bool, float]:
        overflow = False
        squared = 0.0
        for _, grad in self._grad_views():
            grad_squared, bad = _C.kernels.grad_stats([grad])
            overflow |= bad
            squared += grad_squared
        overflow, squared = self._dp.all_reduce_grad_stats(overflow, squared)
        return overflow, math.sqrt(squared)

    def optimizer_step(self, optimizer: PatrickStarOptimizer) -> bool:
        """Applies one Adam/AdamW step; returns False when it was skipped for overflow."""
        run = self._guard.before_step()
        self._guard.after_step()
        if not run:  # a non-finite loss was skipped (config nonfinite_loss: "skip")
            self.zero_grad()
            self._end_iteration()
            return False
        clip = self.config.gradient_clipping
        # The scale the gradients carry: backward() used it and only this method changes it.
        grad_scale = self.loss_scaler.scale
        overflow, norm = False, 0.0
        if clip > 0 or self.precision == "fp16":  # one read pass over the gradients
            overflow, norm = self._gradient_statistics()
        # Only fp16 skips steps; elsewhere a non-finite gradient reaches the parameters as it
        # would in plain PyTorch.
        overflow = overflow and self.precision == "fp16"
        self.loss_scaler.update(overflow)
        if overflow:
            self.zero_grad()
            self._end_iteration()
            return False
        coef = clip_coefficient(norm / grad_scale, clip) if clip > 0 else 1.0
        try:
            self._sweep(optimizer, grad_scale, coef)
        except BaseException as error:
            self._guard.step_failed(error)
            raise
        self.zero_grad()
        self._end_iteration()
        return True

    def _update_tensors(self, index: int) -> list[int]:
        """The chunk tensors one Adam update of parameter `index` reads and writes."""
        ids = self._ids[index]
        accessed = [ids.master if self.mixed else ids.compute, ids.grad, ids.momentum,
                    ids.variance]
        if self.mixed:
            accessed.append(ids.compute)
        return accessed

    def _update_rows(self) -> list[_UpdateRow]:
        if self._rows is None:
            rows: dict[int, _UpdateRow] = {}
            for index, ids in enumerate(self._ids):
                if ids.momentum is None or not self._dp.owns(self.chunks.manager, ids.momentum):
                    continue
                row = rows.setdefault(self._chunk_of(ids.momentum), _UpdateRow())
                row.indices.append(index)
                row.chunks.update(self._chunk_of(t) for t in self._update_tensors(index))
            self._rows = [rows[chunk] for chunk in sorted(rows)]
        return self._rows

    def _chunk_of(self, tensor_id: int) -> int:
        chunk = self._tensor_chunk.get(tensor_id)
        if chunk is None:
            chunk = self._tensor_chunk[tensor_id] = \
                self.chunks.manager.tensor_info(tensor_id)["chunk"]
        return chunk

    def _update_tiers(self, tensor_ids: list[int]) -> list[str]:
        """Where the optimizer reads and writes each tensor: Note [Optimizer sweep]."""
        tiers = self.chunks.chunk_tiers([self._chunk_of(t) for t in tensor_ids])
        if self.device.type == "cpu":  # the device tier is host memory too
            return [tier if tier in (T.DEVICE, T.HOST) else T.HOST for tier in tiers]
        on_device = all(tier == T.DEVICE for tier in tiers)
        return [T.DEVICE if on_device else T.HOST] * len(tiers)

    def _sweep(self, optimizer: PatrickStarOptimizer, grad_scale: float, coef: float) -> None:
        """Note [Optimizer sweep]."""
        rows = [row for row in self._update_rows()
                if any(self._has_grad[i] for i in row.indices)]
        streaming = self._has_nvme
        staged: set[int] = set()  # chunks this sweep brought up from NVMe

        def read_ahead(row: _UpdateRow) -> None:
            for chunk in sorted(row.chunks):
                if self.chunks.chunk_tier(chunk) == "nvme":
                    staged.add(chunk)
                    self.chunks.start_move(chunk, T.HOST)

        if streaming and rows:
            read_ahead(rows[0])
        for k, row in enumerate(rows):
            following = rows[k + 1] if k + 1 < len(rows) else None
            if streaming and following is not None:
                read_ahead(following)
            for index in row.indices:
                if not self._has_grad[index]:
                    continue
                group = optimizer.param_groups[self._group_of[index]]
                self._step_count[index] += 1
                self._adam_update(index, group, grad_scale, coef)
            if streaming:
                for chunk in sorted(row.chunks & staged):
                    if following is None or chunk not in following.chunks:
                        staged.discard(chunk)
                        self.chunks.start_move(chunk, "nvme")

    def _adam_update(self, index: int, group: dict, grad_scale: float, coef: float) -> None:
        tensors = self._update_tensors(index)
        views = self.chunks.access_tensors(tensors, self._update_tiers(tensors))
        try:
            beta1, beta2 = group["betas"]
            _C.kernels.adam_(
                views[0], views[1], views[2], views[3],
                param_copy=views[4] if self.mixed else None,
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw=self.optimizer.decoupled_weight_decay,
                step=self._step_count[index], grad_scale=grad_scale, clip_coef=coef)
        finally:
            self.chunks.release_tensors(tensors, S.HOLD)

    def zero_grad(self) -> None:
        for index, has in enumerate(self._has_grad):
            if has:
                self.chunks.set_tensor_state(self._ids[index].grad, S.FREE)
                self._has_grad[index] = False

    def _end_iteration(self) -> None:
        self._dp.after_step()
        self.chunks.end_iteration()
        if self.profiler is not None:
            self.profiler.on_end_iteration()
        self._iteration += 1

    # ---- State dicts ---------------------------------------------------------------------------

    def _read_param(self, index: int) -> torch.Tensor:
        tensor_id = self._ids[index].compute
        view = self.chunks.access(tensor_id, T.HOST)
        try:
            return view.view(self._shapes[index]).clone()
        finally:
            self.chunks.release(tensor_id, S.HOLD)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state dict with full parameters (compute dtype) read out of chunks."""
        self._dp.gather_all()  # a collective: every rank calls state_dict()
        result = self.module.state_dict(keep_vars=True)
        for name, value in list(result.items()):
            index = self._param_index.get(id(value))
            if index is not None:
                result[name] = self._read_param(index)
            elif not keep_vars and isinstance(value, torch.Tensor):
                result[name] = value.detach()
        if destination is not None:
            destination.update({prefix + k: v for k, v in result.items()})
            return destination
        return {prefix + k: v for k, v in result.items()} if prefix else result

    def load_state_dict(self, state_dict, strict: bool = True):
        """Accepts plain PyTorch tensors (any float dtype) for every parameter and buffer."""
        own = self.module.state_dict(keep_vars=True)
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys "
                               f"{unexpected}")
        with torch.no_grad():
            for name, value in own.items():
                if name not in state_dict:
                    continue
                source = state_dict[name]
                index = self._param_index.get(id(value))
                shape = self._shapes[index] if index is not None else tuple(value.shape)
                if tuple(source.shape) != tuple(shape):
                    raise ValueError(f"load_state_dict: '{name}' has shape {tuple(source.shape)} "
                                     f"in the state dict but {tuple(shape)} in the model")
                if index is None:
                    value.copy_(source)
                    continue
                ids = self._ids[index]
                for tensor_id in (ids.compute, ids.master):
                    if tensor_id is None or not self._dp.owns(self.chunks.manager, tensor_id):
                        continue  # data parallel: the owner loads it
                    view = self.chunks.access(tensor_id, T.HOST)
                    try:
                        view.view(shape).copy_(source)
                    finally:
                        self.chunks.release(tensor_id, S.HOLD)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def optimizer_state_dict(self, optimizer) -> dict:
        state = {}
        for index, param in enumerate(self._params):
            ids = self._ids[index]
            if ids.momentum is None or self._step_count[index] == 0:
                continue
            entry = {"step": torch.tensor(float(self._step_count[index]))}
            for key, tensor_id in (("exp_avg", ids.momentum), ("exp_avg_sq", ids.variance)):
                view = self.chunks.access(tensor_id, T.HOST)
                try:
                    entry[key] = view.view(self._shapes[index]).clone()
                finally:
                    self.chunks.release(tensor_id, S.HOLD)
            state[index] = entry
        groups = []
        for group in optimizer.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [self._param_index[id(p)] for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups,
                "loss_scaler": self.loss_scaler.state_dict()}

    def load_optimizer_state_dict(self, optimizer, state_dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"optimizer state dict has {len(groups)} param groups, the "
                             f"optimizer {len(optimizer.param_groups)}")
        for saved, group in zip(groups, optimizer.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, entry in state_dict["state"].items():
            index = int(index)
            ids = self._ids[index]
            self._step_count[index] = int(entry["step"])
            for key, tensor_id in (("exp_avg", ids.momentum), ("exp_avg_sq", ids.variance)):
                view = self.chunks.access(tensor_id, T.HOST)
                try:
                    view.view(self._shapes[index]).copy_(entry[key])
                finally:
                    self.chunks.release(tensor_id, S.HOLD)
        if "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # ---- Checkpoints (logic in checkpoint.py) ---------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        lr_scheduler=None) -> bool:
        """DeepSpeed's call: writes DIR/TAG atomically, then DIR/latest. The lr scheduler is
        `lr_scheduler` or `model.lr_scheduler` when set."""
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                          lr_scheduler)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        **kwargs):
        """DeepSpeed's call; returns (path, client_state), (None, None) without `latest`."""
        loaded = checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                            load_lr_scheduler_states, load_module_only, **kwargs)
        if loaded[0] is not None and not load_module_only and load_optimizer_states:
            self._guard.failed_step = None  # a consistent state again (guards.py)
        if self.chunks.warming_up:  # loading is not part of the iterations the trace repeats
            self.chunks.restart_warmup()
        return loaded

    def destroy(self) -> None:
        """Frees every chunk and tier now (DeepSpeed's `engine.destroy()`); later calls raise.
        NVMe swap files go away with their tier once nothing else holds it."""
        self._guard.destroyed = True
        self._dp.close()
        self._hooks.remove()
        for param in self._params:
            param.data = self._placeholder()
        self.chunks.close()
        self.chunks = self.tiers = self.copy_engine = None

    def memory_stats(self) -> list[dict]:
        """Per tier: budget, chunk bytes now and at peak, bytes moved in and out, evictions."""
        return self.chunks.stats()


def initialize(model_func: Callable[[], nn.Module], config=None, local_rank: int = 0,
               param_groups=None):
    """Builds `model_func()` on the chunk runtime and returns `(model, optimizer)`.

    `model_func` may also be a `patrickstar.pipe.PipelineModule`: each rank then builds only its
    pipeline stage and gets a `PipelineEngine` (train with `engine.train_batch(data_iter)`).
    `config` is a dict or a path to a JSON file (see `patrickstar.config`); `param_groups`
    optionally splits the parameters into groups with their own `lr` / `weight_decay`, either as
    torch.optim's list of dicts or as a callable taking the built module and returning one."""
    from .pipe import PipelineModule  # pipe/ imports this module
    if isinstance(model_func, PipelineModule):  # one engine per stage (pipe/engine.py)
        from .pipe.engine import PipelineEngine
        engine = PipelineEngine(model_func, config, local_rank, param_groups)
        return engine, engine.optimizer
    if not callable(model_func) or isinstance(model_func, nn.Module):
        raise TypeError("initialize(model_func, ...): model_func must be a callable that builds "
                        "and returns the model (e.g. a class or a lambda), not "
                        f"{type(model_func).__name__}; PatrickStar builds the model itself so "
                        "its parameters go straight into chunks")
    if not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank must be a non-negative int, got {local_rank!r}")
    engine = PatrickStarEngine(model_func, load_config(config), local_rank, param_groups)
    return engine, engine.optimizer


def initialize_engine(model_func: Callable[[], nn.Module], local_rank: int = 0, config=None,
                      param_groups=None):
    """`initialize()` under PatrickStar's name and argument order."""
    return initialize(model_func, config=config, local_rank=local_rank,
                      param_groups=param_groups)
