"""Random small models for the property test (test_property.py): each case trains the same
model with PatrickStar and with plain PyTorch and must get the same losses and parameters.

A model is a few `Block`s whose parameter sizes sit just below, at, above and at multiples of
the chunk size, plus a plain linear head; a case may tie two blocks' weights, freeze one, leave
one unused, call one twice per forward, and count forward calls in an integer buffer. Everything
follows from the case's seed, so a failing case is reproduced by its id alone.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import random

import torch
from torch import nn

import patrickstar

CHUNK = 512  # elements per chunk
WIDTH = 8
BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 3
SIZES = (CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK, 7, 100)


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    world: int
    budget: str  # "none" or "tight"
    accumulation: int = 1  # micro-steps per optimizer step (sharded accumulation, the default)

    @property
    def id(self) -> str:
        return f"w{self.world}-{self.budget}-s{self.seed}-a{self.accumulation}"


@dataclasses.dataclass(frozen=True)
class Shape:
    sizes: tuple[int, ...]  # one parameter per block
    tie: tuple[int, int] | None  # block b uses block a's weight
    frozen: int | None
    unused: int | None
    twice: int | None
    linear: int | None  # out_features of a first Linear(WIDTH, out) block, if any


def cases() -> list[Case]:
    """About 30 cases by default; PS_PROPERTY_LONG=N runs N seeds per (world, budget)."""
    long_run = int(os.environ.get("PS_PROPERTY_LONG", "0"))
    per = {1: 7, 2: 5, 4: 3} if not long_run else {1: long_run, 2: long_run, 4: long_run}
    # Odd seeds accumulate gradients over 2 micro-steps.
    return [Case(seed, world, budget, 1 + seed % 2) for world, count in per.items()
            for budget in ("none", "tight") for seed in range(count)]


def shape_of(case: Case) -> Shape:
    rng = random.Random(case.seed * 7919 + case.world)
    blocks = rng.randint(3, 5)
    sizes = [rng.choice(SIZES) for _ in range(blocks)]
    picks = list(range(blocks))
    rng.shuffle(picks)

    def maybe(p: float) -> int | None:
        return picks.pop() if picks and rng.random() < p else None
    unused, frozen, twice = maybe(0.4), maybe(0.5), maybe(0.5)
    tie = None
    if len(picks) >= 2 and rng.random() < 0.5:
        a, b = picks.pop(), picks.pop()
        tie = (a, b)
        sizes[b] = sizes[a]  # a tied weight has one shape
    # A weight and its bias in different chunks, the weight one chunk long or around it.
    outs = (CHUNK // WIDTH // 2, CHUNK // WIDTH - 1, CHUNK // WIDTH, CHUNK // WIDTH + 1,
            2 * CHUNK // WIDTH)
    linear = rng.choice(outs) if rng.random() < 0.6 else None
    return Shape(tuple(sizes), tie, frozen, unused, twice, linear)


class Block(nn.Module):
    """y = ((x @ mix^T) * weight) @ mix / n: every element of `weight` gets a gradient that
    depends on the input; `mix` is a fixed float buffer."""

    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(numel) * 0.5)
        self.register_buffer("mix", torch.randn(numel, WIDTH) / math.sqrt(numel))

    def forward(self, x):
        return torch.tanh(x + ((x @ self.mix.t()) * self.weight) @ self.mix)


class LinearBlock(nn.Module):
    """nn.Linear(WIDTH, out) and back through a fixed float buffer."""

    def __init__(self, out: int):
        super().__init__()
        self.linear = nn.Linear(WIDTH, out)
        self.register_buffer("back", torch.randn(out, WIDTH) / math.sqrt(out))

    def forward(self, x):
        return torch.tanh(x + self.linear(x) @ self.back)


class RandomModel(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.shape = shape
        # First, so that its weight opens the first chunk (and group) and its bias follows.
        self.linear = LinearBlock(shape.linear) if shape.linear is not None else None
        self.blocks = nn.ModuleList(Block(size) for size in shape.sizes)
        if shape.tie is not None:
            a, b = shape.tie
            self.blocks[b].weight = self.blocks[a].weight
        if shape.frozen is not None:
            self.blocks[shape.frozen].weight.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 10)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        self.calls += 1
        if self.linear is not None:
            x = self.linear(x)
        for index, block in enumerate(self.blocks):
            if index == self.shape.unused:
                continue
            x = block(x)
            if index == self.shape.twice:
                x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def model_func(case: Case):
    shape = shape_of(case)
    return lambda: RandomModel(shape)


def batches(case: Case):
    generator = torch.Generator().manual_seed(case.seed + 1)
    return [(torch.randn(BATCH, WIDTH, generator=generator),
             torch.randint(0, 10, (BATCH,), generator=generator))
            for _ in range(STEPS * case.accumulation)]


def shard(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank] for t in batch)


OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def reference(case: Case) -> tuple[list[float], dict]:
    """Plain PyTorch on the whole batch; the loss of a step is the mean of the shard losses."""
    torch.manual_seed(case.seed)
    model = model_func(case)()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.01)
    losses = []
    for micro_step, batch in enumerate(batches(case)):
        loss = sum(model(*shard(batch, r, case.world)) for r in range(case.world)) / case.world
        (loss / case.accumulation).backward()
        losses.append(loss.item())
        if (micro_step + 1) % case.accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    # The reference calls forward once per shard; PatrickStar's ranks once per step each.
    state = model.state_dict()
    state["calls"] = state["calls"] // case.world
    return losses, state


def _initialize(case: Case):
    config = {"default_chunk_size": CHUNK, "optimizer": copy.deepcopy(OPTIMIZER),
              "gradient_accumulation_steps": case.accumulation,
              "parallel": {"collective_timeout": 60}}
    if case.budget == "none":
        torch.manual_seed(case.seed)
        return patrickstar.initialize(model_func(case), config=config)
    # Tight: the smallest device budget (in chunks) initialize() accepts.
    for chunks in range(2, 64):
        config["memory"] = {"device_budget": chunks * CHUNK * 4}
        torch.manual_seed(case.seed)
        try:
            return patrickstar.initialize(model_func(case), config=config)
        except patrickstar.ChunkOutOfMemoryError:
            continue
    raise AssertionError(f"{case.id}: no device budget below 64 chunks was accepted")


def train(case: Case, rank: int = 0) -> dict:
    """PatrickStar on this rank's shards; losses are the rank's shard losses."""
    model, optimizer = _initialize(case)
    try:
        losses = []
        for micro_step, batch in enumerate(batches(case)):
            loss = model(*shard(batch, rank, case.world))
            model.backward(loss)
            losses.append(loss.item())
            if (micro_step + 1) % case.accumulation == 0:
                optimizer.step()
                optimizer.zero_grad()
        return {"losses": losses, "state": model.state_dict(),
                "device": model.memory_stats()[0]}
    finally:
        model.destroy()
