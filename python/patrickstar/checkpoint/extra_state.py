"""The per-rank extra file (`rank_<r>_extra.pt`): RNG states, client_state and the lr
scheduler's state, in torch's format but read with `weights_only=True`.

Note [Checkpoints are data]
Loading a checkpoint must never run code from it: meta.json's checksums only catch damage, not
an edit (whoever can write the directory can rewrite them), so the trust placed in a checkpoint
directory is that of a data file. Shards are raw tensors behind a JSON header. The extra file
is read with `torch.load(weights_only=True)`, whose unpickler builds only tensors, numbers,
strings, None and containers and refuses anything else, so a crafted file fails with
`CheckpointError` instead of executing. numpy's RNG state holds an ndarray, which that
unpickler does not build, so it is stored as a tensor and rebuilt; so are the objects of
client_state and the scheduler's state that Note [Client state as plain data] (plain_data.py)
writes as marked dicts. A save checks that its extra file loads back this way before writing
it: a `client_state` holding other objects is refused at save time, naming its entry, rather
than written into a checkpoint that cannot be loaded.
"""
from __future__ import annotations

import argparse
import io
import pickle
import re

import torch

from .errors import CheckpointError
from .plain_data import from_plain, to_plain

__all__ = ["encode_extra", "decode_extra"]


def _plain_rng(states: dict) -> dict:
    result = dict(states)
    numpy_state = states.get("numpy")
    if numpy_state is not None:
        name, keys, position, has_gauss, cached = numpy_state
        result["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")),
                           "position": int(position), "has_gauss": int(has_gauss),
                           "cached_gaussian": float(cached)}
    return result


def _numpy_rng(states: dict) -> dict:
    result = dict(states)
    plain = states.get("numpy")
    if isinstance(plain, dict):
        import numpy
        result["numpy"] = (plain["name"], plain["keys"].numpy().astype(numpy.uint32),
                           plain["position"], plain["has_gauss"], plain["cached_gaussian"])
    return result


_REFUSED = (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError)
# torch.save of what pickle cannot write at all (a lambda, a class defined in a function).
_UNWRITABLE = (pickle.PicklingError, AttributeError, TypeError)


def _why(error: BaseException) -> str:
    """The object torch's weights_only unpickler refused, or its first line."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if found:
        return f"it names {found.group(1)}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _load(data, what: str) -> dict:
    try:
        extra = torch.load(data, weights_only=True)
    except _REFUSED as error:
        raise CheckpointError(
            f"{what}: it holds objects other than tensors, numbers, strings and containers, so "
            f"loading it could run code from the checkpoint (Note [Checkpoints are data]); "
            f"refused ({_why(error)})") from None
    if not isinstance(extra, dict) or not {"rng", "client_state"} <= set(extra):
        raise CheckpointError(f"{what}: not a PatrickStar extra state file")
    return extra


def encode_extra(rng: dict, client_state, scheduler_state) -> bytes:
    """The file's bytes; raises CheckpointError when they would not load without pickle."""
    extra = {"rng": _plain_rng(rng), "client_state": to_plain(client_state),
             "lr_scheduler": to_plain(scheduler_state)}
    try:
        data = _saved(extra)
        torch.load(io.BytesIO(data), weights_only=True)
    except (*_REFUSED, *_UNWRITABLE) as error:
        part = "client_state"
        if scheduler_state is not None and _loads_back(client_state):
            part = "lr scheduler state"
        else:  # name the entry of a client_state of many (a numpy array among tensors)
            part = _refused_entry(client_state, "client_state") or part
        raise CheckpointError(
            f"save_checkpoint: the {part} holds an object a checkpoint cannot load back without "
            f"running code ({_why(error)}); keep to tensors, numbers, strings, None, lists, "
            f"tuples, dicts, argparse.Namespace, numpy arrays and scalars, enum members and "
            f"paths (Note [Checkpoints are data], Note [Client state as plain data])") from None
    return data


def _refused_entry(value, path: str) -> str | None:
    """The path (`client_state['stats'][2]`, `client_state['args'].tokenizer`) of the first
    entry of `value` that would not load back, searched through dicts, lists, tuples and
    Namespaces; None if no single entry is to blame."""
    if isinstance(value, dict):
        items = ((f"{path}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, argparse.Namespace):
        items = ((f"{path}.{name}", item) for name, item in vars(value).items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for where, item in items:
        if not _loads_back(item):
            return _refused_entry(item, where) or where
    return None


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads_back(value) -> bool:
    """Whether `value`, written as plain data, loads back without pickle."""
    try:
        torch.load(io.BytesIO(_saved(to_plain(value))), weights_only=True)
    except (*_REFUSED, *_UNWRITABLE):
        return False
    return True


def decode_extra(path: str) -> dict:
    """The extra state of a verified file, without unpickling anything but plain data."""
    with open(path, "rb") as handle:
        extra = _load(handle, f"checkpoint file '{path}'")
    extra["rng"] = _numpy_rng(extra["rng"])
    extra["client_state"] = from_plain(extra["client_state"], f"file '{path}': client_state")
    extra["lr_scheduler"] = from_plain(extra["lr_scheduler"],
                                       f"file '{path}': lr scheduler state")
    return extra
