"""The one dtype table: torch dtypes by their names in checkpoints and chunk layouts
("float32", ...), by precision ("fp32", "fp16", "bf16"), and their sizes. Every module that
turns a name into a dtype or back uses these, so a new dtype is added in one place."""
from __future__ import annotations

import torch

__all__ = ["BY_NAME", "NAME_OF", "PRECISIONS", "dtype_of", "name_of", "precision_dtype",
           "precision_name", "element_size"]

# Names as torch spells them (str(dtype) without "torch."), in a fixed order: pipe/p2p.py sends
# a dtype as its position in this table.
BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in BY_NAME.items()}
# Training precisions (config "fp16" / "bf16" sections) and their compute dtypes.
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                      "bf16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", ...)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r} (known: {sorted(BY_NAME)})") from None


def name_of(dtype: torch.dtype) -> str:
    try:
        return NAME_OF[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no name in patrickstar.dtypes") from None


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a training precision ("fp32", "fp16", "bf16")."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got "
                         f"{precision!r}") from None


def precision_name(precision: str) -> str:
    """The dtype name of a precision's compute dtype: "fp16" -> "float16"."""
    return NAME_OF[precision_dtype(precision)]


def element_size(name: str) -> int:
    """Bytes per element of the dtype called `name`."""
    return dtype_of(name).itemsize
