"""Building the user's model so that each parameter lands in its chunk as it is created.

Note [Two-pass initialization]
Chunk layouts are planned from the full list of tensors (first-fit in registration order, the
same on every rank), but `model_func` creates parameters one by one and the full fp32 model must
never exist at once. So `model_func` runs twice:
  1. on the meta device (no memory), recording every parameter registration; the parameters that
     survive into the finished model (tied weights drop the one they replace) become the specs
     the chunk layout is planned from;
  2. for real, inside `ParameterPlacer`: each surviving parameter, as it is registered, is
     copied into its planned chunk slot and its `.data` becomes a view of that slot, so the
     module's own initialization (`reset_parameters`, Hugging Face `post_init`) writes straight
     into chunk memory and the temporary tensor is freed at once.
The RNG states are saved before pass 1 and restored after it, so pass 2 draws exactly the
numbers a plain `model_func()` would.

Note [Initialization under a host budget]
A parameter's slot stays accessed (pinned on the host) while the model is being built, because
the module's own initialization writes into it, possibly long after it was created (a parent's
`self.apply(self._init_weights)`, Hugging Face's `post_init`). When the host budget cannot hold
every slot at once, `InitResidency` releases the least recently used parameter so that its chunk
may spill to NVMe, and marks it *deferred*: its `.data` becomes an empty placeholder and its class
a subclass of its own with a `__torch_function__` that, on the parameter's next use by any torch
function or method (`normal_`, `copy_`, `.data`, `.shape`, `F.linear`, ...), accesses the slot
again, turns the parameter back into a plain one over it, and runs the call (Note [Restoring on
first use] in restore_on_use.py). Peak host memory
during initialization is then bounded by the budget, not by the model, and every write lands in
the chunk. The one pattern this cannot see is a `.data` view kept in a variable across the
creation of other parameters, which could outlive the slot it points into.

Note [Planning without the meta device]
Some `model_func`s cannot run on the meta device: Hugging Face's `from_pretrained` refuses it (it
must read the weights), and code that calls `.item()` or `.tolist()` on a parameter while
building fails there. Pass 1 then builds the model once for real on the CPU under the same
registration hook, takes the specs from it and drops it before pass 2. The peak is that model's
memory once, as plain PyTorch would need, and pass 2 reads the weights again into chunks (for
`from_pretrained`, the loaded tensors replace the meta ones it builds first, and those are the
ones that survive). For a model larger than host memory, build it with `from_config` (or the
class) and load the weights with `load_checkpoint` or `load_state_dict` after `initialize()`.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .memory_formats import format_name
from .restore_on_use import defer, undefer
from .wide_init import initializers_in_built_dtype
from .utils.logging import logger as _log

__all__ = ["BuiltModule", "ParamSpec", "plan_parameters", "ParameterPlacer", "InitResidency",
           "build_lock", "built_dtype_warning", "sparse_gradient_error",
           "unmaterialized_parameter_error"]


@dataclasses.dataclass
class ParamSpec:
    index: int  # position among surviving parameters, in registration order
    name: str
    shape: tuple[int, ...]
    requires_grad: bool
    dtype: torch.dtype = torch.float32  # as model_func built it



@contextlib.contextmanager
def _preserved_rng():
    states = (torch.get_rng_state(), random.getstate())
    try:
        import numpy
        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        numpy = numpy_state = None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


# Note [Building in one thread at a time]
# The parameter-registration hook torch offers is process-wide, so a thread building its own
# modules while initialize() ran (a metrics helper, a second initialize() in another thread)
# had its parameters counted as model_func's: "model_func registered more parameters than on
# its first run", blaming model_func; adding and removing the hook while another thread's
# register_parameter iterated torch's hook dict failed there with "OrderedDict mutated during
# iteration". One hook is registered once and calls the hook of the thread it runs in, so only
# the building thread's registrations count; and builds take one lock (build_lock()), since the
# initializers' dtype wrappers (wide_init.py) are process-wide too.
_BUILD_LOCK = threading.RLock()
_THREAD_HOOK = threading.local()
_DISPATCHER = None  # the one handle of _dispatch, registered at the first build


def build_lock() -> threading.RLock:
    """Held while a model_func builds into an engine (Note [Building in one thread at a
    time])."""
    return _BUILD_LOCK


def _dispatch(module, name, param):
    hook = getattr(_THREAD_HOOK, "hook", None)
    return None if hook is None else hook(module, name, param)


@contextlib.contextmanager
def _registration_hook(hook):
    global _DISPATCHER
    with _BUILD_LOCK:
        if _DISPATCHER is None:
            _DISPATCHER = nn.modules.module.register_module_parameter_registration_hook(
                _dispatch)
    previous = getattr(_THREAD_HOOK, "hook", None)
    _THREAD_HOOK.hook = hook
    try:
        yield
    finally:
        _THREAD_HOOK.hook = previous


# Note [A parameter re-created in another dtype]
# Code in model_func may convert a registered parameter by re-creating it in another dtype
# (`setattr(owner, name, nn.Parameter(p.data.float()))`). PEFT does so for its adapters, and only
# when it sees a real tensor: `get_peft_model` moves each adapter to the base layer's dtype, but
# skips adapters on the meta device, and then re-creates the 16-bit ones in fp32
# (`cast_adapter_dtype`). So the planning pass on the meta device saw no re-creation while the
# build into chunks saw one per adapter whenever the base weight was 16-bit there (a base model
# built in bf16, or a frozen base under a bf16 config, whose slot is the 16-bit compute chunk:
# Note [Frozen parameters in 16 bits] in engine.py), and initialize() raised "model_func
# registered more parameters than on its first run" for every PEFT model trained in bf16.
# The chunks hold every parameter in the config's dtypes whatever dtype model_func gives it, so
# both passes take such a re-creation (same shape, same device, another dtype) as the
# conversion `p.data = p.data.to(dtype)` that `.to()` / `.half()` make: the new values (and
# requires_grad) go into the parameter already registered under that name, which stays the
# module's parameter, and they reach its slot as any `p.data = t` does (Note [Parameters
# resized while building]). Any other replacement (another shape, or meta weights replaced by
# loaded ones, as `from_pretrained` does) is a new parameter, as before.
def _recreated(module: nn.Module, name: str, param: nn.Parameter | None,
               registered: Callable[[nn.Parameter], bool]) -> nn.Parameter | None:
    """The parameter registered as `module.<name>` that `param` re-creates in another dtype,
    now holding `param`'s values and requires_grad; None when `param` is anything else."""
    if param is None or is_lazy(param):
        return None
    current = dict(module.named_parameters(recurse=False)).get(name)
    if current is None or current is param or is_lazy(current) or not registered(current) \
            or current.shape != param.shape or current.device != param.device \
            or current.dtype == param.dtype:
        return None
    with torch.no_grad():
        current.data = param.data
    current.requires_grad_(param.requires_grad)
    return current


# Note [Device moves in the planning pass]
# Nearly every PyTorch script builds its model as `Model(...).to(device)` (word_language_model,
# the MNIST example; `.cuda()` in older ones), and a port keeps that line in model_func. On the
# meta device torch refuses the move ("Cannot copy out of meta tensor"), so pass 1 fell back to a
# real build (Note [Planning without the meta device]): a warning naming to_empty(), as if the
# script were wrong, and the whole model built once for real on the host, and with
# `.to("cuda")` on the GPU, the memory the chunks exist to spare. The planning pass needs only
# shapes and dtypes, so there `Tensor.to`, `.cuda()` and `.cpu()` of a meta tensor keep it on
# meta and apply only the dtype (`.to(device, torch.bfloat16)` still plans bf16 parameters).
# The build into chunks runs the line as written.
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


class _MovesStayOnMeta(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            tensor = args[0]
            if func is torch.Tensor.to:
                try:
                    _, dtype, _, memory_format = torch._C._nn._parse_to(
                        *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
                except RuntimeError:  # a positional copy=: torch's own move and its error
                    return func(*args, **kwargs)
                if dtype is not None or memory_format is not None:
                    return tensor.to(dtype=dtype or tensor.dtype,
                                     memory_format=memory_format or torch.preserve_format)
            return tensor
        return func(*args, **kwargs)


def _call_model_func(model_func: Callable[[], nn.Module]) -> nn.Module:
    model = model_func()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_func must return a torch.nn.Module, got {type(model).__name__}")
    return model


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    """Parameters live in chunks of the compute dtype (fp32, or fp16/bf16 with fp32 masters),
    which hold float16, bfloat16 and float32 values exactly. Others would change silently, so
    they are refused before anything is allocated."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return
    if dtype.is_floating_point or dtype.is_complex:
        # A script that set torch's default dtype to float64 builds every parameter so: the
        # remedy is the default, not one .float() per module.
        default = (f" (torch's default dtype is {dtype}: torch.set_default_dtype(torch.float32) "
                   f"before initialize() builds the model in float32)"
                   if dtype == torch.get_default_dtype() else "")
        raise TypeError(
            f"parameter '{name}' is {dtype}: PatrickStar-C++ keeps parameters in float32 chunks "
            f"(fp16/bf16 compute copies with the fp32 config), which would round it silently. "
            f"Create it as float32 in model_func (e.g. .float()), or register it as a buffer "
            f"(module.register_buffer) if it is not trained{default}")
    raise TypeError(
        f"parameter '{name}' is {dtype}: an integer parameter cannot be trained (PyTorch gives "
        f"it no gradient) and chunks hold floating-point values only. Register it as a buffer "
        f"(module.register_buffer(name, tensor)): buffers keep their dtype, are saved in "
        f"state_dict and checkpoints, and stay on the module")


# Note [Lazy modules]
# nn.LazyLinear / LazyConv2d register an UninitializedParameter and give it its shape in place
# at the first forward. Torch's recipe is a forward on a dummy batch before the optimizer is
# made, which inside model_func made initialize() fail with torch's "Can't access the shape of
# an uninitialized parameter" (the placement compared shapes at registration). A lazy parameter
# now waits for its shape as a resized one does (Note [Parameters resized while building]) and
# is placed when model_func returns; one still uninitialized then is refused, naming it, since
# its chunk cannot be planned without a shape.
def unmaterialized_parameter_error(model: nn.Module, where: str) -> str | None:
    """The error for a lazy module's parameter still without a shape, or None."""
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if is_lazy(param):
                full = f"{module_name}.{name}" if module_name else name
                return (f"parameter '{full}' of {where} ({type(module).__name__}) is "
                        f"uninitialized: a lazy module gets its shape at its first forward, and "
                        f"chunks are planned from shapes. Run a forward on a dummy batch before "
                        f"initialize() takes the module (at the end of model_func: torch's "
                        f"recipe before making an optimizer), or give the layer its input size "
                        f"({type(module).__name__.replace('Lazy', '')})")
    return None


def _check_sparse_gradients(model: nn.Module) -> None:
    """Sparse gradients cannot go into a gradient chunk, and Adam has no sparse update (torch's
    Adam refuses them too, at its first step); say so before anything is allocated."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"{type(module).__name__} '{name}' was built with sparse=True: its sparse "
                f"gradients cannot be stored in PatrickStar's gradient chunks, and Adam has no "
                f"sparse update (torch.optim.Adam refuses them too). Build it with sparse=False")


def sparse_gradient_error(name: str, grad: torch.Tensor) -> ValueError:
    """The error for a sparse gradient that reaches a parameter's gradient hook anyway: from
    `F.embedding(..., sparse=True)` in a forward, or `sparse` set on a module after
    `initialize()`, which the check above cannot see (the store failed in torch with "copy_()
    between dense and sparse Tensors is not implemented", naming no parameter)."""
    return ValueError(
        f"parameter '{name}' got a {grad.layout} gradient (F.embedding / F.embedding_bag with "
        f"sparse=True, or an Embedding's sparse set after patrickstar.initialize()): sparse "
        f"gradients cannot be stored in PatrickStar's gradient chunks, and Adam has no sparse "
        f"update (torch.optim.Adam refuses them too). Use sparse=False")


def plan_parameters(model_func: Callable[[], nn.Module],
                    inspect: Callable[[nn.Module], Any] | None = None
                    ) -> tuple[list[ParamSpec], list[bool], Any]:
    """Pass 1 of Note [Two-pass initialization]. Returns the specs of the surviving parameters,
    per registration event whether it is the first registration of a surviving one, and
    `inspect(model)` of the planning build (None without `inspect`): the engine reads what its
    backward pins there (Note [What backward pins] in backward_pins.py)."""
    registrations: list[nn.Parameter] = []
    seen: set[int] = set()

    def record(module, name, param):
        replaced = _recreated(module, name, param, lambda p: id(p) in seen)
        if replaced is not None:  # Note [A parameter re-created in another dtype]
            return replaced
        if param is not None and id(param) not in seen:
            seen.add(id(param))
            registrations.append(param)

    try:
        with _preserved_rng(), _registration_hook(record), torch.device("meta"), \
                _MovesStayOnMeta(), warnings.catch_warnings():
            # A model_func that loads weights (load_state_dict) made torch warn once per
            # parameter that copying into a meta parameter is a no-op: true of this planning
            # pass only, whose weights are thrown away; the build into chunks loads them.
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter",
                                    category=UserWarning)
            model = _call_model_func(model_func)
    except (RuntimeError, NotImplementedError, ValueError) as error:
        # torch says "meta tensors" or "Meta tensors" ("aten::_to_sparse: attempted to run this
        # operator with Meta tensors": a sparse buffer built in __init__, a graph's adjacency)
        if "meta" not in str(error).lower():
            raise
        # Note [Planning without the meta device]
        _log.warning("model_func cannot run on the meta device (%s); planning the chunk "
                     "layout from one real build on the CPU, whose memory is freed before the "
                     "build into chunks", str(error).splitlines()[0])
        registrations.clear()
        seen.clear()
        with _preserved_rng(), _registration_hook(record):
            model = _call_model_func(model_func)
    message = unmaterialized_parameter_error(model, "the module model_func built")
    if message is not None:
        raise ValueError(message)
    _check_sparse_gradients(model)
    _check_not_taken(model)
    names = {id(p): n for n, p in model.named_parameters()}
    # A parameter without elements holds no memory and no optimizer state (Adam leaves it as it
    # is): it stays a plain parameter of the module, outside the chunks.
    survives = [id(p) in names and p.numel() > 0 for p in registrations]
    for param, alive in zip(registrations, survives):
        if alive:
            _check_dtype(names[id(param)], param.dtype)
    specs = []
    for param, alive in zip(registrations, survives):
        if alive:
            specs.append(ParamSpec(len(specs), names[id(param)], tuple(param.shape),
                                   param.requires_grad, param.dtype))
    for name, param in _unregistered(model, lambda p: id(p) in seen):  # Note [Parameters no...]
        _check_dtype(name, param.dtype)
        specs.append(ParamSpec(len(specs), name, tuple(param.shape), param.requires_grad,
                               param.dtype))
    return specs, survives, (inspect(model) if inspect is not None else None)


# Note [A model built in another 16-bit dtype]
# The config, not the module, chooses the training precision: a model_func that builds
# `MyModel().half()` trains in fp32 without an fp16/bf16 section (and in bf16 with bf16 enabled),
# its values converted exactly into the chunks. A PyTorch user who wrote `.half()` expects fp16
# training, and saw nothing until an fp16 input met the fp32 parameters. initialize() says so
# once, naming a parameter, its dtype, the precision trained and the config key; fp32 models
# under fp16/bf16 (the usual case) are not mentioned.
def built_dtype_warning(specs: list[ParamSpec], precision: str,
                        compute_dtype: torch.dtype) -> str | None:
    """The warning for parameters model_func built in a 16-bit dtype other than the one the
    config trains in (Note [A model built in another 16-bit dtype]); None when there are none."""
    others = [spec for spec in specs
              if spec.dtype in (torch.float16, torch.bfloat16) and spec.dtype != compute_dtype]
    if not others:
        return None
    built = others[0].dtype
    key = "fp16" if built == torch.float16 else "bf16"
    return (f"patrickstar.initialize: model_func built {len(others)} of {len(specs)} parameters "
            f"in {built} (e.g. '{others[0].name}'), but the config trains in {precision}, so "
            f"they are converted to {compute_dtype} and the forward computes in it (cast the "
            f"inputs to match). To train in {built}, set config '{key}': {{'enabled': true}}")


# Note [Modules built before initialize()]
# DeepSpeed's initialize(model=...) and FSDP's fully_shard(module) take a module already built,
# so `initialize(module)` (and a model_func returning a module built outside it, or one holding
# such submodules, e.g. a pretrained backbone under a new head) is accepted: parameters that
# exist before model_func runs raise no registration event in either pass, so they are placed as
# Note [Parameters no hook saw] places deep copies, after model_func returns, in the module's
# named_parameters() order, and their original storage is freed as each moves into its slot.
# The Parameter objects stay the same ones (param groups and optimizers built from
# `module.parameters()` before initialize() still name them), and the module becomes the
# engine's `module`. A module whose parameters an engine already took holds placeholders
# (empty, their real shape in `ds_shape`): planning from those would drop every parameter as
# element-free, so _check_not_taken refuses it.
# Note [A built module given back when initialize() fails]
# A module passed in built has its parameters moved into chunks as the engine is made, and each
# becomes a shape-(0,) placeholder. When initialize() then failed (a param_groups callable that
# raised is the usual case), the error said so in a note, but the module was left with the
# placeholders: a plain forward on it afterwards failed deep in torch ("mat2 must be a matrix").
# Where the failure comes once the chunks hold every weight (the engine's late steps: its
# hooks, param groups, optimizer), the engine reads each weight back out of its chunks (the
# master copy where there is one), destroys itself (its module hooks go, and its gradient
# hooks, which would drop every p.grad of the plain module) and hands the values here: each
# Parameter object gets its value back in its own dtype and device, the buffers their original
# tensors (the engine moves them to its device and, in fp16/bf16, casts them), and the DeepSpeed
# attributes ds_shape/ds_numel go. The module is then as it was passed in, and can be trained
# plainly or initialized again. Earlier failures (while placing) and data parallelism (each
# rank holds a shard of the chunks: reading them back is a collective) keep the note instead.
class BuiltModule:
    """The model_func of a module built before initialize() (the engine tells it apart:
    Note [The first rank's initial weights] in first_rank_init.py). It remembers what the
    engine changes of the module besides the parameters' values, to give it back (Note [A built
    module given back when initialize() fails])."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._buffers = [(owner, name, buffer) for owner in module.modules()
                         for name, buffer in owner.named_buffers(recurse=False)]
        self._kinds = {id(param): (param.dtype, param.device) for param in module.parameters()}

    def __call__(self) -> nn.Module:
        return self.module

    def give_back(self, values: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Each parameter's value (as read from the chunks) back as its data, and the buffers
        as they were passed in."""
        with torch.no_grad():
            for param, value in values:
                dtype, device = self._kinds.get(id(param), (value.dtype, value.device))
                param.data = value.to(dtype=dtype, device=device)
                for attribute in ("ds_shape", "ds_numel"):
                    param.__dict__.pop(attribute, None)
            # Parameters without elements took the compute dtype (Note [Parameters without
            # elements follow the compute dtype] in engine.py).
            for param in self.module.parameters():
                if param.numel() == 0 and id(param) in self._kinds:
                    dtype, device = self._kinds[id(param)]
                    param.data = param.data.to(dtype=dtype, device=device)
        for owner, name, buffer in self._buffers:
            setattr(owner, name, buffer)


def _check_not_taken(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        shape = getattr(param, "ds_shape", None)
        with torch._C.DisableTorchFunctionSubclass():  # its data, not what it answers at rest
            data = param.data
        if shape is not None and data.numel() != shape.numel():
            raise RuntimeError(
                f"parameter '{name}' already belongs to a PatrickStar engine (its data moved into "
                f"that engine's chunks; here it is a placeholder of shape {tuple(data.shape)}, "
                f"its real shape is {tuple(shape)}): a module can be initialized once. Build a "
                f"new one (initialize(lambda: MyModel(cfg))), or copy the trained weights out "
                f"with model.state_dict() first")


# Note [Parameters no hook saw]
# A parameter can reach the finished model without a registration event: `copy.deepcopy` of a
# module copies its `_parameters` dict directly (nn.TransformerEncoder and nn.TransformerDecoder
# clone the layer they are given that way; so do user models that stack copies of one block).
# Such parameters, in the model's named_parameters() order, follow the registered ones in the
# specs, and pass 2 places them once model_func has returned (ParameterPlacer.build): the same
# parameters in the same order both times, as the model is built the same way. Until then they
# are ordinary CPU tensors, so a model made mostly of copies holds those copies in host memory
# once during its build, as plain PyTorch does.
def _unregistered(model: nn.Module, registered: Callable[[nn.Parameter], bool]
                  ) -> list[tuple[str, nn.Parameter]]:
    """Parameters of `model` with elements for which `registered(param)` is false."""
    return [(name, param) for name, param in model.named_parameters()
            if not registered(param) and param.numel() > 0]


# Note [Parameters resized while building]
# Code in model_func may give a registered parameter new data of another shape: Hugging Face's
# resize_token_embeddings() builds a larger embedding, then points the old Parameter's `.data`
# at the new weights (the Parameter object survives with the new shape). Pass 1 plans the
# parameter from its final shape, so at its registration in pass 2 (old shape) it cannot take
# its slot yet: a parameter whose shape differs from its spec stays an ordinary tensor until
# model_func returns and is placed then, from its final data. A parameter that was placed but
# whose `.data` model_func later replaced by a same-shape tensor (`p.data = t`) is no longer a
# view of its slot, whose bytes are stale: the engine copies the final data into the slot before
# the build ends (PatrickStarEngine._take_replaced_data).
_SAME_MODEL_EVERY_TIME = (
    "it must build the same model every time it is called (it runs twice: state it changes, "
    "such as a Hugging Face config that resize_token_embeddings() updates, must be copied "
    "inside it)")


class ParameterPlacer:
    """Pass 2: a context manager under which `model_func()` runs for real; `place(index, param)`
    is called for each surviving parameter as it is registered (or, resized, once model_func
    returned) and must return the tensor that becomes its `.data` (a view of chunk memory).
    `shapes` are the surviving parameters' final shapes from pass 1."""

    def __init__(self, survives: list[bool], shapes: list[tuple[int, ...]],
                 place: Callable[[int, nn.Parameter], torch.Tensor]):
        self._survives = survives
        self._shapes = shapes
        self._place = place
        self._event = 0
        self._placed = 0
        # Note [Parameters resized while building]: (index, parameter, name).
        self._resized: list[tuple[int, nn.Parameter, str]] = []
        # Registered parameters by id, held weakly: a parameter replaced by a tied one dies at
        # once, and its id may then be reused by the next parameter created, which a plain set
        # of ids would take for one already seen (and the placement would shift by one).
        self._seen: dict[int, weakref.ref] = {}
        self.parameters: list[nn.Parameter | None] = [None] * len(shapes)
        # index -> the memory format a parameter was placed from (Note [Memory formats of
        # parameters] in memory_formats.py)
        self.formats: dict[int, str] = {}
        # Parameters whose slot is narrower than the dtype they were built in, by id (held
        # weakly, as _seen): Note [Initializers in the built dtype] in wide_init.py.
        self._narrowed: dict[int, tuple[weakref.ref, torch.dtype]] = {}

    def _hook(self, module, name, param):
        if param is None:
            return None
        if self._was_registered(param):
            return None
        replaced = _recreated(module, name, param, self._was_registered)
        if replaced is not None:  # Note [A parameter re-created in another dtype]
            return replaced
        self._seen[id(param)] = weakref.ref(param)
        if self._event >= len(self._survives):
            raise RuntimeError("model_func registered more parameters than on its first run; "
                               + _SAME_MODEL_EVERY_TIME)
        alive = self._survives[self._event]
        self._event += 1
        if alive:
            self._place_next(param, f"{type(module).__name__}.{name}")
        return None

    def _place_next(self, param: nn.Parameter, name: str) -> None:
        index = self._placed
        self._placed += 1
        if is_lazy(param) or tuple(param.shape) != self._shapes[index]:
            self._resized.append((index, param, name))
        else:
            self._place_at(index, param, name)

    def _place_at(self, index: int, param: nn.Parameter, name: str) -> None:
        if param.is_meta:
            raise RuntimeError(
                f"parameter {index} ('{name}', shape {tuple(param.shape)}) is on the meta "
                f"device, which holds no values to put in chunks. Build the model on "
                f"the CPU inside model_func: initialize() already builds it chunk by chunk, so "
                f"host memory stays near the chunks' size without torch.device('meta') or "
                f"accelerate's init_empty_weights(); for a meta-built model, give it weights "
                f"first (model.to_empty(device='cpu') and load_state_dict or init)")
        kind = format_name(param.data)
        if kind is not None:
            self.formats[index] = kind
        with torch.no_grad():
            view = self._place(index, param)
            built = param.dtype
            view.copy_(param.data)
            param.data = view
        if built.is_floating_point and torch.finfo(built).bits > torch.finfo(view.dtype).bits:
            self._narrowed[id(param)] = (weakref.ref(param), built)
        self.parameters[index] = param

    def _built_dtype(self, tensor: torch.Tensor) -> torch.dtype | None:
        """The dtype a placed parameter was built in when its slot is narrower, else None."""
        entry = self._narrowed.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _was_registered(self, param: nn.Parameter) -> bool:
        seen = self._seen.get(id(param))
        return seen is not None and seen() is param

    def build(self, model_func: Callable[[], nn.Module]) -> nn.Module:
        with _registration_hook(self._hook), initializers_in_built_dtype(self._built_dtype):
            model = _call_model_func(model_func)
        if self._event != len(self._survives):
            raise RuntimeError("model_func registered fewer parameters than on its first run; "
                               + _SAME_MODEL_EVERY_TIME)
        for name, param in _unregistered(model, self._was_registered):  # Note [Parameters no...]
            self._place_next(param, name)
        for index, param, name in self._resized:
            if tuple(param.shape) != self._shapes[index]:
                raise RuntimeError(
                    f"model_func built parameter {index} with shape {tuple(param.shape)} but "
                    f"{self._shapes[index]} on its first run; " + _SAME_MODEL_EVERY_TIME)
            self._place_at(index, param, name)
        return model


class InitResidency:
    """Which parameter slots stay accessed during initialization: Note [Initialization under a
    host budget]. `access(index)` must return the slot's view (accessing its chunk) and raise
    `out_of_memory` when the tier is full; `release(index)` releases it."""

    def __init__(self, access: Callable[[int], torch.Tensor], release: Callable[[int], None],
                 out_of_memory: type[BaseException]):
        self._access = access
        self._release = release
        self._out_of_memory = out_of_memory
        self._live: collections.OrderedDict[int, nn.Parameter] = collections.OrderedDict()
        self._deferred: dict[int, tuple[nn.Parameter, type, torch.Size]] = {}
        self._views: dict[int, torch.Tensor] = {}  # each live slot's view, as its param's .data
        self.deferrals = 0  # how many times a parameter was released early (tests, logs)

    def place(self, index: int, param: nn.Parameter) -> torch.Tensor:
        """The view a newly registered parameter becomes."""
        view = self._access_with_room(index)
        self._live[index] = param
        self._views[index] = view.view(param.shape)
        return self._views[index]

    def view_of(self, index: int) -> torch.Tensor | None:
        """The slot view a live parameter was given; None while it is deferred."""
        return self._views.get(index)

    def _access_with_room(self, index: int) -> torch.Tensor:
        while True:
            try:
                return self._access(index)
            except self._out_of_memory:
                if not self._live:
                    raise
                self._defer(*self._live.popitem(last=False))

    def _defer(self, index: int, param: nn.Parameter) -> None:
        self._release(index)
        del self._views[index]
        shape = param.shape
        with torch._C.DisableTorchFunctionSubclass():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        original = defer(param, lambda: self._restore(index))
        self._deferred[index] = (param, original, shape)
        self.deferrals += 1

    def _restore(self, index: int) -> None:
        param, original, shape = self._deferred.pop(index)
        undefer(param, original)
        view = self._access_with_room(index)
        self._live[index] = param
        self._views[index] = view.view(shape)
        with torch._C.DisableTorchFunctionSubclass():
            param.data = self._views[index]

    def finish(self) -> None:
        """Model built: releases every slot and turns deferred parameters back into plain ones
        (their `.data` stays a placeholder; the engine manages it from here)."""
        for param, original, _ in self._deferred.values():
            undefer(param, original)
        self._deferred.clear()
        self._views.clear()
        while self._live:
            index, _ = self._live.popitem(last=False)
            self._release(index)
