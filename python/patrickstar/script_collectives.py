"""The script's own torch.distributed collectives, agreed on with the data-parallel engines.

Note [The script's own collectives]
Note [Every rank runs the same forwards] in data_parallel.py makes a forward or state-dict read
on one rank alone raise at once on every rank, but only when the other ranks' next call is one
of the engine's too. The usual DDP script pairs the work on rank 0 with a collective of its
own instead: `if rank == 0: torch.save(model.state_dict(), path)` then `dist.barrier()`, or
rank 0 evaluates and broadcasts an early-stopping flag with `dist.broadcast(flag, 0)`. Rank 0
then waited in the engine's agreement (on the engine's communicator) and the others in the
script's barrier (on torch's process group): neither could finish, and both sat out the whole
`parallel.collective_timeout` (300 s by default) before an error that could only guess the
cause. So `install()` (run by `initialize()`) wraps the torch.distributed collectives a script
calls (`torch.distributed.barrier`, `all_reduce`, `broadcast`, ...): over the default group,
from the main thread, outside any forward or backward, each first joins the agreement of the
live data-parallel engines (once: Note [Several engines in one process] in process_engines.py)
as a call kind of its own, and ranks that are not making the same
call raise at once, naming what each one runs. Calls made from inside patrickstar (its
checkpoints, pipeline and tensor-parallel exchanges), from other threads, on other groups or
within a forward or backward (SyncBatchNorm) are passed to torch untouched. Cost: one small
all-reduce on the engine's communicator per collective of the script. A script that imported
the functions by name before patrickstar (`from torch.distributed import barrier`) keeps torch's.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading

import torch
import torch.distributed as dist

from . import process_engines

__all__ = ["KINDS", "install"]

_NAMES = ("barrier", "monitored_barrier", "all_reduce", "broadcast", "reduce", "all_gather",
          "all_gather_into_tensor", "all_gather_object", "broadcast_object_list", "gather",
          "gather_object", "scatter", "scatter_object_list", "reduce_scatter",
          "reduce_scatter_tensor", "all_to_all", "all_to_all_single")
# Call kinds of data_parallel's agreement (0..3 are the engine's own calls).
KINDS = {4 + i: f"torch.distributed.{name}() of the script" for i, name in enumerate(_NAMES)}
_KIND_OF = {name: 4 + i for i, name in enumerate(_NAMES)}

def _from_the_script(group) -> bool:
    if group is not None and group is not dist.group.WORLD:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    # Inside any backward (the autograd engine's graph task): a collective of a module's
    # backward, which every rank runs in step with the engine's own.
    if torch._C._current_graph_task_id() != -1:
        return False
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return not (caller == "patrickstar" or caller.startswith("patrickstar."))


def _group(signature, args, kwargs):
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:  # torch's own call will say what is wrong with the arguments
        return None


def _wrap(name: str, function):
    kind = _KIND_OF[name]
    signature = inspect.signature(function)

    @functools.wraps(function)
    def collective(*args, **kwargs):
        # One agreement for the process, whatever number of engines it has; none inside any
        # engine's forward (a module's own collective, run in step on every rank). Note
        # [Several engines in one process] in process_engines.py.
        parties = process_engines.parties()
        if parties and not any(party.in_forward for party in parties) \
                and _from_the_script(_group(signature, args, kwargs)):
            parties[0].agree_on_script_collective(kind)
        return function(*args, **kwargs)
    collective.__wrapped_collective__ = function
    return collective


def install() -> None:
    """Wraps the collectives where scripts look them up, `torch.distributed.<name>` (idempotent)."""
    for name in _NAMES:
        function = getattr(dist, name, None)
        if function is None or hasattr(function, "__wrapped_collective__"):
            continue
        setattr(dist, name, _wrap(name, function))
