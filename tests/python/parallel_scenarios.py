"""Pipeline / tensor-parallel scenarios shared by parallel_worker.py (one process per rank) and
test_parallelism.py, which trains the same model in one process with plain PyTorch."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from patrickstar.examples.gpt import GPTConfig, synthetic_batches
from patrickstar.examples.gpt_parallel import (AddPositions, ParallelBlock, ParallelGPT,
                                               TokenEmbedding, _head, gpt_loss, gpt_pipeline)
from patrickstar.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from test_initialize import make_optimizer

CHUNK = 8192  # elements; the largest parameters (embedding, MLP weights) have 4096


def gpt_config(hidden: int = 32) -> GPTConfig:
    return GPTConfig(vocab_size=128, max_seq_len=16, hidden=hidden, layers=4, heads=2)


def _frozen(cls):
    """`cls` built with every parameter frozen (requires_grad=False)."""
    class Frozen(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.requires_grad_(False)
    Frozen.__name__ = f"Frozen{cls.__name__}"
    return Frozen


def frozen_last_stage_pipeline(config: GPTConfig, **kwargs) -> PipelineModule:
    """gpt_pipeline with the tied embedding and every layer of the last stage (of two: the
    last half of the blocks, the final norm and the head) frozen: that stage has no trainable
    parameter (its backward only passes the activations' gradients on)."""
    embed = _frozen(TokenEmbedding)
    half = config.layers // 2
    layers = [TiedLayerSpec("embed", embed, config),
              LayerSpec(AddPositions, config),
              *[LayerSpec(ParallelBlock, config) for _ in range(half)],
              *[LayerSpec(_frozen(ParallelBlock), config) for _ in range(config.layers - half)],
              LayerSpec(_frozen(nn.LayerNorm), config.hidden),
              TiedLayerSpec("embed", embed, config, forward_fn=_head)]
    return PipelineModule(layers, loss_fn=gpt_loss, **kwargs)


@dataclasses.dataclass
class Scenario:
    kind: str  # "pipe": train_batch on a PipelineModule; "tensor": the engine's own loop
    parallel: dict
    steps: int = 10
    accumulation: int = 4
    micro_batch: int = 2  # sequences per data-parallel rank and micro batch
    device_budget: int | None = None
    pipe_kwargs: dict = dataclasses.field(default_factory=dict)
    lr: float = 1e-3
    weight_decay: float = 0.1
    clip: float = 0.0
    fp16: bool = False
    checkpoint: bool = False  # save_checkpoint after training (for patrickstar-consolidate)
    frozen_last_stage: bool = False  # pipe: frozen_last_stage_pipeline

    @property
    def data(self) -> int:
        return self.parallel.get("data", 1)

    def config(self) -> dict:
        config = {"default_chunk_size": CHUNK, "parallel": dict(self.parallel),
                  "gradient_accumulation_steps": self.accumulation,
                  "gradient_clipping": self.clip,
                  "optimizer": {"type": "AdamW", "params": {"lr": self.lr,
                                                            "weight_decay": self.weight_decay}}}
        if self.device_budget is not None:
            config["memory"] = {"device_budget": self.device_budget}
        if self.fp16:
            # A scale that overflows now and then: every stage must skip the same steps.
            config["fp16"] = {"enabled": True, "initial_scale_power": 20}
        return config

    def pipeline(self):
        build = frozen_last_stage_pipeline if self.frozen_last_stage else gpt_pipeline
        return build(gpt_config(), seed_layers=True, **self.pipe_kwargs)

    def micro_batches(self):
        """Global micro batches (all data-parallel shards), steps * accumulation of them."""
        return synthetic_batches(gpt_config(), batch=self.micro_batch * self.data,
                                 steps=self.steps * self.accumulation)


# Three chunks of device memory per rank: far less than a stage's compute and gradient chunks.
TIGHT = 3 * CHUNK * 4

# Gradient clipping (the global norm over stages and slices) where CLIP is below the norm of
# every step's gradient, so every step is clipped.
CLIP = 0.1

SCENARIOS = {
    "pp_1f1b": Scenario("pipe", {"pipeline": 2}),
    "pp_gpipe_checkpointed_clipped": Scenario(
        "pipe", {"pipeline": 2, "schedule": "gpipe"}, clip=CLIP,
        pipe_kwargs={"activation_checkpoint_interval": 1, "partition_method": "type:Block"}),
    "tp_clipped": Scenario("tensor", {"tensor": 2}, accumulation=2, clip=CLIP),
    "pp_dp_tight": Scenario("pipe", {"pipeline": 2, "data": 2}, device_budget=TIGHT),
    "tp_dp_tight": Scenario("tensor", {"tensor": 2, "data": 2}, accumulation=2,
                            device_budget=TIGHT),
    "pp_tp_clipped": Scenario("pipe", {"pipeline": 2, "tensor": 2}, clip=CLIP, checkpoint=True),
    # All three at once: 8 processes (a slow test).
    "pp_dp_tp_tight_clipped": Scenario("pipe", {"pipeline": 2, "data": 2, "tensor": 2},
                                       steps=5, clip=CLIP, device_budget=TIGHT),
    # Compared loosely with the fp32 reference (as test_data_parallel.py's mixed precision).
    "pp_fp16_clipped": Scenario("pipe", {"pipeline": 2}, clip=CLIP, fp16=True),
    # The last stage has no trainable parameter: its steps add nothing to the norm the first
    # stage's steps all-reduce (clipping and get_global_grad_norm).
    "pp_frozen_last_stage": Scenario("pipe", {"pipeline": 2}, steps=4, frozen_last_stage=True),
    "pp_frozen_last_stage_clipped": Scenario("pipe", {"pipeline": 2}, steps=4, clip=CLIP,
                                             frozen_last_stage=True),
}


def shard(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank] for t in batch)


def reference(name: str):
    """Plain PyTorch in one process on the global batches: (mean loss per step, state dict,
    evaluated loss of the first batch after training; pipe scenarios only, gradient norm per
    step before clipping)."""
    threads = torch.get_num_threads()
    # One thread: this tiny model is slower with two when the workers' processes share the cores.
    torch.set_num_threads(1)
    try:
        return _reference(SCENARIOS[name])
    finally:
        torch.set_num_threads(threads)


def _reference(s: Scenario):
    torch.manual_seed(0)
    if s.kind == "pipe":
        model = s.pipeline().sequential()

        def loss_of(ids, targets):
            return gpt_loss(model(ids), targets)
    else:
        model = ParallelGPT(gpt_config())
        loss_of = model
    optimizer = make_optimizer("AdamW", model.parameters(), s.lr, s.weight_decay)
    losses, step_losses, norms = [], [], []
    for index, batch in enumerate(s.micro_batches()):
        loss = sum(loss_of(*shard(batch, r, s.data)) for r in range(s.data)) / s.data
        (loss / s.accumulation).backward()
        step_losses.append(loss.item())
        if (index + 1) % s.accumulation == 0:
            norms.append(float(nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])))
            if s.clip:
                nn.utils.clip_grad_norm_(model.parameters(), s.clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(sum(step_losses) / len(step_losses))
            step_losses = []
    # eval_batch after training: the first global batch's micro batches, without gradients.
    with torch.no_grad():
        first = list(s.micro_batches())[:s.accumulation]
        evaluated = sum(sum(loss_of(*shard(b, r, s.data)) for r in range(s.data)).item() / s.data
                        for b in first) / s.accumulation
    return losses, model.state_dict(), evaluated, norms


class PipeMLP(nn.Module):
    """For the shape-mismatch test: one pipeline layer."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.relu(self.linear(x))
