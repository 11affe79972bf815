"""A small GPT (decoder-only transformer) in plain PyTorch: token + position embeddings, pre-LN
blocks with causal self-attention and an MLP, a final LayerNorm and an LM head tied to the token
embedding. Written for clarity; dropout is configurable (0 by default) so runs are deterministic.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "synthetic_batches"]


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 512
    max_seq_len: int = 64
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    activation_checkpointing: bool = False

    def parameter_count(self) -> int:
        per_block = 12 * self.hidden * self.hidden + 13 * self.hidden
        embeddings = (self.vocab_size + self.max_seq_len) * self.hidden
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        return self.layers * per_block + embeddings + head + 2 * self.hidden


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.out = nn.Linear(4 * config.hidden, config.hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.positions = nn.Embedding(config.max_seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tokens.weight
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, ids, targets=None):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def synthetic_batches(config: GPTConfig, batch: int, steps: int, seed: int = 0):
    """Deterministic token batches with learnable structure (each token predicts the next one
    by a fixed permutation plus noise), so the loss falls as a model trains."""
    generator = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(config.vocab_size, generator=generator)
    for _ in range(steps):
        start = torch.randint(0, config.vocab_size, (batch, 1), generator=generator)
        ids = [start]
        for _ in range(config.max_seq_len):
            noise = torch.randint(0, config.vocab_size, (batch, 1), generator=generator)
            keep = torch.rand(batch, 1, generator=generator) < 0.8
            ids.append(torch.where(keep, permutation[ids[-1]], noise))
        sequence = torch.cat(ids, dim=1)
        yield sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()
