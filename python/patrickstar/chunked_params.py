"""`ChunkedParams`: the model's parameters as chunk tensors. It owns parameter identity (the
parameters, their names, shapes and positions), the dtype of each chunk kind, the registration
of every chunk tensor with the chunk manager, and views into chunk memory. The engine, the
optimizer, checkpoints, data parallelism and pipeline stages are handed this object.

Note [Chunk kinds per precision]
  fp32:       compute (fp32, also the master copy), gradient (fp32), momentum, variance
  fp16/bf16:  compute (16-bit), master (fp32), gradient (16-bit; fp32 when accumulating over
              micro-steps), momentum, variance
  bf16 without master (bf16.master_weights false): compute (bf16, updated in place by the
              optimizer), compensation (bf16 Kahan compensation of those updates), gradient,
              momentum, variance
The moments are fp32, bf16 or uint8 (optimizer.params.state_dtype). 8-bit moments hold the codes
of blockwise dynamic quantization (kernels/quantization.h) and come with one fp32 scale per
QUANTIZATION_BLOCK elements of each moment tensor, in chunk lists of their own that mirror the
moments' chunks (Note [Scale lists mirror their moments] in chunk/chunk_layout.cc), so scales
move, spill to NVMe and checkpoint like every other chunk.
Only trainable parameters get master, gradient and optimizer-state tensors, so frozen ones cost
just their compute copy.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn

from . import _C, dtypes
from .config import auto_chunk_floor
from .vocabulary import Tier

__all__ = ["ChunkedParams", "QUANTIZATION_BLOCK", "TensorIds", "chunk_dtypes",
           "register_chunk_tensors", "scale_count"]

K = _C.ChunkKind
S = _C.TensorState


class TensorIds:
    """The chunk-manager tensor ids of one parameter (None: the parameter has no such tensor)."""

    __slots__ = ("compute", "master", "compensation", "grad", "momentum", "variance",
                 "momentum_scale", "variance_scale")

    def __init__(self):
        self.compute = self.master = self.grad = self.momentum = self.variance = None
        self.compensation = self.momentum_scale = self.variance_scale = None

    def of(self, kind) -> int | None:
        """The id of the tensor of chunk kind `kind` (a `ChunkKind`)."""
        return getattr(self, _SLOT_OF_KIND[kind])

    @staticmethod
    def slot_of(kind) -> str:
        """The attribute holding the tensor of chunk kind `kind`."""
        return _SLOT_OF_KIND[kind]

    def all(self) -> list[int]:
        """Every tensor id of the parameter."""
        return [t for t in (getattr(self, slot) for slot in self.__slots__) if t is not None]


_SLOT_OF_KIND = {K.COMPUTE_PARAM: "compute", K.MASTER_PARAM: "master",
                 K.PARAM_COMPENSATION: "compensation", K.GRADIENT: "grad",
                 K.MOMENTUM: "momentum", K.VARIANCE: "variance",
                 K.MOMENTUM_SCALE: "momentum_scale", K.VARIANCE_SCALE: "variance_scale"}

# Elements per fp32 scale of 8-bit optimizer state: the kernels' block (kernels/quantization.h).
QUANTIZATION_BLOCK = _C.kernels.QUANTIZATION_BLOCK


def scale_count(numel: int) -> int:
    """The fp32 scales of one 8-bit moment tensor of `numel` elements."""
    return -(-numel // QUANTIZATION_BLOCK)


def chunk_dtypes(precision: str, accumulation_steps: int, state_dtype: str = "fp32",
                 master_weights: bool = True) -> dict[str, str | None]:
    """The dtype name of each chunk tensor of a parameter, by `TensorIds` slot (None: not used);
    Note [Chunk kinds per precision]. `state_dtype` is optimizer.params.state_dtype,
    `master_weights` bf16.master_weights."""
    mixed = precision != "fp32"
    compute = dtypes.precision_name(precision)
    moments = {"fp32": "float32", "bf16": "bfloat16", "int8": "uint8"}[state_dtype]
    scales = "float32" if state_dtype == "int8" else None
    no_master = precision == "bf16" and not master_weights
    return {"compute": compute, "master": "float32" if mixed and not no_master else None,
            "compensation": "bfloat16" if no_master else None,
            "grad": "float32" if accumulation_steps > 1 or not mixed else compute,
            "momentum": moments, "variance": moments,
            "momentum_scale": scales, "variance_scale": scales}


def register_chunk_tensors(manager, specs, chunk_dtypes: dict[str, str | None],
                           chunk_size: int | None, compute_order=None):
    """Registers every chunk tensor of `specs` with `manager` and builds the chunk lists, as the
    engine lays out a model (also used by `estimate_memory`, so its figures are the runtime's).
    Returns the per-parameter `TensorIds` and the layout report."""
    ids = [TensorIds() for _ in specs]
    for i in (range(len(specs)) if compute_order is None else compute_order):
        ids[i].compute = manager.register_tensor(specs[i].name, list(specs[i].shape),
                                                 K.COMPUTE_PARAM, chunk_dtypes["compute"])
    trainable = [i for i, spec in enumerate(specs) if spec.requires_grad]
    # Registered kind by kind so each list packs in registration order.
    for kind, attr in ((K.MASTER_PARAM, "master"), (K.PARAM_COMPENSATION, "compensation"),
                       (K.GRADIENT, "grad"),
                       (K.MOMENTUM, "momentum"), (K.VARIANCE, "variance"),
                       (K.MOMENTUM_SCALE, "momentum_scale"),
                       (K.VARIANCE_SCALE, "variance_scale")):
        if chunk_dtypes[attr] is None:
            continue
        for i in trainable:
            shape = list(specs[i].shape)
            if attr.endswith("_scale"):  # in the moments' order: Note [Chunk kinds per precision]
                shape = [scale_count(math.prod(shape))]
            setattr(ids[i], attr, manager.register_tensor(
                f"{specs[i].name}#{attr}", shape, kind, chunk_dtypes[attr]))
    if chunk_size is None:
        largest = max(math.prod(spec.shape) or 1 for spec in specs)
        # Under data parallelism the search goes on in powers of two below the range, down to
        # the floor (auto_chunk_floor); one process keeps chunks of at least its floor.
        floor = auto_chunk_floor(manager.world_size) if manager.world_size > 1 else 0
        low = max(auto_chunk_floor(manager.world_size), largest // 4)
        layout = manager.search_chunk_lists(low, max(low, 4 * largest), max(1, low // 4),
                                            floor_elements=floor)
    else:
        layout = manager.build_chunk_lists(chunk_size)
    return ids, layout


class ChunkedParams:
    """The parameters of one engine and their chunk tensors.

    Built in two steps, as the engine builds a model (Note [Two-pass initialization] in
    init_context.py): `__init__` registers the chunk tensors of the planned parameters and
    builds the chunk lists; `bind()` adds the `nn.Parameter`s once the real module exists."""

    def __init__(self, chunks, specs, precision: str, accumulation_steps: int,
                 chunk_size: int | None, compute_order=None, state_dtype: str = "fp32",
                 master_weights: bool = True):
        self.chunks = chunks
        self.names: list[str] = [spec.name for spec in specs]
        self.shapes: list[tuple[int, ...]] = [tuple(spec.shape) for spec in specs]
        self.requires_grad: list[bool] = [spec.requires_grad for spec in specs]
        self.precision = precision
        self.mixed = precision != "fp32"
        self.compute_dtype = dtypes.precision_dtype(precision)
        self.dtype_names = chunk_dtypes(precision, accumulation_steps, state_dtype,
                                        master_weights)
        self.grad_dtype = dtypes.dtype_of(self.dtype_names["grad"])
        self.ids, self.layout = register_chunk_tensors(chunks, specs, self.dtype_names,
                                                       chunk_size, compute_order)
        self.params: list[nn.Parameter] = []
        self._index: dict[int, int] = {}
        self._chunk_of_tensor: dict[int, int] = {}  # fixed once registered

    def bind(self, params: list[nn.Parameter]) -> None:
        """The module's parameters, in the order of the specs."""
        if len(params) != len(self.names):
            raise AssertionError(f"{len(params)} parameters for {len(self.names)} planned ones")
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def __len__(self) -> int:
        return len(self.names)

    def index_of(self, tensor) -> int | None:
        """The position of parameter `tensor` (None when it is not one of ours: a buffer)."""
        return self._index.get(id(tensor))

    def tensor_id(self, index: int, kind) -> int | None:
        """The chunk tensor id of parameter `index` of chunk kind `kind` (`_C.ChunkKind`)."""
        return self.ids[index].of(kind)

    def chunk_of(self, tensor_id: int) -> int:
        """The chunk holding chunk tensor `tensor_id` (registration fixed it: cached)."""
        chunk = self._chunk_of_tensor.get(tensor_id)
        if chunk is None:
            chunk = self._chunk_of_tensor[tensor_id] = \
                self.chunks.manager.tensor_info(tensor_id)["chunk"]
        return chunk

    # Note [Reads where the chunk is]
    # Reads and writes outside training (state_dict(), save_checkpoint(), a parameter's values,
    # a load, a clip) accessed every tensor on the host. A chunk on the device then moved to the
    # host, which under a host budget meant evicting a host chunk, and with no NVMe tier below
    # there is nowhere to evict to: a two-table model that trained within memory.host_budget =
    # 6 MB (its host peak 4.9 MB) failed every save_checkpoint() and state_dict() with "tier
    # 'host' cannot take 1282048 bytes ... the last tier", and a fresh engine could not load
    # that checkpoint (its compute chunks, on the host since initialization, left no room for
    # the optimizer state the load writes). So a compute parameter is accessed where forward
    # computes on it (the device tier; it stays there), and every other kind on the device
    # when its chunk is there, else on the host (from NVMe, or with no payload, as before). A
    # view on the device is what forward computes on; read() copies it to the CPU, and so does
    # the checkpoint's tensor_bytes().
    def _where(self, tensor_id: int, kind) -> str:
        if kind == _C.ChunkKind.COMPUTE_PARAM:
            return Tier.DEVICE
        on_device = self.chunks.chunk_tier(self.chunk_of(tensor_id)) == Tier.DEVICE
        return Tier.DEVICE if on_device else Tier.HOST

    @contextlib.contextmanager
    def view(self, index: int, kind, tier: str | None = None) -> Iterator[torch.Tensor]:
        """Parameter `index`'s tensor of kind `kind`, in its shape, accessed on `tier` (None:
        Note [Reads where the chunk is]) for the duration of the block (Note [Parameter data
        swapping] in engine.py: the view is invalid once released)."""
        tensor_id = self.tensor_id(index, kind)
        view = self.chunks.access(tensor_id, self._where(tensor_id, kind) if tier is None else tier)
        try:
            yield view.view(self.shape_of(index, kind))
        finally:
            self.chunks.release(tensor_id, S.HOLD)

    def shape_of(self, index: int, kind) -> tuple[int, ...]:
        """The shape of parameter `index`'s tensor of kind `kind`: the parameter's, or one
        dimension of scales for the scale kinds."""
        if kind in (K.MOMENTUM_SCALE, K.VARIANCE_SCALE):
            return (scale_count(math.prod(self.shapes[index])),)
        return self.shapes[index]

    def read(self, index: int, kind) -> torch.Tensor:
        """A copy of parameter `index`'s tensor of kind `kind`, on the CPU."""
        with self.view(index, kind) as view:
            return view.to("cpu", copy=True)

    def write(self, index: int, kind, value: torch.Tensor) -> None:
        """Copies `value` (any float dtype, the parameter's shape) into the chunk tensor."""
        with self.view(index, kind) as view:
            view.copy_(value)
