"""A checkpoint's client_state as plain data: the Python objects training scripts put there
that `torch.load(weights_only=True)` does not build, written as marked dicts and rebuilt at
load.

Note [Client state as plain data]
DeepSpeed pickles client_state, and scripts ported from it save what pickle takes: Megatron's
`{"args": argparse.Namespace, "iteration": it, "rng_state": {"np_rng_state":
numpy.random.get_state(), ...}}`, numpy arrays and scalars (a metric's `numpy.float64`), enum
members. Note [Checkpoints are data] refused them at save. `to_plain` writes each as a dict
`{MARK: kind, ...}` of tensors, numbers and strings, and `from_plain` rebuilds the same type and
value at load, so `load_checkpoint` returns what was saved, as DeepSpeed does. Rebuilding runs
no code named by the file: a Namespace and a path are built from strings; a numpy array from its
bytes and a dtype string (numpy parses it, and object dtypes are refused); an enum member only
of an Enum class the process has already imported (looked up in sys.modules, never imported),
by value, as pickle's own rebuild does. A user dict that holds the MARK key itself is marked
too, so it comes back as that dict. Anything else is left as it is, and the save's check that
the file loads back refuses it, naming its entry.
"""
from __future__ import annotations

import argparse
import collections
import enum
import pathlib
import sys

import torch

from ..deepspeed_loop import GradNorm
from .errors import CheckpointError

__all__ = ["to_plain", "from_plain"]

MARK = "__patrickstar_plain__"

_PATHS = {cls.__name__: cls for cls in (pathlib.PurePath, pathlib.PurePosixPath,
                                        pathlib.PureWindowsPath, pathlib.Path,
                                        pathlib.PosixPath, pathlib.WindowsPath)}


def to_plain(value, _open: frozenset = frozenset()):
    """`value` with every object of Note [Client state as plain data] written as a marked
    dict; other objects unchanged (tensors are not copied)."""
    kind = type(value)
    if kind in (dict, collections.OrderedDict, list, tuple, argparse.Namespace):
        if id(value) in _open:  # pickle keeps cycles; a marked copy cannot
            raise CheckpointError("save_checkpoint: the client_state contains itself (a cycle "
                                  "through a dict, list, tuple or Namespace); remove the cycle")
        _open = _open | {id(value)}
    if kind in (dict, collections.OrderedDict):
        if MARK in value:  # a user's dict with our key comes back as that dict
            return {MARK: "dict", "ordered": kind is collections.OrderedDict,
                    "items": [(key, to_plain(item, _open)) for key, item in value.items()]}
        return kind((key, to_plain(item, _open)) for key, item in value.items())
    if kind in (list, tuple):
        return kind(to_plain(item, _open) for item in value)
    if kind is argparse.Namespace:
        return {MARK: "argparse.Namespace", "attributes": to_plain(vars(value), _open)}
    if kind is GradNorm:  # get_global_grad_norm()'s float (Note [The grad norm answers item()])
        return float(value)
    if kind in _PATHS.values():
        return {MARK: "pathlib", "class": kind.__name__, "path": str(value)}
    if kind is frozenset:
        return {MARK: "frozenset", "items": [to_plain(item, _open) for item in value]}
    if isinstance(value, enum.Enum):
        owner = type(value)
        if "<locals>" not in owner.__qualname__:  # else not found at load: refused at save
            return {MARK: "enum", "class": f"{owner.__module__}:{owner.__qualname__}",
                    "value": to_plain(value.value, _open)}
    numpy = sys.modules.get("numpy")  # not imported: no value is a numpy object
    if numpy is not None:
        if kind is numpy.ndarray and not value.dtype.hasobject:
            return {MARK: "numpy.ndarray", **_array_fields(numpy, value)}
        if isinstance(value, numpy.generic) and not value.dtype.hasobject:
            if value.dtype.kind in "biuf" and value.dtype.itemsize <= 8:  # exact as Python's
                return {MARK: "numpy.scalar", "dtype": value.dtype.str, "value": value.item()}
            return {MARK: "numpy.scalar", **_array_fields(numpy, numpy.asarray(value))}
    return value


def _array_fields(numpy, array) -> dict:
    """An array as its dtype string, shape and bytes (any byte order, strings, dates)."""
    flat = numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8)
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "bytes": torch.from_numpy(flat.copy())}


def from_plain(value, path: str):
    """The objects `to_plain` marked, rebuilt; raises CheckpointError, naming the entry, for a
    marked dict it did not write."""
    kind = type(value)
    if kind in (dict, collections.OrderedDict):
        if isinstance(value.get(MARK), str):
            try:
                return _rebuild(value, path)
            except CheckpointError:
                raise
            except Exception as error:  # a damaged or crafted entry: data, so a data error
                raise CheckpointError(f"checkpoint {path}: a {value[MARK]!r} entry that does "
                                      f"not rebuild ({type(error).__name__}: {error})") from None
        return kind((key, from_plain(item, f"{path}[{key!r}]")) for key, item in value.items())
    if kind in (list, tuple):
        return kind(from_plain(item, f"{path}[{index}]") for index, item in enumerate(value))
    return value


def _rebuild(value: dict, path: str):
    kind = value[MARK]
    if kind == "dict":
        rebuilt = collections.OrderedDict if value.get("ordered") else dict
        return rebuilt((key, from_plain(item, f"{path}[{key!r}]")) for key, item in value["items"])
    if kind == "argparse.Namespace":
        attributes = from_plain(value["attributes"], path)
        return argparse.Namespace(**attributes)
    if kind == "pathlib":
        return _PATHS[value["class"]](value["path"])
    if kind == "frozenset":
        return frozenset(from_plain(item, path) for item in value["items"])
    if kind == "enum":
        return _enum_member(value["class"], from_plain(value["value"], path), path)
    if kind == "numpy.ndarray":
        return _array(value)
    if kind == "numpy.scalar":
        import numpy
        if "value" in value:
            dtype = numpy.dtype(value["dtype"])
            if dtype.kind not in "biuf":  # what to_plain writes as a Python number
                raise ValueError(f"a numpy scalar of dtype {value['dtype']!r} as a number")
            return dtype.type(value["value"])
        return _array(value)[()]
    raise CheckpointError(f"checkpoint {path}: unknown entry kind {kind!r} (written by a newer "
                          f"PatrickStar-C++?)")


def _array(value: dict):
    import numpy
    dtype = numpy.dtype(value["dtype"])
    if dtype.hasobject:
        raise ValueError(f"a numpy array of dtype {value['dtype']!r} holds Python objects")
    data = value["bytes"].numpy()
    return numpy.frombuffer(data.tobytes(), dtype=dtype).reshape(value["shape"]).copy()


def _enum_member(name: str, member_value, path: str):
    """A member of an Enum class already imported: the checkpoint names a class, and nothing
    is imported on its word (Note [Client state as plain data])."""
    module_name, _, qualname = name.partition(":")
    owner = sys.modules.get(module_name)
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    if not (isinstance(owner, type) and issubclass(owner, enum.Enum)):
        raise CheckpointError(
            f"checkpoint {path} holds a member of the enum {name.replace(':', '.')}, which is "
            f"not imported: import {module_name} before load_checkpoint() (a checkpoint "
            f"imports nothing itself)")
    return owner(member_value)
