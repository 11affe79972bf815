"""The small GPT of gpt.py built for 3D parallelism: Megatron-sliced attention and MLP
(patrickstar.tensor_parallel) and a layer list for pipeline stages (patrickstar.pipe).

At a tensor-parallel size of 1 (no topology) every layer is its plain PyTorch counterpart and,
from the same seed, `ParallelGPT` is initialized as gpt.GPT is, so the single-process model is
the reference the parallel runs are compared with.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               copy_to_tensor_parallel_region, vocab_parallel_cross_entropy)
from .gpt import GPTConfig

__all__ = ["ParallelGPT", "TokenEmbedding", "LMHead", "AddPositions", "ParallelBlock",
           "gpt_pipeline",
           "gpt_loss"]


def _normal(std):
    return lambda tensor: nn.init.normal_(tensor, std=std)


class TokenEmbedding(VocabParallelEmbedding):
    """Token embedding sliced by vocabulary; `logits(h)` is the tied LM head (this rank's
    vocabulary slice of the logits). The weight is this module's own parameter, so a pipeline's
    tied head (`forward_fn` calling `logits`) brings it in through this module's hooks."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.vocab_size, config.hidden, init_method=_normal(0.02))

    def logits(self, hidden):
        return F.linear(copy_to_tensor_parallel_region(hidden, self.group), self.weight)


class LMHead(nn.Module):
    """The LM head of a whole-model GPT: shares the token embedding's weight (a module of its
    own, so the engine's hooks bring the shared weight in when the head runs)."""

    def __init__(self, tokens: TokenEmbedding):
        super().__init__()
        self.weight = tokens.weight
        self.group = tokens.group

    def forward(self, hidden):
        return F.linear(copy_to_tensor_parallel_region(hidden, self.group), self.weight)


class AddPositions(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.positions = nn.Embedding(config.max_seq_len, config.hidden)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, x):
        return x + self.positions(torch.arange(x.shape[1], device=x.device))


class ParallelAttention(nn.Module):
    """Heads split over the tensor group: q, k, v column-parallel (one fused, strided weight),
    the output projection row-parallel."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        scaled = _normal(0.02 / math.sqrt(2 * config.layers))
        self.qkv = ColumnParallelLinear(config.hidden, 3 * config.hidden, gather_output=False,
                                        stride=3)
        self.proj = RowParallelLinear(config.hidden, config.hidden, input_is_parallel=True,
                                      init_method=scaled)
        self.heads = config.heads // self.qkv.world
        if config.heads % self.qkv.world:
            raise ValueError(f"GPT heads = {config.heads} is not divisible by the tensor-parallel "
                             f"size {self.qkv.world}")

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        local = q.shape[-1]
        shape = (batch, seq, self.heads, local // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, local))


class ParallelBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = ParallelAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.fc = ColumnParallelLinear(config.hidden, 4 * config.hidden, gather_output=False)
        self.out = RowParallelLinear(4 * config.hidden, config.hidden, input_is_parallel=True,
                                     init_method=_normal(0.02 / math.sqrt(2 * config.layers)))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def gpt_loss(logits, targets):
    """Mean cross entropy of vocabulary-sliced logits."""
    return vocab_parallel_cross_entropy(logits, targets).mean()


class ParallelGPT(nn.Module):
    """The whole model in one module (tensor parallelism without pipeline stages)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tokens = TokenEmbedding(config)
        self.positions = AddPositions(config)
        self.blocks = nn.ModuleList(ParallelBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = LMHead(self.tokens)

    def forward(self, ids, targets):
        x = self.positions(self.tokens(ids))
        for block in self.blocks:
            x = block(x)
        return gpt_loss(self.head(self.ln_f(x)), targets)


def _head(module: TokenEmbedding, hidden):
    return module.logits(hidden)


def gpt_pipeline(config: GPTConfig, **kwargs) -> PipelineModule:
    """The GPT as pipeline layers: the token embedding tied with the LM head (first and last
    stage), blocks in between. kwargs go to PipelineModule (num_stages, partition_method,
    activation_checkpoint_interval, seed_layers, ...)."""
    layers = [TiedLayerSpec("embed", TokenEmbedding, config),
              LayerSpec(AddPositions, config),
              *[LayerSpec(ParallelBlock, config) for _ in range(config.layers)],
              LayerSpec(nn.LayerNorm, config.hidden),
              TiedLayerSpec("embed", TokenEmbedding, config, forward_fn=_head)]
    return PipelineModule(layers, loss_fn=gpt_loss, **kwargs)
