"""Adam's moments as their chunks hold them (optimizer.params.state_dtype: fp32, bf16, or 8-bit
codes with one fp32 scale per 2048 elements) and as anyone else sees them. It owns the
conversions, so the optimizer's state_dict and checkpoints read and write moments the same way:
as stored (8-bit codes travel with their scales, so a save and a load change no bit), and
converted when the stored and the wanted dtype differ (an fp32 checkpoint loaded with int8
state is quantized, an int8 one loaded with fp32 state dequantized)."""
from __future__ import annotations

import math

import torch

from . import _C
from .chunked_params import ChunkedParams, scale_count

__all__ = ["MOMENT_KEYS", "scale_key", "read_moment", "write_moment", "check_moment",
           "quantize", "dequantize", "dequantize_moment"]

K = _C.ChunkKind

# The state_dict / checkpoint key of each moment, its chunk kinds, and whether its quantization
# map is signed (exp_avg) or unsigned (exp_avg_sq, never negative).
_MOMENTS = {"exp_avg": (K.MOMENTUM, K.MOMENTUM_SCALE, True),
            "exp_avg_sq": (K.VARIANCE, K.VARIANCE_SCALE, False)}
MOMENT_KEYS = tuple(_MOMENTS)


def scale_key(key: str) -> str:
    """The key of the scales of moment `key` ("exp_avg" -> "exp_avg_scale")."""
    return f"{key}_scale"


def quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit codes and fp32 scales of `values` (rounded to the nearest code, as the
    int8-state Adam kernel stores its moments)."""
    flat = values.detach().reshape(-1).to(torch.float32).contiguous()
    codes = torch.empty(flat.numel(), dtype=torch.uint8)
    scales = torch.empty(scale_count(flat.numel()), dtype=torch.float32)
    _C.kernels.quantize_blockwise_(flat, codes, scales, signed=signed)
    return codes.view(values.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of 8-bit `codes` with their blockwise `scales`."""
    flat = codes.reshape(-1).contiguous()
    if scales.numel() != scale_count(flat.numel()):
        raise ValueError(f"8-bit moment of {flat.numel()} elements needs "
                         f"{scale_count(flat.numel())} scales, got {scales.numel()}")
    values = torch.empty(flat.numel(), dtype=torch.float32)
    _C.kernels.dequantize_blockwise_(flat, scales.reshape(-1).to(torch.float32).contiguous(),
                                     values, signed=signed)
    return values.view(codes.shape)


def dequantize_moment(key: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of moment `key`'s 8-bit `codes` with their `scales`, in its map."""
    return dequantize(codes, scales, _MOMENTS[key][2])


def read_moment(params: ChunkedParams, index: int, key: str) -> dict[str, torch.Tensor]:
    """Parameter `index`'s moment `key` as stored: {key: values or codes} plus, for 8-bit state,
    {scale_key(key): scales}; CPU copies."""
    kind, scale_kind, _ = _MOMENTS[key]
    result = {key: params.read(index, kind)}
    if params.tensor_id(index, scale_kind) is not None:
        result[scale_key(key)] = params.read(index, scale_kind)
    return result


def check_moment(name: str, shape: tuple[int, ...], key: str, value: torch.Tensor,
                 scales: torch.Tensor | None = None) -> None:
    """Raises ValueError naming parameter `name` unless 8-bit codes `value` can be written as
    its moment `key`: as many codes as `shape` has elements, with their `scales`, one per
    block of 2048 (so a load can check every entry before it writes any)."""
    numel = math.prod(shape)
    if value.numel() != numel:
        raise ValueError(f"'{name}' of shape {tuple(shape)} ({numel} elements): its {key} "
                         f"holds {value.numel()} 8-bit codes")
    if scales is None:
        raise ValueError(f"'{name}' {key}: 8-bit codes without their '{scale_key(key)}'")
    if scales.numel() != scale_count(numel):
        raise ValueError(f"'{name}' {key}: {numel} codes need {scale_count(numel)} scales, "
                         f"got {scales.numel()}")


def write_moment(params: ChunkedParams, index: int, key: str, value: torch.Tensor,
                 scales: torch.Tensor | None = None) -> None:
    """Writes moment `key` of parameter `index` from `value`: float values of any dtype, or
    8-bit codes with their `scales` (as `read_moment` returns them); converted to what the
    chunks hold."""
    kind, scale_kind, signed = _MOMENTS[key]
    if value.dtype == torch.uint8:
        check_moment(params.names[index], params.shapes[index], key, value, scales)
    stored_8bit = params.tensor_id(index, scale_kind) is not None
    if stored_8bit:
        if value.dtype == torch.uint8:
            codes = value
        else:
            codes, scales = quantize(value, signed)
        params.write(index, kind, codes.reshape(params.shape_of(index, kind)))
        params.write(index, scale_kind, scales.reshape(params.shape_of(index, scale_kind)))
    elif value.dtype == torch.uint8:
        params.write(index, kind, dequantize(value, scales, signed).view(params.shapes[index]))
    else:
        params.write(index, kind, value)
