"""Megatron-style tensor slicing: layers whose weights are split over the tensor-parallel group.

Each rank holds one slice of a sliced weight as an ordinary parameter, so the engine puts it in
chunks (and data parallelism shards those chunks over the data group) like any other; only the
forward and backward know about the slicing, through Megatron's conjugate pair of collectives:

    f = copy_to_tensor_parallel_region:   identity forward, all-reduce of the gradient backward
    g = reduce_from_tensor_parallel_region: all-reduce forward, identity backward

A transformer MLP is `g(RowParallel(gelu(ColumnParallel(f(x)))))`: one all-reduce forward and one
backward, the activations between the two linears stay sliced. The group is the topology's
tensor group (`parallel.tensor` in the config, built by `patrickstar.initialize()` before the
model), or the `group` a layer is given; without one every layer is its plain PyTorch
counterpart.

Note [Full initialization, then slice]
Every rank draws the whole weight from the same RNG stream, exactly as the plain layer would
(`nn.Linear`'s kaiming-uniform weight then uniform bias, `nn.Embedding`'s normal), and keeps its
slice. So a model built from the same seed is the same model at any tensor-parallel size, which
is what the tests compare, at the price of one full weight in host memory at a time while the
model is built. Parameters carry `tensor_model_parallel`, `partition_dim` and `partition_stride`
so `gather_full_state_dict` can rebuild the full tensors.

Note [Strided slices]
A fused weight such as attention's [q; k; v] (3 blocks of rows) must be sliced per block, or
rank 0 would get all of q and half of k: `partition_stride=3` splits each of the 3 blocks into
`tensor` pieces and gives rank r piece r of every block.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import recorded_collectives, topology
from .tensor_slices import join_slices, split_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
           "gather_from_tensor_parallel_region", "gather_full_state_dict", "split_tensor",
           "join_slices"]


def _group_info(group):
    """(group, size, rank); `group=None` means the current topology's tensor group."""
    if group is None:
        return topology.tensor_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


# ---- The conjugate collectives ------------------------------------------------------------------

def _all_reduce(tensor, group, label: str):
    tensor = tensor.contiguous().clone()
    recorded_collectives.group_all_reduce(tensor, group, "tensor_all_reduce", label)
    return tensor


def _split_last(tensor, size, rank):
    return tensor.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(tensor, group, size, label: str):
    parts = [torch.empty_like(tensor) for _ in range(size)]
    recorded_collectives.group_all_gather(parts, tensor.contiguous(), group,
                                          "tensor_all_gather", label)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "f backward: input gradient"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return _all_reduce(tensor, group, "g forward: partial outputs")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, size, rank):
        ctx.group, ctx.size = group, size
        return _split_last(tensor, size, rank)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, ctx.size, "scatter backward: input gradient"), \
            None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, size, rank):
        ctx.size, ctx.rank = size, rank
        return _gather_last(tensor, group, size, "gather forward: output slices")

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.size, ctx.rank), None, None, None


def copy_to_tensor_parallel_region(tensor, group=None):
    """f: identity forward, all-reduce backward (before a column-parallel layer)."""
    group, size, _ = _group_info(group)
    return tensor if size == 1 else _CopyToRegion.apply(tensor, group)


def reduce_from_tensor_parallel_region(tensor, group=None):
    """g: all-reduce forward, identity backward (after a row-parallel layer)."""
    group, size, _ = _group_info(group)
    return tensor if size == 1 else _ReduceFromRegion.apply(tensor, group)


def scatter_to_tensor_parallel_region(tensor, group=None):
    """This rank's slice of the last dimension; backward gathers."""
    group, size, rank = _group_info(group)
    return tensor if size == 1 else _ScatterToRegion.apply(tensor, group, size, rank)


def gather_from_tensor_parallel_region(tensor, group=None):
    """The slices of the last dimension concatenated; backward keeps this rank's slice."""
    group, size, rank = _group_info(group)
    return tensor if size == 1 else _GatherFromRegion.apply(tensor, group, size, rank)


# ---- Slicing ------------------------------------------------------------------------------------

def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size "
                         f"{size} (config key 'parallel.tensor')")
    return total // size


def _sliced_parameter(full: torch.Tensor, dim: int, size: int, rank: int, stride: int = 1):
    param = nn.Parameter(split_tensor(full, dim, size, rank, stride).clone())
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    return param


def _linear_init(out_features: int, in_features: int, bias: bool, init_method):
    """The full weight and bias drawn as nn.Linear draws them (Note [Full initialization,
    then slice])."""
    weight = torch.empty(out_features, in_features)
    if init_method is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    else:
        init_method(weight)
    full_bias = None
    if bias:
        full_bias = torch.empty(out_features)
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(full_bias, -bound, bound)
    return weight, full_bias


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns (the output features): rank r computes Y_r = X A_r.
    `gather_output=False` leaves Y sliced for a following RowParallelLinear; `stride` slices a
    fused weight per block (Note [Strided slices])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = True, init_method=None, stride: int = 1, group=None):
        super().__init__()
        self.group, self.world, self.rank = _group_info(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        if out_features % (self.world * stride):
            # Note [Strided slices]: each of the `stride` blocks is split over the ranks.
            raise ValueError(f"ColumnParallelLinear out_features = {out_features} is not "
                             f"divisible by stride {stride} x the tensor-parallel size "
                             f"{self.world} (config key 'parallel.tensor'): each of its "
                             f"{stride} blocks of {out_features / stride:g} rows is split "
                             f"over {self.world} ranks" if stride > 1 else
                             f"ColumnParallelLinear out_features = {out_features} is not "
                             f"divisible by the tensor-parallel size {self.world} (config key "
                             "'parallel.tensor')")
        self.out_per_rank = out_features // self.world
        weight, full_bias = _linear_init(out_features, in_features, bias, init_method)
        self.weight = _sliced_parameter(weight, 0, self.world, self.rank, stride)
        self.bias = None if full_bias is None else _sliced_parameter(
            full_bias, 0, self.world, self.rank, stride)

    def forward(self, x):
        x = copy_to_tensor_parallel_region(x, self.group) if self.world > 1 else x
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.world > 1:
            y = gather_from_tensor_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on this rank), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows (the input features): rank r computes X_r A_r and the
    partial results are all-reduced; b is whole on every rank. `input_is_parallel=True` takes X
    already sliced (the output of a ColumnParallelLinear with gather_output=False)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = False, init_method=None, group=None):
        super().__init__()
        self.group, self.world, self.rank = _group_info(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.in_per_rank = _divide(in_features, self.world, "RowParallelLinear in_features")
        weight, full_bias = _linear_init(out_features, in_features, bias, init_method)
        self.weight = _sliced_parameter(weight, 1, self.world, self.rank)
        self.bias = None if full_bias is None else nn.Parameter(full_bias.clone())

    def forward(self, x):
        if self.world == 1:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split: each rank looks up the ids in its
    range, zeros the others, and the results are all-reduced. `weight` also serves as a tied
    LM head: `F.linear(copy_to_tensor_parallel_region(h), emb.weight)` gives this rank's slice
    of the logits, which `vocab_parallel_cross_entropy` takes as it is."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method=None, group=None):
        super().__init__()
        self.group, self.world, self.rank = _group_info(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _divide(num_embeddings, self.world, "VocabParallelEmbedding num_embeddings")
        self.vocab_start, self.vocab_end = self.rank * per_rank, (self.rank + 1) * per_rank
        weight = torch.empty(num_embeddings, embedding_dim)
        if init_method is None:
            nn.init.normal_(weight)
        else:
            init_method(weight)
        self.weight = _sliced_parameter(weight, 0, self.world, self.rank)

    def forward(self, ids):
        if self.world == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}.."
                f"{self.vocab_end - 1} on this rank")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross entropy over logits sliced by vocabulary: the max, the target's logit
    and the sum of exponentials are all-reduced, so no rank ever holds the full logits."""

    @staticmethod
    def forward(ctx, logits, target, group, rank):
        logits = logits.float()
        vocab = logits.shape[-1]
        start = rank * vocab
        maximum = logits.max(dim=-1)[0]
        recorded_collectives.group_all_reduce(maximum, group, "tensor_all_reduce",
                                              "vocab cross entropy: max", op=dist.ReduceOp.MAX)
        logits = logits - maximum.unsqueeze(-1)
        outside = (target < start) | (target >= start + vocab)
        local = (target - start).masked_fill(outside, 0)
        flat = logits.view(-1, vocab)
        rows = torch.arange(flat.shape[0])
        predicted = flat[rows, local.view(-1)].view_as(target).masked_fill(outside, 0.0)
        recorded_collectives.group_all_reduce(predicted, group, "tensor_all_reduce",
                                              "vocab cross entropy: target logit")
        exp = logits.exp()
        total = exp.sum(dim=-1)
        recorded_collectives.group_all_reduce(total, group, "tensor_all_reduce",
                                              "vocab cross entropy: sum of exponentials")
        loss = total.log() - predicted
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        vocab = softmax.shape[-1]
        grad_input = softmax.clone()
        flat = grad_input.view(-1, vocab)
        rows = torch.arange(flat.shape[0])
        flat[rows, local.view(-1)] -= 1.0 - outside.view(-1).float()
        grad_input.mul_(grad.unsqueeze(-1))
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None):
    """Per-token cross entropy of logits sliced by vocabulary over the tensor group (rank r
    holds classes [r*V/T, (r+1)*V/T)); take `.mean()` for F.cross_entropy's default. Without
    tensor parallelism it is `F.cross_entropy(..., reduction="none")`."""
    group, size, rank = _group_info(group)
    if size == 1:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view_as(target)
    return _VocabParallelCrossEntropy.apply(logits, target, group, rank)


def gather_full_state_dict(module: nn.Module, state_dict: dict, group=None) -> dict:
    """The full tensors of a (possibly sliced) state dict of `module`: sliced parameters are
    all-gathered over the tensor group (a collective: every rank of the group calls it), the
    rest returned as they are. `state_dict` is `module.state_dict()` or an engine's."""
    group, size, _ = _group_info(group)
    if size == 1:
        return dict(state_dict)
    sliced = {name: param for name, param in module.named_parameters(remove_duplicate=False)
              if getattr(param, "tensor_model_parallel", False)}
    result = {}
    for name, value in state_dict.items():
        param = sliced.get(name)
        if param is None:
            result[name] = value
            continue
        parts = [torch.empty_like(value) for _ in range(size)]
        recorded_collectives.group_all_gather(parts, value.contiguous(), group,
                                              "tensor_all_gather", f"full state dict: {name}")
        result[name] = join_slices(parts, param.partition_dim, param.partition_stride)
    return result
