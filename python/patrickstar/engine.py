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
Note [Parameter slots] in bindings/parameter_slots.cc): one call per module or gradient. Each
parameter also carries DeepSpeed ZeRO-3's `ds_numel` and `ds_shape` (its real size), which
libraries that count parameters (PEFT's `print_trainable_parameters`) read when `numel()` is 0.
A write into a placeholder raises at the next access (Note [Writes to a released parameter]);
`model.apply(fn)` is the way to change weights in place.

Note [Saved views of parameters] and Note [Outputs that are parameters] are in saved_views.py.

Note [Optimizer sweep] is in optimizer.py, Note [Chunk kinds per precision] in
chunked_params.py.

Note [Engine lifetime]
`del model, optimizer` frees the engine like any PyTorch model: every chunk, tier (and its NVMe
swap file), thread and communicator. Callbacks the engine hands out are held where Python's
collector cannot follow them: by parameters that a C++ object (`_C.ParameterSlots`) also holds,
by module hooks, by the data-parallel side whose `before_access` C++ calls. Each reaches the
engine through a weak reference (`_weakly`, the gradient hooks, the back references of
DataParallel, ModelParallelGradStats and the profiler), so only the user's references keep it
alive. The optimizer too holds the engine weakly (its `end_iteration` and profiler phase), so
that no cycle runs through the engine: `del model, optimizer` frees it at once by reference
counts, as a torch module and its optimizer go, not at the cycle collector's next full pass (a
loop building the next engine after `del` held both engines' chunks until then). The engine
holds its optimizer (DeepSpeed's `model.step()` needs it when the script kept only `model`);
an optimizer whose engine was deleted refuses to step, naming that. `__del__` then runs
`destroy()`, which writes a running profile first and closes everything. At
interpreter exit (normal, or after an uncaught exception) `_destroy_live_engines` destroys the
engines still alive, so swap files do not outlive the process. It is registered at `import
patrickstar`, and atexit runs the last registered function first: a script's exit function
registered after the import still reads the model; one registered before it meets a destroyed
engine, and its error says so. `destroy()` stays the explicit
way; a second call does nothing. A process forked from the engine's (os.fork, multiprocessing,
DataLoader workers) inherits it: every training call there raises (Note [Training call order]
in guards.py), and its destroy() (the exit hook, `del`) leaves the runtime undestroyed: tearing
it down waited for threads that exist only in the parent (`_abandon_inherited_runtime`), and its
profile, swap file and IO are the parent's (Note [Swap files across fork] in
runtime/nvme_tier.h).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import ctypes
import dataclasses
import functools
import math
import sys
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from . import (_C, accelerate_precision, added_params, averaged_model, backward_pre_hooks,
               checkpoint, clip_grad, convert_parameters, ddp_methods, ddp_wrapping, dtypes,
               hooks, module_zero_grad, param_owners, parametrizations, pruning,
               replaced_params, resting_params, script_collectives, shared_memory,
               sixteen_bit_model, topology, torch_optimizers)
from .activations import ActivationCounter
from .chunk_runtime import ChunkRuntime
from .chunked_params import ChunkedParams
from .config import Config, fitted_chunk_size
from .module_config_view import ModuleConfigView
from .data_parallel import DataParallel, close_at_exit as close_data_parallel_at_exit, detect_world
from .backward_pins import backward_pins, note_device_exhausted_in_backward
from .backward_pass import BackwardPass
from .batch_sizes import resolve_batch_sizes
from .deepspeed_loop import DeepSpeedLoop, GradNorm
from .deepspeed_schedulers import build_scheduler
from .guards import TrainingGuard, check_budgets
from .embedding_renorm import RenormAcrossRanks, refuse_lost_renorms
from .external_params import (external_parameter_hint, external_parameters,
                              unknown_external_parameter, unregistered_read_note)
from .hooks import CallHooks, ModuleHooks
from .memory_formats import format_name, memory_format_warning
from .module_apply import ModuleApply
from .module_copies import ModuleCopies
from .module_methods import ModuleMethods
from .module_state_hooks import ModuleStateHooks
from .first_rank_init import first_rank_rng, take_first_rank_state
from .init_context import (BuiltModule, InitResidency, ParameterPlacer, build_lock,
                           built_dtype_warning, plan_parameters, sparse_gradient_error)
from .input_cast import cast_floating_inputs, inputs_to_device
from .loss_scaler import make_loss_scaler
from .output_loss_scale import OutputLossScale
from .optimizer import PatrickStarOptimizer, build_param_groups
from .parameter_values import ParameterValues
from .saved_views import SavedParameterViews
from .traced_calls import refuse_script_call, refuse_scripting, refuse_traced_call
from .profiling.recorder import (make_config_profile_directory, optimizer_phase,
                                 profiler_from_config)
from .profiling.upstream import profiler as upstream_profiler
from .synced_generate import modules_called_alone, synced_generate
from .utils import get_rank, get_world_size, global_timer
from .vocabulary import Tier as T

__all__ = ["PatrickStarEngine"]

S = _C.TensorState


def _weakly(method: Callable) -> Callable:
    """`method` (bound to the engine or an object only it holds), called only while the engine
    lives: Note [Engine lifetime]."""
    reference = weakref.WeakMethod(method)

    def call(*args):
        bound = reference()
        return None if bound is None else bound(*args)
    return call


def _profiler_phase(engine: "weakref.ref[PatrickStarEngine]") -> Callable:
    """The optimizer's phase on the engine's profiler, holding the engine weakly (Note [Engine
    lifetime]): once the engine is gone its guard refuses the step."""
    def phase():
        alive = engine()
        return optimizer_phase(None if alive is None else alive.profiler)
    return phase


def _recomputing() -> bool:
    """A module's forward running inside an autograd backward: activation checkpointing's
    recomputation (Note [Recomputed forwards])."""
    return torch._C._current_graph_task_id() != -1


def _refuse_wrapping_data_parallel(engine: nn.Module) -> None:
    """An engine inside torch's DistributedDataParallel (nanoGPT's `model = DDP(model)`) failed
    in backward with "returned an invalid gradient ... expected shape compatible with [0]": DDP
    hooks the parameters while they hold placeholders, and would average gradients the engine
    already reduce-scatters."""
    active = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if active is not None and active.module is engine:
        raise RuntimeError(
            "a PatrickStar engine was wrapped in torch DistributedDataParallel: the engine "
            "already trains data-parallel over the torchrun ranks (each rank keeps 1/N of the "
            "model and the gradients are reduce-scattered in its chunks). Use the engine "
            "directly: drop the DDP(model) wrapper and call model(...), model.backward(loss) "
            "(or loss.backward()) and optimizer.step()")


# Engines not yet destroyed: destroyed at interpreter exit (Note [Engine lifetime]).
_live_engines: "weakref.WeakSet[PatrickStarEngine]" = weakref.WeakSet()


@atexit.register
def _destroy_live_engines() -> None:
    # The data-parallel sides first, those of engines whose initialize() failed too (Note
    # [Closing at exit from the engines' hook] in data_parallel.py).
    close_data_parallel_at_exit()
    for engine in list(_live_engines):
        # A daemon thread may be training: Note [One thread at a time] in guards.py.
        engine.guard.quiesce_for_exit()
        engine.destroy()


class PatrickStarEngine(nn.Module):
    """What `initialize()` returns as `model`: call it like the module, then
    `model.backward(loss)`. `model.module` is the user's module."""

    # The tier whose chunks forward and backward compute on (the parameter accesses; data
    # parallelism receives gathered chunks there when it can: Note [Receiving where the group
    # is computed on] in chunk/group_collectives.h).
    compute_tier = T.DEVICE

    def __init__(self, model_func: Callable[[], nn.Module], config: Config, local_rank: int,
                 param_groups=None):
        super().__init__()
        # Before anything reads the accumulation: DeepSpeed's batch keys set it from the
        # data-parallel size (Note [DeepSpeed's batch keys set the accumulation]).
        world = detect_world(config)
        config = resolve_batch_sizes(config, world[0])
        self.ps_config = config  # `config` is a view of it and the module's (ModuleConfigView)
        self.local_rank = local_rank
        self.precision = config.precision
        self.compute_dtype = dtypes.precision_dtype(self.precision)
        self.mixed = self.precision != "fp32"
        self.loss_scaler = make_loss_scaler(config)
        groups = topology.current()
        model_parallel = groups is not None and groups.pipe_size * groups.tensor_size > 1
        # Note [Training call order] in guards.py
        self.guard = TrainingGuard(config, world[0], model_parallel)
        self.micro_step = 0
        self.iteration = 0
        self._samples_offset = 0  # Note [Samples counted across batch sizes]
        # DeepSpeed's loop (Note [model.step() steps model.lr_scheduler] in deepspeed_loop.py).
        self._loop = DeepSpeedLoop(self.guard)
        self._in_forward = False  # within forward(): Note [Forwards of the module itself]
        self._direct_forward = None  # an outermost direct call's "a backward follows", or None
        self._warmup_done = False
        # Module -> accesses of forwards recomputed inside this backward that its backward has
        # not yet given back (Note [Recomputed forwards]).
        self._recompute_holds: dict[nn.Module, int] = {}
        # The class parameters not in use have (ParameterAtRest, or ParameterInFlight between
        # a forward and its backward), None while awake: Note [Parameters at rest].
        self._resting: type | None = None
        # True while rest_parameters() or wake_parameters() goes over the parameters: Note
        # [Class changes cut short].
        self._resting_changing = False
        self._summoned = 0  # open summon_full_params() blocks: Note [No forward while summoned]
        # Note [The engine is prepared for accelerate]
        # Hugging Face accelerate's prepare(model) (its loops, and the Trainer's) places a model
        # on the device, wraps it in DDP under a multi-process launch and wraps its forward in
        # autocast for `mixed_precision`. The engine is already all that, as DeepSpeed's and
        # FSDP's engines are to it: DDP around it is refused (_refuse_wrapping_data_parallel)
        # and its precision is the config's. accelerate returns a model that says it was
        # prepared as it is ("Ensure we can't double wrap a model"): the property
        # _is_accelerate_prepared (Note [accelerate's mixed precision on the engine]).
        self._accelerate_precision_checked = False

        # Before the model is built: tensor-parallel layers size their slices by the groups.
        self.dp = DataParallel(config, *world)
        make_config_profile_directory(config)  # before a built module's weights move
        # Note [The first rank's initial weights] in first_rank_init.py.
        if self.dp.enabled and isinstance(model_func, BuiltModule):
            take_first_rank_state(model_func.module, self.dp.group)
        # Note [Building in one thread at a time] in init_context.py
        with build_lock(), first_rank_rng(self.dp.enabled, self.dp.group):
            specs, survives, pins = plan_parameters(model_func, backward_pins)
            if not specs:
                raise ValueError("model_func built a module without parameters; nothing to train")
            message = built_dtype_warning(specs, self.precision, self.compute_dtype)
            if message is not None:
                warnings.warn(message, stacklevel=3)
            self._build_runtime(specs, pins)

            self._init_views: dict[int, int] = {}
            self._init_residency = InitResidency(
                lambda index: self.chunks.access(self._init_views[index], T.HOST),
                lambda index: self.chunks.release(self._init_views[index], S.HOLD),
                _C.ChunkOutOfMemoryError)
            placer = ParameterPlacer(survives, [spec.shape for spec in specs],
                                     self._place_at_init)
            module = placer.build(model_func)
        # Note [Renormalizing embeddings]
        refuse_lost_renorms(module, self.precision, config.bf16_master_weights,
                            self.dp.world_size)
        formats = placer.formats
        formats.update(self._take_replaced_data(placer.parameters))
        message = memory_format_warning({specs[i].name: kind for i, kind in formats.items()},
                                        len(specs))
        if message is not None:
            warnings.warn(message, stacklevel=3)
        self.add_module("module", module)
        self._move_buffers(lambda buffer: buffer.to(self.device))
        if self.mixed:
            self._buffers_to_compute_dtype()  # Note [Buffers of 16-bit modules]
        self.params.bind(placer.parameters)
        self._empty_parameters_to_compute_dtype()
        self.dp.attach(self)
        self._finish_init()
        self.dp.after_init()
        # The warm-up trace is one training iteration: initialization's host accesses would
        # otherwise be replayed by the prefetcher every iteration.
        self.chunks.restart_warmup()

        # Every other saved tensor: the CPU measure of non-model data (Note [Measured non-model
        # data] in activations.py).
        self.activations = ActivationCounter()
        self._module_params = {module: self._parameters_used_by(module)
                               for module in self.module.modules()}
        for param, shape in zip(self.params.params, self.params.shapes):
            param.ds_shape = torch.Size(shape)
            param.ds_numel = param.ds_shape.numel()
        # Note [Parameter slots] in bindings/parameter_slots.cc: access counts, .data swaps and
        # gradient stores in one C++ call per module or gradient; the slots point every
        # parameter's .data at the placeholder.
        self._slots = _C.ParameterSlots(
            self.chunks.manager, self.params.params, [ids.compute for ids in self.params.ids],
            [ids.grad for ids in self.params.ids], self.compute_tier, self._placeholder(),
            [f"module.{name}" for name in self.params.names])
        self._slots.set_before_access(self.chunks.before_access)  # set by dp.after_init()
        # Note [Loading the weights the model has] in parameter_values.py
        self._parameter_values = ParameterValues(self.guard, self.params, self.dp, self._slots,
                                                 self.compute_dtype)
        # Where the activations really are: GPU memory with CUDA; host memory on a CPU build,
        # whose device tier only emulates a GPU's budget for chunks.
        self._non_model_tier = T.DEVICE if self.device.type == "cuda" else T.HOST
        self._warmup_forward_failed = False  # Note [A forward that raised during warm-up]
        # A failure from here on gives a built module its weights back (Note [A built module
        # given back when initialize() fails] in init_context.py).
        with self._giving_back_on_failure(model_func):
            # Note [loss.backward()] in backward_pass.py
            self._backward = BackwardPass(self.guard, self.dp, self.precision,
                                          _weakly(self._release_after_backward),
                                          _weakly(self._count_micro_step),
                                          _weakly(self._before_new_gradients))
            # Note [The running sum in a user's gradient hook]: (sum, its version, the
            # backward's own gradient) of each parameter whose user hooks run now
            self._summed_grads: dict[int, tuple] = {}
            for index, param in enumerate(self.params.params):
                if param.requires_grad:
                    self._backward.register_grad_hook(param, self._make_grad_hook(index),
                                                      functools.partial(
                                                          _weakly(self._make_sum_hook), index))
            self._output_scale = None
            if self.precision == "fp16":  # Note [fp16 loss.backward() scales at the engine's
                self._output_scale = OutputLossScale(  # outputs] in output_loss_scale.py
                    self.params.params, self.loss_scaler, self._backward.in_model_backward)
                self._backward.scaled_at_output = self._output_scale.scaled
            self._views = SavedParameterViews(  # Note [Saved views of parameters]
                self._slots, self.params.params, self.activations,
                _weakly(self._backward.join_autograd_backward))
            self._hooks = ModuleHooks([m for m, owned in self._module_params.items() if owned],
                                      _weakly(self._access_module), _weakly(self._release_module),
                                      _weakly(self._tick), _weakly(self._own_output),
                                      _weakly(self._saved_tensor_hooks))
            with self.real_shapes():  # a callable sees p.shape / p.dim() as the model has them
                groups = build_param_groups(self.module, param_groups, config.optimizer)
            self.profiler = None
            self.optimizer = PatrickStarOptimizer(
                self.params, groups, config, self.dp, self.guard, self.loss_scaler, self.device,
                self.runtime.has_nvme, _weakly(self.end_iteration),
                _profiler_phase(weakref.ref(self)),
                self._slots.wait_for_gradient_stores, self._loop.before_optimizer_step,
                self._loop.after_optimizer_step,
                _weakly(self._backward.settle_raised_autograd_backward),
                _weakly(self.end_iteration_without_step))
            self._loop.attach(self.optimizer, _weakly(self._count_step_without_gradients))
            if config.scheduler is not None:  # DeepSpeed's `scheduler` section
                self._loop.lr_schedule.set(build_scheduler(
                    config.scheduler.type, config.scheduler.params, self.optimizer),
                    configured=True)
        self.profiler = profiler_from_config(self)  # None unless config profile.enabled
        upstream_profiler.engine_built(self)  # `from patrickstar.profiler import profiler`
        self.created_ns = time.monotonic_ns()
        global_timer.watch(self)  # upstream's data_move_cnter reports this engine's traffic
        clip_grad.install()  # torch.nn.utils.clip_grad_norm_(model.parameters(), ...) works
        script_collectives.install()  # Note [The script's own collectives]
        torch_optimizers.install()  # a torch optimizer over these parameters raises at step()
        module_zero_grad.install()  # model.module.zero_grad() drops the chunked gradients
        backward_pre_hooks.install()  # a user's full backward pre-hook runs after the access
        hooks.install()  # so does a user's global forward pre-hook (Note [Global module hooks])
        resting_params.install()  # module.half() on a submodule is named at the next use
        convert_parameters.install()  # parameters_to_vector reads the chunks' values
        averaged_model.install()  # AveragedModel.update_parameters(model) reads them too
        parametrizations.install()  # weight_norm(...) after initialize() names model_func
        ddp_wrapping.install(PatrickStarEngine)  # DDP(model.module) names the engine
        replaced_params.install()  # Note [Replacing a parameter after initialize()]
        added_params.install()  # Note [Parameters added after initialize()]
        shared_memory.install()  # model.share_memory() names what shares the weights
        pruning.install()  # Note [Pruning an engine's parameters]
        refuse_scripting(self.module)  # Note [Scripting the engine's module]
        hooked = [m for m, owned in self._module_params.items() if owned]
        # Note [The user's module's state dict]
        self._state_hooks = ModuleStateHooks(hooked, self, self.module)
        # Note [Saved views of parameters]: forwards that bypass model(...); an encoder that
        # generate() calls alone too (Note [An encoder called alone] in synced_generate.py).
        self._call_hooks = CallHooks(modules_called_alone(self.module),
                                     _weakly(self._enter_direct_call),
                                     _weakly(self._leave_direct_call))
        hook_sets = (self._hooks, self._state_hooks, self._call_hooks)
        if self.dp.enabled:  # Note [Renormalizing embeddings]
            self._renorms = RenormAcrossRanks(self.module, self.dp.group)
            hook_sets += (self._renorms,)
            self.dp.forwards_have_collectives = bool(self._renorms.hook_ids)
        self._sync_norms = ddp_methods.sync_batch_norms(self.module)
        self._methods = ModuleMethods(self.module, self)  # Note [Methods of the user's modules]
        # Every module: each carries at least the state dict's call agreement hook.
        self._copies = ModuleCopies(  # Note [Copies of the user's module]
            list(self.module.modules()), self,
            lambda: set().union(*(h.hook_ids for h in hook_sets)))
        param_owners.register_engine(self, self.params.params)
        added_params.register_modules(self, self)  # Note [Parameters added after initialize()]
        _live_engines.add(self)
        self.rest_parameters()  # Note [Parameters at rest] in resting_params.py

    # ---- Construction --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _giving_back_on_failure(self, model_func):
        """Note [A built module given back when initialize() fails] in init_context.py: every
        weight is in the chunks here, so a failure reads them back into a built module's
        parameters (single process only: under data parallelism each rank holds a shard) and
        destroys the engine before the error goes on."""
        try:
            yield
        except BaseException:
            if isinstance(model_func, BuiltModule) and not self.dp.enabled:
                try:
                    values = [(param, self.params.read(index, _C.ChunkKind.MASTER_PARAM
                                                       if ids.master is not None
                                                       else _C.ChunkKind.COMPUTE_PARAM))
                              for index, (param, ids) in enumerate(zip(self.params.params,
                                                                       self.params.ids))]
                    if "_backward" in self.__dict__:
                        self._backward.remove_grad_hooks()
                    self.destroy()
                except Exception:  # noqa: BLE001 (the first error is the one to see)
                    pass  # the module keeps its placeholders; initialize() notes so
                else:
                    model_func.give_back(values)
            raise

    def _build_runtime(self, specs, pins) -> None:
        # Note [Chunks no larger than the model] in config.py
        self.ps_config = config = dataclasses.replace(
            self.ps_config, default_chunk_size=fitted_chunk_size(
                self.ps_config.default_chunk_size, sum(math.prod(spec.shape) for spec in specs)))
        self.runtime = ChunkRuntime(config, self.local_rank, self.dp.world_size, self.dp.rank)
        self.device = self.runtime.device
        self.tiers = self.runtime.tiers
        self.copy_engine = self.runtime.copy_engine
        self.chunks = self.runtime.chunks
        self.params = ChunkedParams(self.chunks, specs, self.precision,
                                    config.gradient_accumulation_steps, config.default_chunk_size,
                                    self.dp.compute_registration_order(specs),
                                    state_dtype=config.optimizer.state_dtype,
                                    master_weights=config.bf16_master_weights)
        self.grad_dtype = self.params.grad_dtype
        self.layout = self.params.layout
        check_budgets(config, self.chunks.layout_json(), [spec.name for spec in specs],
                      [spec.requires_grad for spec in specs], pins,
                      device_is_host_memory=self.device.type == "cpu")

    def _init_storage_ids(self, index: int) -> int | None:
        ids = self.params.ids[index]
        if ids.master is not None and not self.dp.owns(self.chunks.manager, ids.master):
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

    def _take_replaced_data(self, params: list[nn.Parameter]) -> dict[int, str]:
        """A parameter whose `.data` model_func replaced after its placement (Note [Parameters
        resized while building]) has its final data copied into its slot. Returns the memory
        formats other than the contiguous one such data had (index -> name: Note [Memory
        formats of parameters])."""
        formats = {}
        with torch.no_grad():
            for index, param in enumerate(params):
                given = self._init_views[index]
                if not isinstance(given, torch.Tensor):
                    given = self._init_residency.view_of(index)
                if given is None:  # deferred: its .data is the residency's placeholder
                    continue
                if param.data_ptr() != given.data_ptr() or param.shape != given.shape:
                    kind = format_name(param.data)
                    if kind is not None:
                        formats[index] = kind
                    given.copy_(param.data)
                    param.data = given
        return formats

    def _finish_init(self) -> None:
        self._init_residency.finish()
        # Parameters released early while the model was built (Note [Initialization under a host
        # budget]); 0 when every slot fit on the host.
        self.init_deferrals = self._init_residency.deferrals
        if self.mixed:  # in fp32 the slots written at init are the compute chunks themselves
            self._compute_from_masters()
        del self._init_views, self._init_residency

    # Note [Frozen parameters in 16 bits]
    # A frozen parameter has no fp32 master, so in fp16/bf16 its init slot is the 16-bit compute
    # chunk itself, and the module's own initialization writes there. Keeping an fp32 temporary
    # per frozen parameter until the model is built would cost a full fp32 copy of a frozen base
    # model (LoRA), whose values are then loaded from a checkpoint anyway. torch.nn.init's
    # initializers still run in fp32, one call at a time (Note [Initializers in the built dtype]
    # in wide_init.py), so the values are the fp32-built model's cast to 16 bits, as for every
    # other parameter (before, torch's 16-bit `uniform_` differed at rounding edges, and
    # `orthogonal_` had no 16-bit kernel).
    def _compute_from_masters(self) -> None:
        """Writes each parameter's 16-bit compute copy from the fp32 values built at init."""
        with torch.no_grad():
            for index, tensor_id in sorted(self._init_views.items(), key=lambda item: item[0]):
                ids = self.params.ids[index]
                # One parameter at a time, so the host needs room for two chunks, not the model.
                if isinstance(tensor_id, torch.Tensor):
                    master = tensor_id
                elif tensor_id == ids.compute:  # Note [Frozen parameters in 16 bits]
                    continue
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

    @contextlib.contextmanager
    def real_shapes(self):
        """Between uses parameters hold empty placeholders (Note [Parameter data swapping]);
        inside this block each holds a stand-in of its real shape and dtype instead (one
        element broadcast, no memory), for code that looks at shapes: a param_groups callable
        (nanoGPT's `p.dim() >= 2` decay rule)."""
        released = [index for index in range(len(self.params.params))
                    if self._slots.access_count(index) == 0]  # in use: the real data already
        with self._awake():
            try:
                for index in released:
                    self.params.params[index].data = torch.zeros(
                        (), dtype=self.compute_dtype, device=self.device).expand(
                            self.params.shapes[index])
                yield
            finally:
                self.restore_placeholders(released)

    # ---- Access and release --------------------------------------------------------------------

    def _parameters_used_by(self, module: nn.Module) -> list[int]:
        """Its own parameters and those registered on it (Note [External parameters])."""
        # (A parameter without elements stays outside the chunks: init_context.plan_parameters.)
        indices = [index for index in map(self.params.index_of, module.parameters(recurse=False))
                   if index is not None]
        for param in external_parameters(module):
            index = self.params.index_of(param)
            if index is None:
                if self._parameter_without_elements(param) is not None:
                    continue  # the model's own, outside the chunks: nothing to access
                raise unknown_external_parameter(module, param, self.module)
            if index not in indices:
                indices.append(index)
        return indices

    # Note [Recomputed forwards]
    # Activation checkpointing (torch.utils.checkpoint, Hugging Face's
    # gradient_checkpointing_enable) runs a block's forward again inside the backward, and the
    # tensors that recomputation saves are raw views of the chunk memory of that moment: the
    # reentrant kind recomputes outside the engine's saved_tensors_hooks, the non-reentrant kind
    # under torch's own hooks, which keep what they are given. Released at the post-forward hook
    # as in a forward, the chunk could move before the block's backward read those views (under a
    # device budget: wrong gradients with the reentrant kind, which then trained silently away
    # from PyTorch). The non-reentrant kind also stops the recomputation right after the last
    # tensor it needs, inside a module, whose post-forward hook then never ran and whose access
    # was never given back (under a budget: "chunks in use ... pinned", out of memory). So a
    # forward run inside a backward holds its access until that module's own backward ends
    # (one hold per post-backward hook, for a module called twice) or the backward ends.
    def _access_module(self, module: nn.Module, phase: str) -> None:
        indices = self._module_params.get(module)
        if indices:
            # Note [Module forwards in a forked child] in guards.py
            self.guard.check_owner_process(f"a forward of {type(module).__name__}")
            self.wake_parameters()  # (nothing to do when awake)
            if self._summoned:
                self._refuse_forward_while_summoned(module)
            self._backward.join_autograd_backward()
            try:
                self._slots.access(indices)
            except _C.ChunkOutOfMemoryError as error:
                self._note_backward_exhaustion(error, phase == "fwd" and _recomputing())
                raise
            if phase == "fwd" and _recomputing():
                self._recompute_holds[module] = self._recompute_holds.get(module, 0) + 1

    def _note_backward_exhaustion(self, error: BaseException, recomputing: bool) -> None:
        """Note [A backward past what initialize() counted] in backward_pins.py."""
        if self._backward.in_backward:
            note_device_exhausted_in_backward(error, self.ps_config.memory.device_budget,
                                              recomputing or bool(self._recompute_holds))

    def _release_module(self, module: nn.Module, phase: str) -> None:
        indices = self._module_params.get(module)
        if not indices:
            return
        if phase == "fwd":
            if not _recomputing():  # else held until the module's backward: Note [Recomputed...]
                self._slots.release(indices, S.HOLD_AFTER_FWD)
                if not self._in_forward and not self._views.in_direct_call() and \
                        not self._backward.in_backward:
                    # A submodule called alone (`model.module.wte(ids)`): its access woke every
                    # parameter, and nothing else would rest them (Note [Parameters at rest]).
                    self._rest_after_forward(module.training)
            return
        holds = self._recompute_holds.get(module, 0)
        if holds:
            if holds == 1:
                del self._recompute_holds[module]
            else:
                self._recompute_holds[module] = holds - 1
            indices = indices * 2
        self._slots.release(indices, S.HOLD_AFTER_BWD)

    def order_backward_pre_hooks(self, module: nn.Module) -> None:
        """A full backward pre-hook was registered on `module`: the engine's access goes first
        (Note [User full backward pre-hooks] in hooks.py)."""
        self._hooks.put_first_in_backward(module)

    def _own_output(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._views.own_output(tensor)  # Note [Outputs that are parameters]

    def _release_all(self, state) -> None:
        # Each part runs whatever the one before raised: a signal handled as end_backward()
        # returned left every access held, in COMPUTE, and each later save, zero_grad() and
        # load_checkpoint() failed "illegal state transition COMPUTE -> COMPUTE".
        try:
            self._recompute_holds.clear()
            self._hooks.end_backward()
        finally:
            try:
                self._slots.release_all(state)
            finally:
                self.rest_parameters()

    # Note [Parameters at rest] in resting_params.py
    @property
    def parameters_at_rest(self) -> bool:
        """Whether the parameters not in use have a resting class now (ParameterAtRest, or
        ParameterInFlight between a forward and its backward)."""
        return self._resting is not None

    # Note [Class changes cut short]
    # rest_parameters() and wake_parameters() change every parameter's class in a Python loop,
    # at least once a step, and a signal handler (Ctrl-C, a job scheduler's SIGTERM handler
    # that raises) runs at whatever bytecode is next: one landing inside the loop left some
    # parameters resting and others not while `_resting` still told the state before the
    # loop. A forward then skipped the wake, and the first resting parameter it used read its
    # value out of the chunk it was accessing ("illegal state transition COMPUTE -> COMPUTE"
    # at every later forward; load_checkpoint() did not help; found interrupting a step at
    # every few lines), and parameters left awake at rest read as their empty placeholders.
    # So the loop a signal cut short is finished before the signal's exception goes on, and
    # `_resting_changing` stays set if even that is cut short: the next rest or wake then goes
    # over every parameter again, whatever `_resting` says.
    def rest_parameters(self, kind: type = resting_params.ParameterAtRest) -> None:
        """Parameters not in use answer user code with their chunks' values."""
        if self._resting is not kind or self._resting_changing:
            params = [self.params.params[index] for index in range(len(self.params.params))
                      if self._slots.access_count(index) == 0]
            self._change_classes(lambda: resting_params.rest(params, kind), kind)

    def wake_parameters(self) -> None:
        """The parameters' own class back, before an access or a lending."""
        if self._resting is not None or self._resting_changing:
            self._change_classes(lambda: resting_params.wake(self.params.params), None)

    def _change_classes(self, change: Callable[[], None], resting: type | None) -> None:
        """Note [Class changes cut short]."""
        self._resting_changing = True
        try:
            change()
        except BaseException:
            change()  # the rest of the loop, then the signal's exception
            self._resting, self._resting_changing = resting, False
            raise
        self._resting, self._resting_changing = resting, False

    @contextlib.contextmanager
    def _awake(self):
        resting = self._resting
        self.wake_parameters()
        try:
            yield
        finally:
            if resting is not None:
                self.rest_parameters(resting)

    def _tick(self, event: str) -> None:
        if self.profiler is not None:
            self.profiler.on_tick(event)
        non_model = self.non_model_bytes()
        try:
            self.chunks.tick(self._non_model_tier, non_model)
        except _C.ChunkOutOfMemoryError as error:
            # The manager names its tier, not the config key, and knows nothing of batches. Only
            # when the tier out of room is the one holding the non-model data: an NVMe tier
            # without room for a chunk evicted from the host is not the activations' doing.
            message = str(error)
            if f"({self._non_model_tier}): budget" not in message and \
                    f"({self._non_model_tier}) cannot take" not in message:
                raise
            key = "memory.device_budget" if self._non_model_tier == T.DEVICE \
                else "memory.host_budget"
            budget = getattr(self.ps_config.memory, key.rpartition(".")[2])
            nvme = "" if self.ps_config.memory.nvme.path is not None else \
                ", or add an NVMe tier (memory.nvme.path) for chunks to leave to"
            error.add_note(
                f"At this moment ({event}) the engine had {non_model} bytes "
                f"({non_model / 2**20:.2f} MiB) of non-model data (activations and temporaries) "
                f"on the {self._non_model_tier} tier, which shares config key '{key}' "
                f"(= {budget if budget is not None else 'unset'}) with chunks: raise it, use a "
                f"smaller batch or activation checkpointing{nvme}.")
            raise

    def non_model_bytes(self) -> int:
        """Non-model data now: Note [Measured non-model data] in activations.py."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.activations.bytes

    @property
    def non_model_tier(self) -> str:
        """The kind of tier (`Tier.DEVICE` or `Tier.HOST`) whose memory non_model_bytes() is in
        and whose budget the manager plans it against: host memory on a CPU build."""
        return self._non_model_tier

    # ---- Forward / backward --------------------------------------------------------------------

    # The hooks reach these through weak references (Note [Engine lifetime]); the views object
    # owns the work (Note [Saved views of parameters] in saved_views.py).
    def _saved_tensor_hooks(self):
        return self._views.hooks()

    # Note [Forwards of the module itself]
    # `model.module(x)`, nanoGPT's `raw_model.generate()` and DeepSpeed's `model.generate()`
    # (whose forwards call the module itself) bypass forward(). With one rank only the saved
    # views needed handling (Note [Saved views of parameters]); under data parallelism
    # forward() also agrees on the call between the ranks and runs the forward's gather
    # schedule (dp.before_forward / after_forward), without which an owner read its own chunk
    # without gathering while the other rank gathered: a hang, or "in use (COMPUTE) when its
    # group's collective starts". So an outermost call of the module that did not come through
    # forward() does what forward() does around it. A submodule called alone is not covered,
    # but for the encoder generate() calls (Note [An encoder called alone] in
    # synced_generate.py).
    def _syncs_norms(self) -> bool:
        """Note [SyncBatchNorm in a forward on one rank] in ddp_methods.py."""
        return any(m.training for m in self._sync_norms)

    def _enter_direct_call(self) -> None:
        refuse_traced_call("model.module(...)")  # Note [Tracing the engine's module]
        added_params.refuse_unfrozen(self)  # Note [Parameters added after initialize()]
        outermost = not self._in_forward and not self._views.in_direct_call()
        self.wake_parameters()
        self._views.enter_direct_call()
        backward_follows = torch.is_grad_enabled() and self.module.training
        if not self._in_forward and self._direct_forward is None and self.dp.enabled:
            self.dp.before_forward(backward_follows, self.module.buffers(),
                                   self._syncs_norms())
            self._direct_forward = backward_follows
        elif outermost and not self.dp.enabled:
            # Note [Calls on one rank of a model replica] in model_group_calls.py
            self.dp.agree_on_model_group(self.dp.forward_kind(backward_follows,
                                                              self._syncs_norms()))

    def _leave_direct_call(self, raised: bool = False) -> None:
        self._views.leave_direct_call()
        outermost = not self._in_forward and not self._views.in_direct_call()
        if raised and outermost:
            self._release_raised_forward()  # for `model.module(x)`; forward() does it otherwise
        if self._direct_forward is not None and not self._views.in_direct_call():
            backward_follows, self._direct_forward = self._direct_forward, None
            if not backward_follows:
                self._release_all(S.HOLD_AFTER_FWD)
            self.dp.after_forward()
        if outermost and not raised:
            # The parameters rest again as after forward() (Note [Parameters at rest] in
            # resting_params.py): left plain, a read after `model.module(x)` or a generate()
            # (numel(), norm(), the detach() recipe of torch.func) saw the empty placeholders.
            self._rest_after_forward(self.module.training)

    def _rest_after_forward(self, training: bool) -> None:
        """After a forward that did not come through forward(): as _leave_forward rests them."""
        self.rest_parameters(resting_params.ParameterInFlight
                             if torch.is_grad_enabled() and training
                             else resting_params.ParameterAtRest)

    # Note [Moving the engine]
    # Parameters live in chunks of the compute dtype, placed by the chunk manager; buffers
    # (BatchNorm statistics, Hugging Face's position ids) are the module's own tensors, which
    # model_func built on the CPU, and follow the engine's device. `model.to(...)`, `.cuda()`,
    # `.half()`, ... therefore convert buffers only, and a conversion that would change where or
    # in which dtype the parameters compute is an error naming the config key that does it,
    # instead of silently leaving the parameters as they are.
    def _move_buffers(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = convert(buffer)

    # Note [Buffers of 16-bit modules]
    # In fp16/bf16 a module's parameters compute in 16 bits, but its buffers were left as
    # model_func built them, fp32: a BatchNorm then met bf16 weights beside fp32 running
    # statistics, which torch's batch_norm refuses ("expected scalar type BFloat16 but found
    # Float", with the engine's hint to cast inputs that were cast already), so a ResNet could
    # not train in bf16 at all. DeepSpeed converts the whole module (`module.bfloat16()`,
    # buffers included), as a plain PyTorch 16-bit model has it; here the floating-point
    # buffers are converted the same way, but for two kinds of module without parameters whose
    # fp32 buffers meet 16-bit inputs safely and are kept for their precision:
    # - torch's normalization layers without affine parameters (BatchNorm, InstanceNorm with
    #   affine=False): batch_norm takes fp32 statistics beside 16-bit inputs and returns the
    #   inputs' dtype;
    # - Hugging Face's rotary embeddings (recognized by class name, as Hugging Face's own
    #   _init_weights recognizes them), whose forwards upcast inv_freq and cast their cos/sin to
    #   the inputs' dtype: a bf16 inv_freq would shift the angles of far positions.
    # Other modules without parameters compute with their buffers as with weights, and fp32
    # ones promoted the activations: DETR's frozen BatchNorm (`x * weight *
    # rsqrt(running_var) + ...`) made the next convolution raise "Input type
    # (torch.FloatTensor) and weight type (CPUBFloat16Type) should be the same", XGLM's and
    # M2M100's sinusoidal positions (a non-persistent buffer) the next LayerNorm "mixed dtype
    # (CPU): expect parameter to have scalar type of Float", and BART's final_logits_bias (on
    # the model class, which owns no parameter itself) made its logits fp32, twice the bytes of
    # PyTorch's. Integer buffers (num_batches_tracked, position ids) keep their dtype.
    def _buffers_to_compute_dtype(self) -> None:
        for module in self.module.modules():
            if not any(p is not None for p in module._parameters.values()) and (
                    isinstance(module, torch.nn.modules.batchnorm._NormBase)
                    or "RotaryEmbedding" in type(module).__name__):
                continue
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(self.compute_dtype)

    # Note [Parameters without elements follow the compute dtype]
    # A parameter without elements stays a plain parameter of the module, outside the chunks
    # (init_context.plan_parameters): it holds no memory and no optimizer state. It kept the
    # dtype and device model_func gave it, so in fp16/bf16 it stayed fp32 beside 16-bit weights:
    # a prefix of no virtual tokens (`torch.cat([prefix.expand(b, 0, d), embeddings], 1)`)
    # promoted the activations to fp32 and the next Linear raised "mat1 and mat2 must have the
    # same dtype", where `model.bfloat16()` in PyTorch (and DeepSpeed's, which converts the
    # whole module) trains; `model.state_dict()` and a consolidated `--dtype bf16` file held it
    # as the only fp32 weight. Like every chunked parameter it takes the compute dtype (a model
    # built in another 16-bit dtype included: Note [A model built in another 16-bit dtype]) and
    # the engine's device.
    def _empty_parameters_to_compute_dtype(self) -> None:
        with torch.no_grad():
            for module in self.module.modules():
                for param in module._parameters.values():
                    if param is not None and self.params.index_of(param) is None and \
                            param.numel() == 0 and param.is_floating_point():
                        param.data = param.data.to(dtype=self.compute_dtype, device=self.device)

    def _apply(self, fn, recurse=True):
        if "module" not in self._modules:  # nn.Module.__init__ and the hooks of a partial build
            return super()._apply(fn, recurse)
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.device))
        if probe.dtype != self.compute_dtype:
            raise ValueError(
                f"PatrickStarEngine: parameters compute in {self.compute_dtype} (config "
                f"precision '{self.precision}') in chunks; converting the model to {probe.dtype} "
                f"(model.half(), .float(), .double(), .bfloat16(), .to(dtype)) cannot change "
                f"that: nothing was converted. Set config 'fp16.enabled' or 'bf16.enabled' "
                f"instead, or leave the conversion out (Hugging Face's Trainer converts for "
                f"TrainingArguments fp16_full_eval / bf16_full_eval: leave those out); for a "
                f"converted copy of the weights, convert model.state_dict() or "
                f"copy.deepcopy(model.module)")
        if probe.device != self.device:
            raise ValueError(
                f"PatrickStarEngine: parameters live in chunks placed by the runtime for "
                f"{self.device} (LOCAL_RANK / local_rank chooses the GPU); moving the model to "
                f"{probe.device} (model.to(device), .cuda(), .cpu()) cannot move them. Leave "
                f"the move out: the engine's buffers and parameters are already on its device")
        self._move_buffers(fn)
        return self

    def __deepcopy__(self, memo):
        """A copy of the user's module with the current weights (Note [Copies of the user's
        module]): a plain nn.Module, not a second engine."""
        return copy.deepcopy(self.module, memo)

    def __prepare_scriptable__(self):
        refuse_script_call("model")  # Note [Scripting the engine's module] in traced_calls.py

    @staticmethod
    def _refuse_copy(call: str):
        raise TypeError(f"a PatrickStarEngine cannot be pickled or shallow-copied ({call}): its "
                        f"parameters and optimizer state live in chunks of its runtime. Save "
                        f"model.state_dict(), torch.save(model.module) (the plain module with "
                        f"its current weights), copy.deepcopy(model) (the same as a plain "
                        f"module) or model.save_checkpoint(dir) (the whole training state)")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("torch.save(model) or pickle.dumps(model)")

    def __copy__(self):
        self._refuse_copy("copy.copy(model)")

    # Note [The engine answers to its module's name]
    # Hugging Face's Trainer decides how to smooth labels (label_smoothing_factor) from the name
    # of the model it trains: `accelerator.unwrap_model(model)._get_name()` in compute_loss, and
    # a name among the causal LMs (LlamaForCausalLM, GPT2LMHeadModel, ...) shifts the labels by
    # one token first. accelerate unwraps DDP, FSDP and DeepSpeed's engine, not this one, so the
    # name read was 'PatrickStarEngine': a causal LM's smoothed loss compared each token's
    # logits with its own label instead of the next one, and training and evaluate() reported
    # other losses than the plain model's, without a word. nn.Module uses _get_name() only to
    # print, so the engine answers with its module's name there (as a DDP-wrapped model is
    # unwrapped to it) and keeps its own in repr().
    def _get_name(self) -> str:
        module = self.__dict__.get("_modules", {}).get("module")
        return super()._get_name() if module is None else module._get_name()

    def __repr__(self) -> str:
        return type(self).__name__ + super().__repr__()[len(self._get_name()):]

    def __getattr__(self, name: str):
        """Attributes of the user's module (`model.generate(...)`, `model.get_input_embeddings()`)
        on the engine, as DeepSpeed's engine offers them; the engine's own come first."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                value = getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither 'PatrickStarEngine' nor its module "
                                     f"'{type(module).__name__}' has an attribute '{name}'"
                                     ) from None
            if name == "generate" and callable(value) and self.dp.enabled:
                # Note [Generating on every rank], Note [Generating on one rank]
                return synced_generate(value, self.dp.generates_alone)
            return value  # Note [Methods of the user's modules]: its own shadows

    @property
    def _is_accelerate_prepared(self) -> bool:
        """True: Note [The engine is prepared for accelerate]. accelerate's prepare_model reads
        it first, which compares its mixed_precision with the engine's once (Note
        [accelerate's mixed precision on the engine] in accelerate_precision.py)."""
        if not self.__dict__.get("_accelerate_precision_checked", True):
            self._accelerate_precision_checked = accelerate_precision.warn(
                sys._getframe(1), self.precision)
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value) -> None:
        pass  # accelerate marks what prepare() returns; the engine always is prepared

    @property
    def config(self) -> ModuleConfigView:
        """PatrickStar's config, then the user's module's `config` (Hugging Face's): reads and
        writes of `model.config.use_cache` or `.vocab_size` reach the module's, as they would
        without the engine (Note in module_config_view.py)."""
        module = self.__dict__.get("_modules", {}).get("module")
        return ModuleConfigView(self.ps_config, getattr(module, "config", None))

    def forward(self, *args, **kwargs):
        if self.device.type != "cpu":  # Note [Inputs to the engine's device] in input_cast.py
            args, kwargs = inputs_to_device((args, kwargs), self.device)
        fp16 = self.ps_config.fp16
        if fp16.enabled and fp16.auto_cast:  # Note [fp16 auto_cast] in input_cast.py
            args, kwargs = cast_floating_inputs((args, kwargs), torch.float16)
        self._begin_forward()
        completed = False
        earlier = self.activations.bytes  # Note [Activations of earlier graphs]
        try:
            with self._views.hooks():
                output = self.module(*args, **kwargs)
            if self._output_scale is not None and torch.is_grad_enabled():
                output = self._output_scale.wrap_outputs(output)
            completed = True
        except Exception as error:  # Note [Naming an unregistered read] in external_params.py
            hint = (unregistered_read_note(error, self.module, self._holds_placeholder)
                    or external_parameter_hint(error, self.compute_dtype)
                    or self._earlier_graphs_note(error, earlier))
            if hint is not None:
                error.add_note(hint)
            raise
        finally:
            self._leave_forward(completed)
            if not completed and self.chunks.warming_up and self.guard.backwards == 0:
                self._warmup_forward_failed = True
        self._end_forward()
        return output

    # Note [Activations of earlier graphs]
    # A loss or output kept from a forward whose backward never ran (a step interrupted by
    # Ctrl-C or an error, a notebook cell that failed after its forward) keeps the activations
    # autograd saved for it, and they count as non-model data on the tier the budget shares with
    # chunks. Under a tight budget the next forward then failed with "tier 'host' (host) cannot
    # take 16384 bytes: budget 65536 bytes, non-model data 40960 bytes, ... nothing left to
    # evict", and every retry failed the same way, since the failed forward never replaced the
    # variable holding the old graph. In plain PyTorch the same loop just uses that much more
    # memory. Where non-model data was already alive when the forward began, its error says so.
    def _earlier_graphs_note(self, error: Exception, earlier: int) -> str | None:
        # (On CUDA non_model_bytes() is all that torch's allocator holds, inputs and all, not
        # what graphs saved: no such reading there.)
        if not isinstance(error, _C.ChunkOutOfMemoryError) or earlier <= 0 or \
                self.device.type == "cuda" or \
                f"({self._non_model_tier}) cannot take" not in str(error):
            return None
        return (f"PatrickStar: {earlier} bytes ({earlier / 2**20:.2f} MiB) of the non-model data "
                f"were already alive when this forward began: activations saved for the "
                f"backward of earlier forwards whose graphs are still referenced (a loss or "
                f"output kept from a step that raised or was interrupted before its backward, or "
                f"a caught exception of a failed forward, whose traceback holds its tensors). "
                f"Drop them (`del loss` or `loss = None`) if no backward will run through "
                f"them.")

    # Note [A forward that raised during warm-up]
    # The warm-up iteration's moments are the trace every later iteration replays (Note
    # [Moments and the warm-up trace] in chunk/memory_tracer.h), non-model peaks included. A
    # first forward that raised partway (a batch too large for the host budget, a shape error)
    # left its moments in that trace: the retry's moments came after them, and its step froze
    # a trace whose moment 1 held the failed batch's activations, so the second iteration of
    # a batch that fits raised "moment 1: ... non-model data 1.00 MiB" against a 512 KiB
    # budget. The next forward starts the warm-up again instead, once the non-model data of now
    # (the failed graph is gone unless its exception is still held) is what the manager knows.
    # Only before the step's first backward: a later micro-step's failure keeps the earlier
    # micro-steps' trace.
    def _restart_warmup_after_failed_forward(self) -> None:
        if not self._warmup_forward_failed:
            return
        self._warmup_forward_failed = False
        if self.chunks.warming_up and self.guard.backwards == 0:
            self.chunks.report_non_model_data(self._non_model_tier, self.non_model_bytes())
            self.chunks.restart_warmup()

    # The engine's bookkeeping around the module's forward runs eagerly under torch.compile
    # (Note [The engine's hooks under torch.compile] in hooks.py); the module's forward compiles.
    @torch.compiler.disable
    def _begin_forward(self) -> None:
        self.guard.enter_call("model(...)")  # first: Note [One thread at a time]
        resting, in_forward = self._resting, self._in_forward
        try:
            self._prepare_forward()
        except BaseException:
            try:
                # A signal landing after the wake (Note [Class changes cut short]) would leave
                # the parameters awake at rest, reading as their empty placeholders.
                self._in_forward = in_forward
                if resting is not None and self.chunks is not None:  # (None: destroy())
                    self.rest_parameters(resting)
            finally:
                self.guard.leave_call()
            raise

    def _prepare_forward(self) -> None:
        self.guard.check_alive("model(...)")
        refuse_traced_call("model(...)")  # Note [Tracing the engine's module]
        added_params.refuse_unfrozen(self)  # Note [Parameters added after initialize()]
        _refuse_wrapping_data_parallel(self)
        self._backward.forget_raised_autograd_backward()
        self._restart_warmup_after_failed_forward()
        # Saved-tensor hooks that a direct call raising past its post-forward hook left entered.
        self._hooks.leave_saved_tensor_hooks()
        self._views.leave_direct_calls()
        self.dp.before_forward(torch.is_grad_enabled() and self.module.training,
                               self.module.buffers(), self._syncs_norms())
        self.wake_parameters()  # before the module's (maybe compiled) forward looks at them
        self._in_forward = True

    # Note [A forward that raised]
    # The module whose forward raised (a shape error, a bad batch) never reached its
    # post-forward hook, so its parameters stayed accessed, in COMPUTE. The next forward coped,
    # but what came first did not: state_dict() and save_checkpoint() (the `except:` of a loop
    # that saves before re-raising) failed with "illegal state transition COMPUTE -> COMPUTE",
    # and after that the next training step with "HOLD -> HOLD_AFTER_BWD". A raised forward
    # has no output, so no backward can follow it: its accesses are given back at once, as
    # after a forward without grad (modules that finished their forward were released by their
    # own hooks already and hold no access), and saved-tensor hooks it left entered are left.
    def _release_raised_forward(self) -> None:
        """Note [A forward that raised]."""
        self._hooks.leave_saved_tensor_hooks()
        self._slots.release_all(S.HOLD_AFTER_FWD)
        self.rest_parameters()

    @torch.compiler.disable
    def _leave_forward(self, completed: bool = True) -> None:
        try:
            self._in_forward = False
            if not completed:
                self._release_raised_forward()
            elif not torch.is_grad_enabled() or not self.module.training:
                # No backward follows: give everything back now.
                self._release_all(S.HOLD_AFTER_FWD)
            else:  # Note [Parameters between a forward and its backward] in resting_params.py
                self.rest_parameters(resting_params.ParameterInFlight)
        finally:
            self.guard.leave_call()

    @torch.compiler.disable
    def _end_forward(self) -> None:
        self.dp.after_forward()

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True,
                 release_loss: bool = False, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's signature (upstream PatrickStar's is its first three arguments), so a
        positional `model.backward(loss, True)` means what it meant there.

        `retain_graph` as torch's and DeepSpeed's: keep the graph for another backward
        through it (two losses of one forward, each its own backward call). `scale_wrt_gas`
        False leaves the loss undivided by gradient_accumulation_steps (the script divides it,
        as DeepSpeed's). `allreduce_gradients` and `release_loss` are ignored, as upstream's
        and DeepSpeed's: gradients are averaged over data-parallel ranks in any case.

        Returns the loss divided by gradient_accumulation_steps (undivided with `scale_wrt_gas`
        False), as DeepSpeed's does (`loss = model.backward(loss)` scripts log it); before,
        None."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else f"a {type(loss).__name__}")
            raise ValueError(f"model.backward(loss) expects a scalar loss tensor, got {got}: "
                             f"reduce per-sample losses first (loss.mean() or loss.sum()), or "
                             f"pass the tensor the forward returned (not loss.item())")
        result = loss / self.ps_config.gradient_accumulation_steps if scale_wrt_gas else loss
        if not allreduce_gradients:
            warnings.warn("model.backward(allreduce_gradients=False) is ignored, as in upstream "
                          "PatrickStar and DeepSpeed: the gradients are still averaged over "
                          "data-parallel ranks", stacklevel=2)
        with self.guard.calling("model.backward()"):  # Note [One thread at a time]
            agree = self.dp.ranks_with if self.dp.enabled else None
            # Note [Calls between a read and its serving] in data_parallel.py
            self.dp.agree_on_training_call(self.dp.BACKWARD)
            if not self.guard.before_backward(loss, self.precision, agree):
                return result
            scale = self.loss_scaler.scale
            if scale_wrt_gas:
                scale /= self.ps_config.gradient_accumulation_steps
            self._backward.run([loss.float() * scale], None, retain_graph)
        return result

    def backward_from(self, tensors, grads) -> None:
        """Backward from non-scalar `tensors` given their gradients: a pipeline stage other
        than the last (pipe/engine.py), whose received gradients already carry the loss scale
        and 1/gradient_accumulation_steps. Counts as one `backward()` call."""
        if not self.guard.before_backward(torch.zeros(()), self.precision):
            return
        self._backward.run(tensors, grads)

    def _release_after_backward(self) -> None:
        self._release_all(S.HOLD_AFTER_BWD)

    def _before_new_gradients(self) -> None:
        """A backward starts: a clip waiting for the step applies first (Note [A clip before
        the step] in optimizer.py); sums a raised backward left unstored are forgotten (Note
        [The running sum in a user's gradient hook] in backward_pass.py), and zeros set by hand
        are held as zero_grad(set_to_none=False) holds them."""
        self._summed_grads.clear()
        self.optimizer.hold_zeros_set_by_hand()  # Note [Zeros set by hand before the first step]
        self.optimizer.apply_pending_clip()

    def _count_micro_step(self) -> None:
        """The end of a counted backward."""
        self.micro_step += 1
        self._tick("post_backward")  # Note [A moment after the backward]

    # Note [A moment after the backward]
    # The engine reports non-model data at its module hooks' ticks, and a tick's figure stands
    # until the next one (Note [Budgets and non-model data] in chunk_manager.h). A backward's
    # last tick is a pre-backward of the first module (its input needs no grad, so no
    # post-backward follows), taken while that module's saved input is still alive; autograd
    # frees it right after. Without a tick here the optimizer step (and a save after it) ran
    # in that moment, planning the host (on CUDA the device) against activations already gone:
    # a host budget with room for the step's state failed with "cannot take ... non-model data
    # N bytes" (N = the first layer's input), and after warm-up the traced peak of that moment
    # kept the figure even if reported again. The tick after every counted backward starts a
    # moment of its own, whose figure is the activations still alive (none, unless the graph
    # was retained).

    def _end_param_access(self, index: int) -> None:
        """Ends every access of parameter `index` (its module's backward hook then finds none to
        release). Torch runs the gradient hook once every use of the parameter in this backward
        has been differentiated, so nothing in this backward reads it any more, and data
        parallelism may release its group before the gradient lands
        (GatherSchedule.before_grad). A later read anyway (a saved view unpacked again) accesses
        it afresh, as SavedParameterViews.unpack does for a parameter no hook accessed."""
        count = self._slots.access_count(index)
        if count > 0:
            self._slots.release([index] * count, S.HOLD_AFTER_BWD)

    def _make_grad_hook(self, index: int):
        engine = weakref.ref(self)  # C++ holds the parameter too: Note [Engine lifetime]

        def hook(param: nn.Parameter) -> None:
            grad = param.grad
            param.grad = None  # its memory goes back to torch right away
            owner = engine()
            if owner is None:
                return
            # Note [The running sum in a user's gradient hook] in backward_pass.py
            summed = owner._summed_grads.pop(index, None)
            if grad is None:
                if summed is not None:  # the user's hook dropped the running sum, the chunk's
                    owner.optimizer.drop_gradients([index], set_to_none=True)  # part too
                return
            if summed is not None and grad is summed[0] and grad._version == summed[1]:
                grad, summed = summed[2], None  # unchanged: the backward's own, added as ever
            owner._backward.before_storing_grad()
            owner._backward.refuse_second_grad(index, owner.params.names[index])
            if grad.layout != torch.strided:  # where a store's shape error is raised too
                raise sparse_gradient_error(owner.params.names[index], grad)
            has_grad = owner.optimizer.has_grad
            if owner.dp.ends_param_access_at_grad:
                owner._end_param_access(index)
            owner.dp.before_grad(index)
            owner._backward.count_stored_grad(index)
            try:
                owner._slots.store_grad(index, grad, has_grad[index] and summed is None)
            except _C.ChunkOutOfMemoryError as error:
                owner._note_backward_exhaustion(error, False)
                raise
            has_grad[index] = True
            owner.dp.on_grad(index)
        return hook

    def _make_sum_hook(self, index: int):
        """The hook in front of the user's post-accumulate-grad hooks of parameter `index`: Note
        [The running sum in a user's gradient hook] in backward_pass.py."""
        engine = weakref.ref(self)

        def sum_hook(param: nn.Parameter) -> None:
            grad = param.grad
            owner = engine()
            if grad is None or owner is None or owner.dp.enabled:
                return
            if not owner.optimizer.has_grad[index] or grad.layout != torch.strided:
                return
            owner._slots.wait_for_gradient_stores()
            with owner.params.view(index, _C.ChunkKind.GRADIENT) as stored:
                summed = grad + stored.to(grad.device, grad.dtype)
            param.grad = summed
            owner._summed_grads[index] = (summed, summed._version, grad)
        return sum_hook

    # ---- Steps ---------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """FSDP's `model.clip_grad_norm_`: the gradients live in chunks, so
        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` sees none. Call it between
        `backward()` and `optimizer.step()`; returns the total gradient norm."""
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)

    def clip_grads_with_norm_(self, max_norm: float, total_norm: float) -> None:
        """`torch.nn.utils.clip_grads_with_norm_` for gradients in chunks: clips the coming
        step by `total_norm`, the caller's norm of them."""
        self.optimizer.clip_grads_with_norm_(max_norm, total_norm)

    def clip_grad_value_(self, clip_value: float, parameters=None) -> None:
        """`torch.nn.utils.clip_grad_value_` for gradients in chunks (`parameters`: some of this
        engine's, default all). Under data parallelism every rank calls it, on the reduced
        gradients (as after DDP's all-reduce): before the step's last backward it closes the
        accumulation (Note [A short accumulation] in data_parallel.py)."""
        params = list(self.params.params if parameters is None else parameters)
        indices = [self._parameter_index(param, "clip_grad_value_") for param in params]
        self.dp.close_accumulation("clip_grad_value_()")  # Note [A short accumulation]
        self.optimizer.clip_grad_value_(clip_value, indices)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def drop_gradients(self, params, set_to_none: bool = True) -> None:
        """torch's `module.zero_grad()` of a module holding `params` (Note [Module zero_grad]
        in module_zero_grad.py): all of this engine's parameters is optimizer.zero_grad(); a
        part drops that part's chunked gradients."""
        indices = {self._parameter_index(param, "zero_grad") for param in params}
        if len(indices) == len(self.params.params):
            self.optimizer.zero_grad(set_to_none)
            return
        if self.dp.enabled:
            names = [f"module.{self.params.names[i]}" for i in sorted(indices)[:3]]
            raise RuntimeError(
                f"zero_grad() of a module holding {len(indices)} of the engine's "
                f"{len(self.params.params)} parameters (e.g. {names}) under data parallelism: "
                f"each rank's gradient chunks hold reduced shards of every parameter, so a part "
                f"of them cannot be dropped. Drop all of them with optimizer.zero_grad(), or "
                f"leave the part out of the loss (torch.no_grad() or detach())")
        self.optimizer.drop_gradients(sorted(indices), set_to_none)

    def set_gradient_to_none(self, index: int) -> None:
        """`p.grad = None` on parameter `index` at rest: its gradient is dropped, so the step
        leaves it alone as torch's does (Note [p.grad = None at rest] in resting_params.py)."""
        self._refuse_one_gradient_dropped(index, "None")
        self.optimizer.drop_gradients([index], set_to_none=True)

    def set_gradient_to_zeros(self, index: int) -> bool:
        """`p.grad = torch.zeros_like(p)` on parameter `index` at rest: kept as
        zero_grad(set_to_none=False) keeps zeros, where the optimizer has state or a backward
        ran; False where neither (perhaps torch.distributed.checkpoint's state-initializing
        step: Note [Gradients set by hand at rest] in resting_params.py; Note [Zeros set by hand
        before the first step] in optimizer.py)."""
        if not len(self.optimizer.state) and not self.guard.backwards:
            # Note [Zeros set by hand before the first step] in optimizer.py
            self.optimizer.note_zeros_set_by_hand(index)
            return False
        self._refuse_one_gradient_dropped(index, "zeros")
        self.optimizer.drop_gradients([index], set_to_none=False)
        self.optimizer.hold_zero_gradient(index)
        return True

    def _refuse_one_gradient_dropped(self, index: int, value: str) -> None:
        if self.dp.enabled and self.guard.backwards:
            raise RuntimeError(
                f"p.grad = {value} on 'module.{self.params.names[index]}' after a backward under "
                f"data parallelism: each rank's gradient chunks hold reduced shards of every "
                f"parameter, so one parameter's gradient cannot be replaced. Leave it out of the "
                f"loss (torch.no_grad() or detach()) or freeze it (requires_grad_(False)) before "
                f"the forward instead")

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's accumulation idiom (`with model.no_sync(): loss.backward()` on all but the last
        micro-step): without the config key `gradient_accumulation_steps` the backward calls in
        the block reduce nothing, and the next one outside it (or the step) reduces their sum,
        as DDP's (Note [Accumulation without the key under data parallelism] in
        data_parallel.py). With the key the engine reduces at the micro-step that completes it
        by itself, so the block changes nothing; a loop with more backward calls per step than
        the key raises at the extra one."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag (nanoGPT sets it False on all but a step's last micro-step), which
        `no_sync()` clears for its block: whether a backward reduces the gradients."""
        return self.dp.sync_gradients

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.dp.sync_gradients = bool(value)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """DDP's `with model.join():` around a training loop. Every rank must run as many
        training steps in it: a rank whose inputs run out first raises on leaving the block
        and the others at their next call, at once, as DDP's join(throw_on_early_termination=
        True) (Note [DDP's join() for uneven inputs] in ddp_methods.py)."""
        return ddp_methods.join(self.dp, enable)

    def register_comm_hook(self, state, hook) -> None:
        """DDP's gradient communication hook: DDP's default (`default_hooks.allreduce_hook`) is
        what the engine does and is accepted; any other raises naming it (Note [DDP
        communication hooks] in ddp_methods.py)."""
        ddp_methods.register_comm_hook(state, hook)

    def _set_static_graph(self) -> None:
        """DDP's (the `static_graph=True` argument): the engine needs no such hint, its gather
        schedule follows the previous iterations' trace by itself."""

    def step(self, lr_kwargs: dict | None = None) -> None:
        """DeepSpeed's `engine.step()`, for loops written against it (`model.backward(loss)`
        then `model.step()` every micro-step): at the backward that completes the step's
        `gradient_accumulation_steps` it runs `optimizer.step()` (which also drops the
        gradients) and then steps `model.lr_scheduler` unless the step was skipped for fp16
        overflow (Note [model.step() steps model.lr_scheduler] in deepspeed_loop.py), passing
        it `lr_kwargs` as DeepSpeed does (a ReduceLROnPlateau's `{"metrics": loss}`); before
        that nothing. A call without a backward is a micro-step too, as DeepSpeed counts calls
        (Note [model.step() without a backward] in deepspeed_loop.py). PatrickStar's own loop
        calls `optimizer.step()` and `optimizer.zero_grad()` instead; a boundary model.step()
        with no backward after an optimizer.step() without zero_grad() (both loops in one)
        raises."""
        self._loop.step(lr_kwargs)

    @property
    def lr_scheduler(self):
        """DeepSpeed's attribute: the scheduler `model.step()` steps and checkpoints save (None
        until assigned: build it on the optimizer `initialize()` returned)."""
        return self._loop.lr_schedule.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler) -> None:
        self._loop.lr_schedule.set(scheduler)

    def is_gradient_accumulation_boundary(self) -> bool:
        """DeepSpeed's: whether the current micro-step (its backward not yet run, or run but
        not yet followed by `model.step()`) is the one whose `model.step()` steps the
        optimizer."""
        return self._loop.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last optimizer step (of `model.step()` or a direct
        `optimizer.step()`) changed the parameters (False after an fp16 overflow skipped it)."""
        return self._loop.was_step_applied()

    @property
    def skipped_steps(self) -> int:
        """DeepSpeed's count of optimizer steps skipped (fp16 overflow, `nonfinite_loss:
        "skip"`)."""
        return self.optimizer.skipped_steps

    def get_global_grad_norm(self):
        """DeepSpeed's: the L2 norm of all gradients (every rank's, unscaled, before clipping)
        of the last optimizer step, as ZeRO-3 reports it every step (0 after a step without
        gradients, None before the first step). Without clipping or fp16 the update measures it
        as it reads the gradients (Note [The norm the update measures] in kernels/adam.cc). A
        float that also answers `.item()`, as DeepSpeed's tensor does (Note [The grad norm
        answers item()] in deepspeed_loop.py)."""
        return GradNorm.of(self.optimizer.last_grad_norm)

    @property
    def micro_steps(self) -> int:
        """DeepSpeed's: the number of `model.step()` calls (micro-steps) of this engine, counted
        at the end of each; not saved in checkpoints (DeepSpeed's is not either). Settable, as
        DeepSpeed's attribute; it does not move the accumulation boundary here."""
        return self._loop.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self._loop.micro_steps = int(value)

    @property
    def global_steps(self) -> int:
        """DeepSpeed's count of optimizer steps taken (applied or skipped for overflow)."""
        return self.iteration

    def gradient_accumulation_steps(self) -> int:
        return self.guard.accumulation

    def fp16_enabled(self) -> bool:
        """DeepSpeed's: the config's fp16.enabled."""
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        """DeepSpeed's: the config's bf16.enabled."""
        return self.precision == "bf16"

    def gradient_clipping(self) -> float:
        """DeepSpeed's: the config's gradient_clipping (0.0: none)."""
        return self.ps_config.gradient_clipping

    def steps_per_print(self) -> int:
        """DeepSpeed's: the config's steps_per_print (10 without it), which scripts log by.
        PatrickStar itself prints nothing per step (per-step timings: the config's profile)."""
        return self.ps_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """DeepSpeed's: the config's wall_clock_breakdown (False without it). The per-phase
        timings are the profile's here (the config's `profile` section)."""
        return self.ps_config.wall_clock_breakdown

    def empty_partition_cache(self) -> None:
        """DeepSpeed's (ZeRO-3): drops the gathered copies of other ranks' parameters, which
        the next forward gathers again; every rank calls it, between forward passes, as
        DeepSpeed requires (RLHF loops call it after generation). With one process there are
        none and it changes nothing: chunks live where the memory budgets put them. On a
        destroyed engine it does nothing (its chunks are freed already)."""
        if self.guard.destroyed and self.guard.in_owner_process():
            return
        self.guard.check_alive("model.empty_partition_cache()")
        if self._in_forward:
            raise RuntimeError("model.empty_partition_cache() was called inside the model's "
                               "forward; call it between iterations (after model.step() or "
                               "before the next forward)")
        with self.guard.calling("model.empty_partition_cache()"):
            self.dp.release_gathered()

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's: 3. Parameters, gradients and optimizer state always live in chunks
        partitioned over the data-parallel ranks (ZeRO stage 3's partitioning; offload is the
        memory budgets' doing, not a stage)."""
        return 3

    @property
    def world_size(self) -> int:
        """DeepSpeed's: the number of processes (torch.distributed's world; 1 without it)."""
        return get_world_size()

    @property
    def global_rank(self) -> int:
        """DeepSpeed's: this process's rank in torch.distributed's world (0 without it)."""
        return get_rank()

    @property
    def dp_world_size(self) -> int:
        """DeepSpeed's: the ranks of this rank's data-parallel group (the world without
        pipeline or tensor parallelism)."""
        return self.dp.world_size

    @property
    def global_samples(self) -> int | None:
        """DeepSpeed's: samples trained on over all data-parallel ranks, train_batch_size() per
        optimizer step (applied or skipped, as DeepSpeed counts); None when the config gives
        no batch size, as train_batch_size(). A checkpoint restores it (Note [Samples counted
        across batch sizes])."""
        batch = self.train_batch_size()
        return None if batch is None else self.global_steps * batch + self._samples_offset

    # Note [Samples counted across batch sizes]
    # DeepSpeed saves global_samples and a load restores it, so a run resumed with another
    # train_batch_size counts on from the samples it had (a log's x axis). Ours computed it as
    # global_steps * the current batch size, which rewrote the past at such a resume. The
    # count is that product plus an offset; setting global_samples (as a load does, and as
    # DeepSpeed's plain attribute allows) sets the offset.
    @global_samples.setter
    def global_samples(self, value: int) -> None:
        batch = self.train_batch_size()
        if batch is not None:
            self._samples_offset = int(value) - self.global_steps * batch

    def train_batch_size(self) -> int | None:
        """DeepSpeed's: samples per optimizer step over every data-parallel rank (None when the
        config gives no batch size: the data loader's batch is all the engine sees)."""
        return self.ps_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """DeepSpeed's: samples per forward on one rank (None without a batch size in the
        config)."""
        return self.ps_config.train_micro_batch_size_per_gpu

    def get_lr(self) -> list[float]:
        """DeepSpeed's: the learning rate of every parameter group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[tuple[float, float]]:
        """DeepSpeed's: the momentum of every parameter group, Adam's `betas` (what DeepSpeed's
        returns for its Adam optimizers; a DeepSpeed OneCycle scheduler moves them)."""
        return [tuple(group["betas"]) for group in self.optimizer.param_groups]

    def end_iteration(self) -> None:
        """The end of a training iteration (the optimizer calls it after every step, applied or
        skipped)."""
        try:
            self.dp.parameters_changed()  # the step changed the owners' parameters
            self.chunks.end_iteration()
            if self.profiler is not None:
                self.profiler.on_end_iteration()
        finally:
            # The step is over whatever a signal handled here raises: left uncounted, every
            # later checkpoint's global step (and default tag) was one short.
            self.iteration += 1

    def _count_step_without_gradients(self) -> None:
        """model.step()'s optimizer step without gradients counts as a step, as DeepSpeed's
        (Note [model.step() without a backward] in deepspeed_loop.py); the optimizer already
        ended the runtime's iteration (end_iteration_without_step)."""
        self.iteration += 1

    # Note [An iteration without a step]
    # A step without gradients (Note [A step without gradients] in optimizer.py) counts no
    # iteration, but the forwards since the last step (a batch skipped after its forward) are
    # moments and accesses of the chunk runtime's trace. In the warm-up they became part of the
    # trace every later iteration replays, as a forward that raised did (Note [A forward that
    # raised during warm-up]): one skipped 900-row forward of a 512 KiB host budget made every
    # later iteration evict and read back chunks, where none did without it. So the warm-up
    # starts again from the next forward; after it, the runtime's iteration ends there, so the
    # next iteration's accesses line up with the trace again.
    def end_iteration_without_step(self) -> None:
        if self.chunks.warming_up:
            self.chunks.report_non_model_data(self._non_model_tier, self.non_model_bytes())
            self.chunks.restart_warmup()
        else:
            self.chunks.end_iteration()

    # ---- State dicts ---------------------------------------------------------------------------

    # Note [keep_vars gives the parameters themselves]
    # torch's state_dict(keep_vars=True) holds the module's Parameter objects (requires_grad,
    # isinstance nn.Parameter, the very objects). The engine's gave copies of their values,
    # plain tensors with requires_grad False, so the usual "save the trainable weights" filter
    # `{k: v for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}` (LoRA
    # and fine-tuning scripts) saved nothing and an in-place write into an entry changed a copy
    # silently. It is now the module's own (`model.module.state_dict(keep_vars=True)`): at rest
    # the parameters read their values out of the chunks wherever a value is used (torch.save,
    # another module's load_state_dict) and refuse in-place writes naming the parameter (Note
    # [Parameters at rest] in resting_params.py); loading them into the engine itself, or into
    # another engine, reads them first (checked_value in parameter_values.py).
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state dict with full parameters (compute dtype) read out of chunks: the
        module's own state dict (Note [The user's module's state dict]). Under data parallelism
        a collective: every rank calls it (Note [Every rank runs the same forwards] in
        data_parallel.py). With keep_vars, as in torch, the entries are the module's own
        parameters and buffers (Note [keep_vars gives the parameters themselves])."""
        self.guard.check_alive("state_dict()")
        with self.guard.calling("state_dict()"):  # Note [Reads are calls too] in guards.py
            return self._state_dict(destination, prefix, keep_vars)

    def _state_dict(self, destination, prefix: str, keep_vars: bool):
        for hook in self._state_dict_pre_hooks.values():  # Note [Hooks on the engine itself]
            hook(self, prefix, keep_vars)
        if prefix and not keep_vars:  # else the module's own hook agrees, or nothing is read
            self.agree_on_state_dict_read()
        result = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        for hook in self._state_dict_hooks.values():
            replaced = hook(self, result, prefix, {"version": self._version})
            if getattr(hook, "_from_public_api", False):
                if replaced is not None:
                    raise RuntimeError("state_dict post-hook must return None")
            elif replaced is not None:
                result = replaced
        if destination is not None:
            destination.update(result)
            return destination
        return result

    def agree_on_state_dict_read(self) -> None:
        """Under data parallelism, every rank is reading the model's state dict (Note [Every
        rank runs the same forwards] in data_parallel.py); a no-op for one rank."""
        self.dp.agree_on_call(2)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Accepts plain PyTorch tensors (any float dtype) for every parameter and buffer.
        `assign=True` (torch's, to take the given tensors as the parameters) is refused as
        `model.module.load_state_dict` refuses it: the parameters' data lives in chunks."""
        if assign:
            raise RuntimeError("load_state_dict(assign=True) cannot replace the model's "
                               "parameters: their data lives in PatrickStar chunks; load without "
                               "assign, which copies the values into the chunks")
        state_dict = self._own_load_pre_hooks(state_dict, strict)
        result = self._parameter_values.load_state_dict(self.module, state_dict, strict)
        for hook in self._load_state_dict_post_hooks.values():
            if hook(self, result) is not None:
                raise AssertionError("Hooks registered with ``register_load_state_dict_post_"
                                     "hook`` are not expected to return new values, if "
                                     "incompatible_keys need to be modified, it should be "
                                     "done inplace.")
        return result

    # Note [Hooks on the engine itself]
    # The engine's state_dict() and load_state_dict() are its module's, under the module's keys
    # (DeepSpeed's module_state_dict), so torch's own calls never ran the state-dict hooks
    # registered on the engine (`model.register_state_dict_pre_hook`, `_post_hook`,
    # `register_load_state_dict_pre_hook`, `_post_hook`): they were accepted and ignored. They
    # run here as torch runs a module's own (prefix "" for the loads, the module's keys), around
    # the module's hooks; a load post-hook sees the result of a load that succeeded (torch calls
    # it before its strict check, so there one may also clear the keys that would fail it).
    def _own_load_pre_hooks(self, state_dict, strict: bool):
        if not self._load_state_dict_pre_hooks:
            return state_dict
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = collections.OrderedDict(state_dict)  # torch's copy, which hooks may change
        if metadata is not None:
            state_dict._metadata = metadata
        missing, unexpected, errors = [], [], []
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, "", {} if metadata is None else metadata.get("", {}), strict,
                 missing, unexpected, errors)
        if errors:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                type(self.module).__name__, "\n\t".join(errors)))
        return state_dict

    def agree_on_module_load(self) -> None:
        """The user's module (or a submodule) starts a load_state_dict: under data parallelism
        every rank makes it (Note [Writes on one rank are refused] in data_parallel.py)."""
        self._parameter_values.agree_on_module_load()

    def load_parameter(self, index: int, source: torch.Tensor) -> None:
        """New weights for parameter `index` (its shape, any float dtype)."""
        self._parameter_values.load(index, source)

    def read_parameter(self, index: int, what: str = "state_dict()",
                       by_user: bool = False) -> torch.Tensor:
        """Parameter `index` in the compute dtype (a collective under data parallelism); `what`
        is the call an error names. `by_user`: a read of user code at rest, which the ranks
        agree on first when it gathers (Note [Parameter reads agree] in data_parallel.py)."""
        return self._parameter_values.read(index, what,
                                           self.dp.PARAMETER_READ if by_user else None)

    def full_gradient(self, param) -> torch.Tensor | None:
        """DeepSpeed's `safe_get_full_grad`: the gradient of `param` (one of this engine's
        parameters, or its name) between backward and `optimizer.step()`, as `p.grad` would
        hold it in PyTorch (`p.grad` itself stays None: gradients live in chunks). Under data
        parallelism a collective (every rank calls it) that gives the gradient averaged over
        the ranks, read after the backward that ends an accumulation."""
        # Note [Module forwards in a forked child] in guards.py
        self.guard.check_owner_process("safe_get_full_grad()")
        try:
            index = self._parameter_index(param, "full_gradient")
        except (KeyError, ValueError):
            empty = self._parameter_without_elements(param)
            if empty is None:
                raise
            return empty.grad  # Note [Gradients of parameters without elements]
        if not self.dp.enabled:
            return self.optimizer.gradient(index)
        self._check_gradients_reduced("full_gradient()")
        gathered = self.dp.all_gather_object(self.optimizer.gradient(index))
        return next((grad for grad in gathered if grad is not None), None)

    def _check_gradients_reduced(self, what: str) -> None:
        """Under data parallelism gradients are whole (reduced over the ranks, on their owners)
        only after the backward that ends an accumulation, or before any backward."""
        if self.dp.enabled and self.guard.in_accumulation:
            raise RuntimeError(
                f"{what} after {self.guard.backwards} of {self.guard.accumulation} backward() "
                f"calls: under data parallelism the ranks' gradients are reduced by the "
                f"backward that ends the accumulation; read them after it")
        if self.dp.gradients_unreduced:
            raise RuntimeError(
                f"{what} after a backward under model.no_sync() (or require_backward_grad_sync "
                f"= False): under data parallelism its gradients are reduced over the ranks by "
                f"the next backward outside it or by optimizer.step(); read them after that")

    # Note [Gradients of parameters without elements]
    # A parameter without elements stays outside the chunks (init_context.plan_parameters), so
    # autograd writes its (empty) p.grad as torch does and zero_grad drops it. full_gradient,
    # looping over named_parameters() to log gradient norms (the documented use), refused its
    # name as "no parameter" and safe_get_full_grad refused it as not the engine's: both give
    # that p.grad. Nothing is averaged under data parallelism (there are no elements), so no
    # collective runs for it; every rank answers alike.
    def _parameter_without_elements(self, param) -> nn.Parameter | None:
        """The module's parameter without elements that `param` (a parameter or its name, not
        one of the chunked parameters) is, else None."""
        if isinstance(param, str):
            found = dict(self.module.named_parameters()).get(param.removeprefix("module."))
        else:
            found = next((p for p in self.module.parameters() if p is param), None)
        return found if found is not None and found.numel() == 0 else None

    def _parameter_index(self, param, what: str) -> int:
        if isinstance(param, str):
            name = param.removeprefix("module.")
            if name not in self.params.names:
                raise KeyError(f"{what}: this engine has no parameter '{param}' (names as in "
                               f"model.state_dict(), e.g. '{self.params.names[0]}')")
            return self.params.names.index(name)
        index = self.params.index_of(param)
        if index is None:
            raise ValueError(f"{what}: the tensor given is not a parameter of this engine "
                             f"(shape {tuple(getattr(param, 'shape', ()))})")
        return index

    def after_module_load(self, indices: list[int]) -> None:
        """The user's module loaded new values of these parameters into the chunks (Note [The
        user's module's state dict]): torch's own copy into their placeholders after that is
        not a lost user write, and under data parallelism gathered copies are stale."""
        self.restore_placeholders(indices)
        self.dp.parameters_changed()

    def apply(self, fn: Callable[[nn.Module], None]):
        """`nn.Module.apply`: `fn` on every module, children first; the parameters `fn` touches
        hold their values while it runs and what it changes goes back into the chunks (Note
        [Applying a function to the modules] in module_apply.py). Under data parallelism every
        rank calls it with the same `fn`."""
        self.apply_to(self, fn)
        return self

    def apply_to(self, root: nn.Module, fn: Callable[[nn.Module], None]) -> None:
        """`root.apply(fn)` for the engine or a module of its tree (`model.module.apply(fn)`,
        a submodule's: Note [Methods of the user's modules] in module_methods.py), as apply."""
        self.guard.check_alive("model.apply()")
        # Note [Writes on one rank are refused] in data_parallel.py
        self.dp.agree_on_training_call(self.dp.MODULE_APPLY)
        with self._awake():  # what fn touches is lent its values (module_apply.py)
            applying = ModuleApply(self, pending_until_end=self.dp.enabled)
            applying.run(root, fn)
        applying.raise_refused()

    @contextlib.contextmanager
    def awake_parameters(self):
        """Inside, the parameters hold their own class rather than answering reads at rest
        (Note [Parameters at rest]), so lendings inside (`call_lent`, one per module of a
        `model.train()` over many LoRA layers) skip waking and resting every parameter each."""
        with self._awake():
            yield

    def call_lent(self, root: nn.Module, fn: Callable[[nn.Module], object], what: str):
        """`fn(root)` with the parameters of `root`'s subtree lent their values on first touch
        and what it changes loaded back, as one call of apply's `fn` (a module's own `train()`
        that merges LoRA weights: Note [A module's own train()] in module_methods.py); `what`
        names the call in errors."""
        self.guard.check_alive(what)
        with self._awake():
            applying = ModuleApply(self, pending_until_end=self.dp.enabled)
            result = applying.run_once(root, fn)
        applying.raise_refused()
        return result

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True):
        """FSDP's `summon_full_params`: inside the block every parameter holds its values (lent
        on first touch: Note [Applying a function to the modules] in module_apply.py), e.g. for
        `AveragedModel.update_parameters(model)`; with `writeback` what the block changes goes
        back into the chunks. No forward inside. Under data parallelism every rank enters it."""
        self.guard.check_alive("model.summon_full_params()")
        if not isinstance(writeback, bool):  # DeepSpeed's GatheredParameters(params, ...) habit
            raise TypeError(f"model.summon_full_params(writeback): writeback must be True or "
                            f"False, not {type(writeback).__name__}; it gathers every parameter "
                            f"(DeepSpeed's GatheredParameters(params, modifier_rank=0) is "
                            f"summon_full_params(writeback=True))")
        self.dp.agree_on_training_call(self.dp.MODULE_APPLY)  # (Note [Writes on one rank
        self._summoned += 1  # are refused] in data_parallel.py)
        try:
            with self._awake(), ModuleApply(self, pending_until_end=self.dp.enabled).lent(
                    self.module, writeback):
                yield
        finally:
            self._summoned -= 1

    # Note [No forward while summoned]
    # Inside summon_full_params() a parameter holds a lent copy of its values (or a deferred
    # placeholder that lends one on first touch), not its chunk slot; a module's access then
    # met a slot already taken by the lending and failed in the chunk runtime ("tensor
    # '0.weight': illegal state transition COMPUTE -> COMPUTE"), naming neither the forward nor
    # the block. Users reach it evaluating EMA weights copied in inside the block, or merging a
    # torch.nn.utils.parametrize LoRA there (remove_parametrizations computes the weight with
    # the parametrization's forward). FSDP refuses forwards in its summon_full_params too, so
    # the access is refused before it touches anything, saying what to do instead.
    def _refuse_forward_while_summoned(self, module: nn.Module) -> None:
        name = next((n for n, m in self.module.named_modules() if m is module), None)
        raise RuntimeError(
            f"forward of module '{name}' ({type(module).__name__}) inside "
            f"model.summon_full_params(): inside the block the parameters hold copies for "
            f"reading or editing by hand, and a forward needs them in their chunks. Run the "
            f"forward after the block (to evaluate other weights, load them with "
            f"model.load_state_dict or edit them with writeback=True first); a "
            f"torch.nn.utils.parametrize merge (remove_parametrizations) runs a forward too: "
            f"merge on a plain copy, copy.deepcopy(model.module)")

    def _holds_placeholder(self, param: nn.Parameter) -> bool:
        """Whether `param` is one of ours between its uses (Note [Parameter data swapping])."""
        index = self.params.index_of(param)
        return index is not None and not self.parameter_in_use(index)

    def parameter_in_use(self, index: int) -> bool:
        """Whether parameter `index` holds its chunk view now (inside its module's use)."""
        return self._slots.access_count(index) > 0

    def restore_placeholders(self, indices: list[int]) -> None:
        """Points these released parameters' .data back at the placeholder and forgets writes
        into it (Note [Writes to a released parameter])."""
        for index in indices:
            if self._slots.access_count(index) == 0:
                self._slots.restore_placeholder(index)

    # ---- Checkpoints (logic in checkpoint/) -------------------------------------------------

    # Note [DeepSpeed's checkpoint signatures]
    # The two calls take DeepSpeed's arguments in DeepSpeed's order, so a script written for
    # it means the same positionally: save_checkpoint(save_dir, tag, client_state,
    # save_latest, exclude_frozen_parameters) and load_checkpoint(load_dir, tag,
    # load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only,
    # custom_load_fn). Ours put load_optimizer_states third, so DeepSpeed's
    # `load_checkpoint(dir, tag, True, False)` (strict, no optimizer state) loaded the
    # optimizer state and skipped the scheduler's, silently, and the keyword arguments
    # exclude_frozen_parameters, load_module_strict and custom_load_fn raised TypeError. Our
    # own arguments (lr_scheduler, load_rng_states, allow_reshard) are keywords after them.
    # exclude_frozen_parameters leaves the frozen parameters out (Note [Frozen parameters left
    # out] in checkpoint/engine_state.py); load_module_strict=False loads a checkpoint of
    # this very model as True does, and a custom_load_fn is refused, naming what to use.
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, *, lr_scheduler=None) -> bool:
        """DeepSpeed's call (Note [DeepSpeed's checkpoint signatures]): writes DIR/TAG
        atomically, then DIR/latest. The lr scheduler is `lr_scheduler` or
        `model.lr_scheduler` when set."""
        if not isinstance(exclude_frozen_parameters, bool):
            raise TypeError(f"save_checkpoint(): exclude_frozen_parameters (the fifth argument, "
                            f"as DeepSpeed's) must be True or False, not "
                            f"{type(exclude_frozen_parameters).__name__}; pass a scheduler as "
                            f"lr_scheduler=")
        with self.guard.calling("save_checkpoint()"):  # Note [Reads are calls too] in guards.py
            # Note [Writes on one rank are refused] in data_parallel.py
            self.dp.agree_on_training_call(self.dp.CHECKPOINT_SAVE)
            self.optimizer.apply_state_edits()  # Note [Edits of optimizer.state entries]
            return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                              lr_scheduler, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, **kwargs):
        """DeepSpeed's call (Note [DeepSpeed's checkpoint signatures]); returns (path,
        client_state), path being DIR/TAG/meta.json (Note [The path load_checkpoint returns]
        in checkpoint/protocol.py), or (None, None) without `latest`."""
        self._refuse_closed_chunks("load_checkpoint()")  # (it is how a failed step recovers)
        if custom_load_fn is not None:
            raise TypeError("load_checkpoint(custom_load_fn=...) is not supported: the engine's "
                            "parameters live in chunks, not in the module a custom function "
                            "would load into. Load the checkpoint, then change the weights with "
                            "model.load_state_dict(...) or model.apply(fn)")
        loaded = checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                            load_lr_scheduler_states, load_module_only,
                                            load_module_strict=load_module_strict, **kwargs)
        if loaded[0] is not None and not load_module_only and load_optimizer_states:
            self.guard.failed_step = None  # a consistent state again (guards.py)
            self.optimizer.forget_state_edits()  # Note [Edits of optimizer.state entries]
        if loaded[0] is not None:  # it dropped the gradients: a new accumulation begins
            self._loop.restart_accumulation()
        self._loop.lr_schedule.forget_position()  # the load may have moved the scheduler
        if self.chunks.warming_up:  # loading is not part of the iterations the trace repeats
            self.chunks.restart_warmup()
        return loaded

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: SAVE_DIR/SAVE_FILENAME, the module's state dict in the training dtype
        (Note [The 16-bit model file] in sixteen_bit_model.py); every rank calls it."""
        return sixteen_bit_model.save_16bit_model(self, save_dir, save_filename,
                                                  exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def destroy(self) -> None:
        """Writes a running profile, then frees every chunk, tier (NVMe swap files go with
        their tier), thread and communicator now (DeepSpeed's `engine.destroy()`). Later
        training calls raise; a second destroy() does nothing. `del model, optimizer` does
        the same once the engine is collected (Note [Engine lifetime])."""
        if self.guard.destroyed:
            return
        self.guard.destroyed = True
        _live_engines.discard(self)
        if not self.guard.in_owner_process():
            self._abandon_inherited_runtime()
            return
        # (Attributes read through __dict__ may be missing when __init__ raised part way.)
        profiler = self.__dict__.get("profiler")
        try:
            if profiler is not None and profiler.running:
                profiler.stop(engine=self)  # while the chunk manager is still open
        finally:
            try:
                self.dp.agree_at_end()  # Note [Reads on one rank are served]
            finally:
                self.dp.close()
            for hooks in ("_hooks", "_call_hooks"):
                if hooks in self.__dict__:
                    self.__dict__[hooks].remove()
            for param in self.params.params:
                param.data = self._placeholder()
            self.chunks.close()
            self._slots = None  # it holds the manager, and the manager the tiers
            if "_views" in self.__dict__:
                self._views.close()  # it holds the slots
            self.chunks = self.tiers = self.copy_engine = self.runtime = None

    def _abandon_inherited_runtime(self) -> None:
        """In a process forked from the engine's (Note [Engine lifetime]): the runtime's
        threads (copy engine, IO, the device's streams) exist only in the parent, so tearing it
        down here waits for them forever (the strict emulated device's synchronize; a CUDA
        context is not usable after fork either), and its files and rings are the parent's. The
        child keeps its copies undestroyed until it ends: one more reference each, never given
        back, so no destructor runs at interpreter exit either."""
        for held in (self.runtime, self.chunks, self.tiers, self.copy_engine, self._slots,
                     self.dp):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))
        self._hooks.remove()
        self._call_hooks.remove()

    def __del__(self) -> None:
        # Note [Engine lifetime]. Attributes may be missing when __init__ raised.
        guard = self.__dict__.get("guard")
        if guard is None or guard.destroyed or "_slots" not in self.__dict__:
            return
        try:
            self.destroy()
        except Exception as error:  # noqa: BLE001 (a finalizer must not raise)
            print(f"patrickstar: destroying an engine that was garbage-collected failed: "
                  f"{type(error).__name__}: {error}", file=sys.stderr)

    def _refuse_closed_chunks(self, what: str) -> None:
        """Raises, naming `what`, once destroy() closed the chunk manager (the profile destroy()
        writes reads the statistics before that)."""
        if self.chunks is None:
            self.guard.check_alive(what)

    def memory_stats(self) -> list[dict]:
        """Per tier: budget, chunk bytes now and at peak, bytes moved in and out, evictions."""
        self._refuse_closed_chunks("memory_stats()")
        return self.chunks.stats()

    def reset_peak_memory_stats(self) -> None:
        """`peak_chunk_bytes` of every tier starts again from its current chunk bytes (as
        torch.cuda.reset_peak_memory_stats): the peak of training apart from initialization,
        when every rank of a data-parallel job builds the whole model once."""
        self._refuse_closed_chunks("reset_peak_memory_stats()")
        self.chunks.reset_peak_stats()

    @property
    def peak_model_bytes(self) -> int:
        """The peak of this process's chunk bytes over all tiers together (parameters,
        gradients, optimizer state, gathered copies) since initialization or the last
        reset_peak_memory_stats(); the tiers' own peak_chunk_bytes peak at different moments."""
        self._refuse_closed_chunks("peak_model_bytes")
        return self.chunks.peak_total_bytes

