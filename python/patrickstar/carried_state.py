"""The Adam state of a torch optimizer whose groups `initialize()` takes, carried into the
engine's optimizer.

Note [A torch optimizer's state goes with its groups]
nanoGPT's train.py resumes in this order: `optimizer = model.configure_optimizers(...)`,
`optimizer.load_state_dict(checkpoint['optimizer'])`, then wraps the model in DDP. Ported, the
DDP line becomes `model, optimizer = patrickstar.initialize(model, config,
param_groups=optimizer.param_groups)` (the README's recipe for those groups). Under DDP the
torch optimizer and its loaded moments go on training; here the engine's optimizer replaces it,
and it started from empty state without a word: the resumed run trained away from the
uninterrupted one. So when the groups given are a torch optimizer's (its `param_groups` list
itself, or the optimizer, as DeepSpeed's `optimizer=` gives one) and it holds Adam state, that
state is loaded into the engine's optimizer once it is built, as `optimizer.load_state_dict`
would (its checks and its numbering). A torch optimizer is found from its `param_groups` list
by the objects that refer to that list (the list is the optimizer's attribute), once, at
initialize(); a list of groups built by hand has no such owner. State that is not Adam's (SGD's
momentum buffers) cannot be carried: a warning says it is dropped. A config without an
'optimizer' section takes the torch Adam's or AdamW's type and defaults (its AdamW groups were
refused against the default Adam), as DeepSpeed's `optimizer=` does; so does one given the
groups of a torch optimizer already gone (`torch.optim.AdamW(...).param_groups`), by the
`decoupled_weight_decay` every torch Adam's and AdamW's group carries.
"""
from __future__ import annotations

import gc
import warnings

import torch

__all__ = ["source_optimizer", "saved_adam_state", "optimizer_section", "groups_section"]


def source_optimizer(param_groups) -> torch.optim.Optimizer | None:
    """The torch optimizer whose groups `param_groups` is (the optimizer itself, or its
    `param_groups` list), else None."""
    if isinstance(param_groups, torch.optim.Optimizer):
        return param_groups
    if not isinstance(param_groups, list) or not param_groups or \
            not all(isinstance(group, dict) for group in param_groups):
        return None
    for referrer in gc.get_referrers(param_groups):
        if isinstance(referrer, torch.optim.Optimizer) and \
                getattr(referrer, "param_groups", None) is param_groups:
            return referrer
        if isinstance(referrer, dict):  # an instance dict: its owner refers to it
            for owner in gc.get_referrers(referrer):
                if isinstance(owner, torch.optim.Optimizer) and \
                        getattr(owner, "param_groups", None) is param_groups:
                    return owner
    return None


def saved_adam_state(source: torch.optim.Optimizer | None) -> dict | None:
    """`source.state_dict()` when it holds Adam state to carry; None when it holds none (a
    warning when it holds state of another kind)."""
    if source is None or not source.state:
        return None
    entries = [entry for entry in source.state.values() if entry]
    if not entries or not all("exp_avg" in entry and "exp_avg_sq" in entry for entry in entries):
        kinds = sorted({key for entry in entries for key in entry})
        warnings.warn(f"initialize(): the {type(source).__name__} whose param_groups were given "
                      f"holds state that is not Adam's ({kinds}); the engine's Adam optimizer "
                      f"starts without it", UserWarning, stacklevel=4)
        return None
    return source.state_dict()


def optimizer_section(source: torch.optim.Adam) -> dict:
    """The config's 'optimizer' section that trains as torch Adam / AdamW `source` does: its
    type and its defaults (a config without one takes it: Note [DeepSpeed's client optimizer]
    in deepspeed_arguments.py)."""
    defaults = source.defaults
    decoupled = bool(defaults.get("decoupled_weight_decay",
                                  isinstance(source, torch.optim.AdamW)))
    return {"type": "AdamW" if decoupled else "Adam", "params": {
        "lr": float(defaults["lr"]), "betas": [float(beta) for beta in defaults["betas"]],
        "eps": float(defaults["eps"]), "weight_decay": float(defaults["weight_decay"])}}


def groups_section(param_groups) -> dict | None:
    """The 'optimizer' section (its type) of groups that say which torch Adam made them (their
    `decoupled_weight_decay`), else None."""
    if not isinstance(param_groups, list) or not param_groups:
        return None
    kinds = {group.get("decoupled_weight_decay") if isinstance(group, dict) else None
             for group in param_groups}
    if len(kinds) != 1 or not isinstance(next(iter(kinds)), bool):
        return None
    return {"type": "AdamW" if kinds.pop() else "Adam"}
