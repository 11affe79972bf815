"""`deepspeed.initialize()`'s keyword arguments given to `patrickstar.initialize()`.

Note [DeepSpeed's initialize() arguments]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ported script calls `patrickstar.initialize(model=net, model_parameters=net.parameters(),
config=ds_config, ...)`. Python's "unexpected keyword argument 'model_parameters'" says nothing
about what to do; here each of DeepSpeed's arguments is taken when it means the same thing here
(`model`, `config_params`, an `lr_scheduler` callable, an `args` carrying `deepspeed_config`
from `add_config_arguments`'s flag) and otherwise refused naming what to use.
`model_parameters` (DeepSpeed's usual `model.parameters()`, or a list of param-group dicts) is
taken as `param_groups` when the model is a built module, whose Parameter objects those are:
build_param_groups then checks that every trainable parameter is in exactly one group, so a
filtered subset (which DeepSpeed would train alone) raises naming what is missing rather than
training the others too. With a model_func the parameters do not exist yet, so it is refused
naming param_groups.

`dist_init_required` is taken as DeepSpeed takes it: True or None (its default) set up
torch.distributed when the script has not, which initialize() does anyway from torchrun's
environment; False says the script already did, so a multi-process launch (WORLD_SIZE > 1)
whose default group does not exist yet raises naming the argument, as DeepSpeed's engine asserts,
rather than initialize() quietly making the group the caller said it had made.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .config import read_config

_MODEL_PARAMETERS_NEED_A_MODULE = (
    "initialize(model_parameters=...) is DeepSpeed's: it names parameters of a module already "
    "built, but model_func builds the model inside initialize(). Pass the built module "
    "(initialize(model=net, model_parameters=net.parameters())), or param_groups= (torch.optim's "
    "list of dicts, or a callable taking the built module); without either, every parameter "
    "with requires_grad=True is trained")

_REFUSED = {
    "training_data": "build a torch.utils.data.DataLoader yourself; initialize() returns "
                     "(model, optimizer), not DeepSpeed's (engine, optimizer, loader, scheduler)",
    "collate_fn": "build a torch.utils.data.DataLoader yourself with it",
    "mpu": "config 'parallel': {pipeline, tensor} (docs/parallelism.md)",
    "distributed_port": "torchrun's --master_port",
}


def _one_of(ours: str, ours_value, theirs: str, theirs_value, whose: str):
    """The value given under our name or under DeepSpeed's (`whose` says which name that is),
    not both."""
    if theirs_value is None:
        return ours_value
    if ours_value is not None:
        raise TypeError(f"initialize(): {ours} and {theirs}= ({whose}) both given; pass one")
    return theirs_value


def take_deepspeed_arguments(model_func, config, param_groups, kwargs: dict):
    """(model_func, config, param_groups, lr_scheduler factory or None) from DeepSpeed's
    keyword arguments; raises TypeError naming any argument without a counterpart here."""
    kwargs = dict(kwargs)
    model_func = _one_of("model_func", model_func, "model", kwargs.pop("model", None),
                         "DeepSpeed's name")
    config = _one_of("config", config, "config_params", kwargs.pop("config_params", None),
                     "DeepSpeed's older name")
    scheduler = kwargs.pop("lr_scheduler", None)
    if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
        raise TypeError(
            "initialize(lr_scheduler=...): a scheduler cannot be built before initialize() "
            "returns the optimizer it drives; pass a callable taking the optimizer "
            "(lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f), as DeepSpeed "
            "also accepts) or assign model.lr_scheduler afterwards")
    if "model_parameters" in kwargs:
        model_parameters = kwargs.pop("model_parameters")
        if param_groups is not None:
            raise TypeError("initialize(): param_groups and model_parameters= (DeepSpeed's "
                            "name) both given; pass one")
        if not isinstance(model_func, torch.nn.Module):
            raise TypeError(_MODEL_PARAMETERS_NEED_A_MODULE)
        param_groups = _as_param_groups(model_parameters)
    if "args" in kwargs:
        config = _config_from_args(kwargs.pop("args"), config)
    if "optimizer" in kwargs:
        client = kwargs.pop("optimizer")
        if callable(client) and not isinstance(client, torch.optim.Optimizer):
            client = _client_from_callable(client, model_func, param_groups)
            param_groups = None  # (the callable was given them)
        if param_groups is not None:
            raise TypeError("initialize(): optimizer= (DeepSpeed's client optimizer, whose "
                            "groups are taken) and param_groups / model_parameters= both give "
                            "the groups; pass one")
        _check_client_optimizer(client, config)
        param_groups = client  # (initialize() takes its config section with its groups)
    if "dist_init_required" in kwargs:
        _check_dist_init_required(kwargs.pop("dist_init_required"))
    for name in kwargs:
        if name in _REFUSED:
            raise TypeError(f"initialize({name}=...) is DeepSpeed's and has no counterpart in "
                            f"PatrickStar-C++: {_REFUSED[name]}")
    if kwargs:
        raise TypeError(f"initialize() got unexpected keyword argument(s) {sorted(kwargs)}; it "
                        f"takes model_func (or model=), config, local_rank, param_groups, "
                        f"lr_scheduler and dist_init_required")
    if model_func is None:
        raise TypeError("initialize(): missing the model: pass model_func (a callable building "
                        "the module, or a built module)")
    return model_func, config, param_groups, scheduler


# Note [DeepSpeed's client optimizer]
# `deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), ...),
# config=ds_config)` hands DeepSpeed the optimizer to wrap; the config then has no optimizer
# section. The engine here trains with its own chunked Adam only, so a torch Adam or AdamW is
# taken as its groups and state are (Note [A torch optimizer's state goes with its groups] in
# carried_state.py), and the config's optimizer becomes its type and defaults. A config with
# an optimizer section of its own is refused (two optimizers: which one?), and so is any other
# optimizer or a callable making one, naming what to give instead.
def _client_from_callable(make, model, model_parameters):
    """DeepSpeed's `optimizer=callable`: the optimizer it makes of `model_parameters` (the
    groups given), or of the built module's trainable parameters."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("initialize(optimizer=callable): the callable takes the model's "
                        "parameters, which model_func builds inside initialize(); pass the "
                        "built module (model=net), or a torch Adam/AdamW, or config "
                        "'optimizer'")
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    return make(model_parameters)


def _check_client_optimizer(client, config) -> None:
    """Raises unless torch Adam / AdamW `client` can stand for `config`'s optimizer."""
    if not isinstance(client, torch.optim.Adam):  # (torch's AdamW is an Adam)
        what = type(client).__name__ if isinstance(client, torch.optim.Optimizer) else \
            f"a {type(client).__name__}"
        raise TypeError(f"initialize(optimizer=...) got {what}: the engine trains with its own "
                        f"chunked Adam or AdamW only, so it takes a torch.optim.Adam or AdamW "
                        f"(its param groups and state) or config 'optimizer': {{type: Adam/"
                        f"AdamW, params: {{lr, betas, eps, weight_decay}}}}")
    if "optimizer" in read_config(config):
        raise TypeError("initialize(optimizer=...) and the config's 'optimizer' section both "
                        "give the optimizer; keep one")


def _check_dist_init_required(value) -> None:
    """DeepSpeed's `dist_init_required` (Note [DeepSpeed's initialize() arguments]): True and
    None need nothing here (initialize() makes the default group from torchrun's environment
    when there is none); False promises the caller made it."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"initialize(dist_init_required=...) must be True, False or None "
                        f"(DeepSpeed's), got {value!r}")
    if value is not False:
        return
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"initialize(dist_init_required=False) says torch.distributed is "
                           f"already initialized, but it is not (WORLD_SIZE is {world}): call "
                           f"torch.distributed.init_process_group() before initialize(), or "
                           f"pass dist_init_required=True (or leave it out) to have initialize() "
                           f"set it up from torchrun's environment")


def add_config_arguments(parser):
    """DeepSpeed's `deepspeed.add_config_arguments(parser)`: adds `--deepspeed` (accepted, no
    effect: the engine is always on) and `--deepspeed_config PATH`, which
    `initialize(args=args)` reads as its config. Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="accepted for DeepSpeed's scripts; PatrickStar-C++ is always on")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed / PatrickStar json configuration file")
    return parser


def _config_from_args(args, config):
    """The config a DeepSpeed script gives as `initialize(args=args)`: its deepspeed_config
    (add_config_arguments's flag), or config= when args has none. DeepSpeed refuses both
    together too."""
    path = getattr(args, "deepspeed_config", None)
    if path is None and config is not None:
        return config  # DeepSpeed-Chat's call: the rest of args does not reach training
    if path is None:
        raise TypeError("initialize(args=...) is DeepSpeed's: args has no deepspeed_config (the "
                        "--deepspeed_config flag of patrickstar.add_config_arguments(parser)); "
                        "pass the config as config= (a dict or a JSON path)")
    if config is not None:
        raise TypeError(f"initialize(): config= and args.deepspeed_config ({path!r}) both give "
                        f"the config; pass one")
    return path


def _as_param_groups(model_parameters) -> list:
    """torch.optim's forms, as DeepSpeed hands them to its optimizer: parameters (a generator
    is consumed once here) or a list of group dicts."""
    if isinstance(model_parameters, torch.Tensor):
        model_parameters = [model_parameters]
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        return items
    return [{"params": items}]
