"""`deepspeed.initialize()`'s keyword arguments given to `patrickstar.initialize()`.

Note [DeepSpeed's initialize() arguments]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ported script calls `patrickstar.initialize(model=net, model_parameters=net.parameters(),
config=ds_config, ...)`. Python's "unexpected keyword argument 'model_parameters'" says nothing
about what to do; here each of DeepSpeed's arguments is taken when it means the same thing here
(`model`, `config_params`, an `lr_scheduler` callable) and otherwise refused naming what to use.
`model_parameters` is refused rather than ignored even though it usually lists every parameter:
when it does not (a filtered subset), DeepSpeed would train only those, and ignoring it would
train the others too, silently.
"""
from __future__ import annotations

_REFUSED = {
    "model_parameters": "the optimizer trains every parameter with requires_grad=True (freeze "
                        "the others in model_func); for per-group lr / weight_decay pass "
                        "param_groups= (torch.optim's list of dicts, or a callable taking the "
                        "built module)",
    "optimizer": "the optimizer comes from config 'optimizer': {type: Adam/AdamW, params: "
                 "{lr, betas, eps, weight_decay}} and is returned by initialize()",
    "training_data": "build a torch.utils.data.DataLoader yourself; initialize() returns "
                     "(model, optimizer), not DeepSpeed's (engine, optimizer, loader, scheduler)",
    "collate_fn": "build a torch.utils.data.DataLoader yourself with it",
    "args": "pass the DeepSpeed config as config= (a dict or a JSON path); command-line "
            "arguments are not read",
    "mpu": "config 'parallel': {pipeline, tensor} (docs/parallelism.md)",
    "dist_init_required": "torch.distributed is initialized from torchrun's environment when "
                          "the script did not; drop the argument",
    "distributed_port": "torchrun's --master_port",
}


def take_deepspeed_arguments(model_func, config, kwargs: dict):
    """(model_func, config, lr_scheduler factory or None) from DeepSpeed's keyword
    arguments; raises TypeError naming any argument without a counterpart here."""
    kwargs = dict(kwargs)
    model = kwargs.pop("model", None)
    if model is not None:
        if model_func is not None:
            raise TypeError("initialize(): model_func and model= (DeepSpeed's name) both given; "
                            "pass one")
        model_func = model
    config_params = kwargs.pop("config_params", None)
    if config_params is not None:
        if config is not None:
            raise TypeError("initialize(): config and config_params= (DeepSpeed's older name) "
                            "both given; pass one")
        config = config_params
    scheduler = kwargs.pop("lr_scheduler", None)
    if scheduler is not None and (not callable(scheduler) or hasattr(scheduler, "step")):
        raise TypeError(
            "initialize(lr_scheduler=...): a scheduler cannot be built before initialize() "
            "returns the optimizer it drives; pass a callable taking the optimizer "
            "(lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f), as DeepSpeed "
            "also accepts) or assign model.lr_scheduler afterwards")
    for name in kwargs:
        if name in _REFUSED:
            raise TypeError(f"initialize({name}=...) is DeepSpeed's and has no counterpart in "
                            f"PatrickStar-C++: {_REFUSED[name]}")
    if kwargs:
        raise TypeError(f"initialize() got unexpected keyword argument(s) {sorted(kwargs)}; it "
                        f"takes model_func (or model=), config, local_rank, param_groups and "
                        f"lr_scheduler")
    if model_func is None:
        raise TypeError("initialize(): missing the model: pass model_func (a callable building "
                        "the module, or a built module)")
    return model_func, config, scheduler
