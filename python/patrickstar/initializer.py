"""`patrickstar.initialize()`: the user's model built on the chunk runtime, as one engine or
(for a `PipelineModule`) one pipeline stage's engine, with its optimizer."""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from .carried_state import (groups_section, optimizer_section, saved_adam_state,
                            source_optimizer)
from .config import Config, load_config, read_config
from .deepspeed_arguments import take_deepspeed_arguments
from .engine import PatrickStarEngine
from .init_context import BuiltModule, unmaterialized_parameter_error
from .optimizer import build_param_groups
from .pipe.engine import PipelineEngine
from .pipe.module import PipelineModule
from .utils.logging import log_dist

__all__ = ["initialize", "initialize_engine"]


def initialize(model_func: Callable[[], nn.Module] | nn.Module | None = None, config=None,
               local_rank: int | None = None, param_groups=None, **deepspeed_kwargs):
    """Builds `model_func()` on the chunk runtime and returns `(model, optimizer)`.

    `model_func` may also be a module already built (as DeepSpeed and FSDP take one): its
    parameters move into chunks and it becomes the engine's `module` (Note [Modules built
    before initialize()] in init_context.py). Building inside `model_func` is what keeps the
    peak host memory at the chunks' size: a built fp32 model exists in full first.

    `model_func` may also be a `patrickstar.pipe.PipelineModule`: each rank then builds only its
    pipeline stage and gets a `PipelineEngine` (train with `engine.train_batch(data_iter)`).
    `config` is a dict or a path to a JSON file (see `patrickstar.config`); `param_groups`
    optionally splits the parameters into groups with their own `lr` / `weight_decay`, either as
    torch.optim's list of dicts, as a callable taking the built module and returning one, or as
    a torch optimizer (its groups and its Adam state: Note [A torch optimizer's state goes
    with its groups] in carried_state.py; also when its `param_groups` list is given).
    `local_rank` chooses the GPU; by default (or -1) torchrun's `LOCAL_RANK` (0 without it),
    as DeepSpeed reads it (Note [The local rank from the environment]).

    DeepSpeed's keywords: `model=` and `config_params=` are `model_func` and `config`;
    `model_parameters=` (of a built module) is `param_groups`; `lr_scheduler=fn` sets
    `model.lr_scheduler = fn(optimizer)`; the others raise naming what to use (Note
    [DeepSpeed's initialize() arguments])."""
    model_func, config, param_groups, make_scheduler = take_deepspeed_arguments(
        model_func, config, param_groups, deepspeed_kwargs)
    # Note [A torch optimizer's state goes with its groups] in carried_state.py
    source = source_optimizer(param_groups)
    carried = saved_adam_state(source)
    if source is not None:
        param_groups = source.param_groups
    section = optimizer_section(source) if isinstance(source, torch.optim.Adam) else \
        groups_section(param_groups)
    if section is not None and not isinstance(config, Config):
        raw = read_config(config)
        if "optimizer" not in raw:  # (a section of its own decides, checked against them)
            config = {**raw, "optimizer": section}
    with torch.inference_mode(False):  # Note [initialize() under torch.inference_mode()]
        model, optimizer = _initialize(model_func, config, _local_rank(local_rank),
                                       param_groups)
        if carried is not None:
            if isinstance(model, PipelineEngine):
                warnings.warn("initialize(): the torch optimizer whose param_groups were given "
                              "holds Adam state, which a pipeline stage's optimizer cannot take "
                              "from a whole model's state dict: it starts without it",
                              UserWarning, stacklevel=2)
            else:
                optimizer.load_state_dict(carried)
    if make_scheduler is not None:
        if isinstance(model, PipelineEngine):
            raise TypeError("initialize(lr_scheduler=...) with a PipelineModule: train_batch() "
                            "does not step a scheduler; step it yourself after train_batch()")
        if model.lr_scheduler is not None:  # DeepSpeed would silently prefer the argument
            raise TypeError("initialize(lr_scheduler=...) and the config's 'scheduler' section "
                            "both give a scheduler; keep one")
        model.lr_scheduler = make_scheduler(optimizer)
    return model, optimizer


# Note [The local rank from the environment]
# The README's recipe is `patrickstar.initialize(model_func, config)` under `torchrun
# --nproc_per_node=N`, with no local_rank: the default was 0, so on a node with N GPUs every
# rank put its device tier, copy streams and compute on GPU 0 (N ranks' chunks in one GPU's
# memory). DeepSpeed and FSDP recipes never pass it either (DeepSpeed reads LOCAL_RANK). An
# explicit local_rank (upstream PatrickStar's initialize_engine argument) still wins, except
# -1: the `--local_rank` default of upstream's and Hugging Face's scripts (and
# TrainingArguments.local_rank) when no launcher passed one, "not distributed" in torch's
# convention, which was refused as "must be a non-negative int"; it reads the environment too.
def _local_rank(local_rank: int | None) -> int:
    if local_rank is not None and not (local_rank == -1 and not isinstance(local_rank, bool)):
        return local_rank
    text = os.environ.get("LOCAL_RANK")
    if text is None:
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK must be a non-negative int (torchrun "
                         f"sets it), got {text!r}; or pass initialize(local_rank=...)") from None


def _initialize(model_func, config, local_rank: int, param_groups):
    if isinstance(model_func, PipelineModule):  # one engine per stage (pipe/engine.py)
        engine = PipelineEngine(model_func, config, local_rank, param_groups)
        _log_if_default_optimizer(engine.config)
        return engine, engine.optimizer
    built = None
    if isinstance(model_func, nn.Module):  # Note [Modules built before initialize()]
        built = model_func
        model_func = BuiltModule(built)
        config = load_config(config)  # parsed once (it warns once per key)
        param_groups = _checked_before_placement(built, param_groups, config)
    elif not callable(model_func):
        raise TypeError("initialize(model_func, ...): model_func must be a callable that builds "
                        "and returns the model (e.g. a class or a lambda) or a built "
                        f"torch.nn.Module, not {type(model_func).__name__}")
    if not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank must be a non-negative int, got {local_rank!r}")
    if not isinstance(config, Config):
        config = load_config(config)
    sizes = [p.numel() for p in built.parameters()] if built is not None else None
    try:
        engine = PatrickStarEngine(model_func, config, local_rank, param_groups)
    except Exception as error:
        if sizes is not None and sizes != [p.numel() for p in built.parameters()]:
            error.add_note("initialize() had moved parameters of the module passed in into "
                           "chunks when this failed, so that module no longer holds its "
                           "weights: build it again (or pass a model_func, which builds it "
                           "inside initialize())")
        raise
    _warn_if_nothing_sliced(engine, config)
    _log_if_default_optimizer(config)
    return engine, engine.optimizer


# Note [A config without an optimizer]
# The engine always trains with its own chunked Adam (it has no other optimizer; DeepSpeed's
# `optimizer=` client Adam gives it its groups, state and config section: Note [DeepSpeed's
# client optimizer] in deepspeed_arguments.py). A config without an 'optimizer'
# section got torch.optim.Adam's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight
# decay) without a word. Neither reference does that silently the same way: DeepSpeed's
# initialize() with no optimizer in the config and none passed returns no optimizer (None; under
# ZeRO a wrapper whose step updates nothing), and upstream PatrickStar's engine filled in Adam
# at lr 0.01. Returning None here would break every `model, optimizer = initialize(...)` loop
# that relied on the default, so the default stays (upstream's behaviour, torch's and
# DeepSpeed's Adam defaults) and initialize() says so on rank 0, naming what trains and the
# section that chooses it. Said once per process: a script building engines in a loop (a sweep,
# a test suite) heard the same paragraph at every initialize().
def _log_if_default_optimizer(config: Config) -> None:
    global _logged_default_optimizer
    if config.optimizer_given or _logged_default_optimizer:
        return
    _logged_default_optimizer = True
    opt = config.optimizer
    log_dist(f"config has no 'optimizer' section: training {opt.type} with lr {opt.lr:g}, "
             f"betas {opt.betas}, eps {opt.eps:g}, weight_decay {opt.weight_decay:g} "
             f"(torch.optim.Adam's defaults). DeepSpeed would return no optimizer for this "
             f"config and upstream PatrickStar used Adam at lr 0.01; add an 'optimizer' section "
             f"(e.g. {{\"type\": \"AdamW\", \"params\": {{\"lr\": 1e-4}}}}) to choose, which "
             f"also silences this", level=logging.WARNING)


_logged_default_optimizer = False  # _log_if_default_optimizer's message, once per process


def _warn_if_nothing_sliced(engine, config: Config) -> None:
    """`parallel.tensor` > 1 slices only the layers of patrickstar.tensor_parallel
    (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding); PatrickStar does not
    slice an ordinary model by itself (as DeepSpeed's AutoTP would), so a Hugging Face model
    trained that way is copied whole onto every tensor rank, which then compute the same thing
    and hold the same memory: say so rather than let the run look sliced."""
    tensor = config.parallel.tensor
    if tensor is None or tensor <= 1:
        return
    if any(getattr(param, "tensor_model_parallel", False) for param in engine.module.parameters()):
        return
    warnings.warn(f"config key 'parallel.tensor' is {tensor} but the model "
                  f"({type(engine.module).__name__}) has no sliced parameters: PatrickStar does "
                  "not slice a model by itself, only its patrickstar.tensor_parallel layers "
                  "(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) are "
                  f"sliced, so each of the {tensor} tensor ranks holds and computes the whole "
                  "model. Build the model from those layers (see "
                  "patrickstar.examples.gpt_parallel), or leave parallel.tensor at 1 and let "
                  "the ranks be data-parallel", UserWarning, stacklevel=4)


# Note [initialize() under torch.inference_mode()]
# A script that loads a model for evaluation inside `with torch.inference_mode():` built the
# engine there, and initialize() failed in the parameter slots with c10's "Inference tensors do
# not track version counter" and a page of C++ frames. The engine's parameters are its own
# placeholders over chunk memory, never the user's tensors, so initialize() builds everything
# with inference mode off: the engine then runs forwards in and out of inference mode, and
# trains (PyTorch's module built there evaluates but fails at its first training step). A module
# passed in built under inference mode holds inference tensors, which cannot become parameters
# autograd tracks: refused, naming one, before anything moves.
def _checked_before_placement(built: nn.Module, param_groups, config):
    """A built module's parameters move into chunks as the engine is made, so a mistake found
    after that would leave the caller's module without its weights: inference tensors (Note
    [initialize() under torch.inference_mode()]) are refused, and torch.optim-style groups
    (from its own parameters, e.g. DeepSpeed's model_parameters) are checked first, as the
    engine will check them; the checked groups (each "params" listed: a generator is consumed
    by the check) go on to the engine."""
    message = unmaterialized_parameter_error(built, "the module passed to initialize()")
    if message is not None:  # Note [Lazy modules] in init_context.py
        raise ValueError(message)
    inference = next((name for name, param in built.named_parameters() if param.is_inference()),
                     None)
    if inference is not None:
        raise TypeError(f"parameter '{inference}' of the module passed to initialize() is an "
                        f"inference tensor (the module was built under torch.inference_mode()), "
                        f"which autograd cannot track: build the module outside inference mode, "
                        f"or pass a model_func (initialize() builds it with inference mode off)")
    if param_groups is None or callable(param_groups):
        return param_groups  # a callable sees the built engine's shapes
    return build_param_groups(built, param_groups, config.optimizer)


def initialize_engine(model_func: Callable[[], nn.Module], local_rank: int | None = None,
                      config=None, client=None, param_groups=None):
    """`initialize()` under PatrickStar's name and argument order. Upstream's fourth argument,
    a prebuilt `PatrickStarClient`, has no counterpart: the engine builds its chunk runtime
    from `config`."""
    if client is not None:
        raise TypeError("initialize_engine(client=...): upstream PatrickStar's "
                        "PatrickStarClient does not exist in PatrickStar-C++; the engine builds "
                        "its own chunk runtime from config (memory.*), so drop the argument and "
                        "build the model inside model_func")
    if param_groups is None:  # (groups may give their own lr)
        _warn_if_lr_defaults(config)
    return initialize(model_func, config=config, local_rank=local_rank,
                      param_groups=param_groups)


def _warn_if_lr_defaults(config) -> None:
    """Upstream's engine filled a missing optimizer lr with 0.01 (eps 1e-8); here the default is
    torch's and DeepSpeed's 1e-3, so an upstream script that relied on it would train at a tenth
    of its rate without a word. Only a dict (or no config) is looked at: a JSON path is
    DeepSpeed's way, whose default is this one."""
    if config is not None and not isinstance(config, Mapping):
        return
    optimizer = (config or {}).get("optimizer", {})
    params = optimizer.get("params", {}) if isinstance(optimizer, Mapping) else None
    if isinstance(params, Mapping) and not any(  # (load_config reports other types)
            isinstance(key, str) and key.lower() == "lr" for key in params):
        warnings.warn("initialize_engine: no optimizer.params.lr in the config, so the "
                      "optimizer uses lr=1e-3 (torch's and DeepSpeed's default); upstream "
                      "PatrickStar's engine used 0.01. Give the lr to silence this",
                      UserWarning, stacklevel=3)
