"""Training scenarios shared by the data-parallel worker (dp_worker.py, one process per rank)
and the tests that compare it with plain PyTorch on the whole batch (test_data_parallel.py)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from patrickstar.examples.gpt import GPT, synthetic_batches
from test_initialize import MLP, gpt_config, make_optimizer, mlp_batches, model_bytes


class RankDependentBranch(nn.Module):
    """`branch` runs only for batches whose first feature is positive: with a split batch, one
    rank uses it and the other does not in the same step (data-dependent control flow)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = torch.relu(self.trunk(x))
        if x[0, 0] > 0:
            h = h + self.branch(h)
        return nn.functional.cross_entropy(self.head(h), y)


class BranchWithUnused(RankDependentBranch):
    """RankDependentBranch plus a parameter no rank ever uses, packed into the chunk of the
    branch, which the rank that never takes the branch owns (2 ranks, chunks of 2048): the
    owner's chunk keeps its payload (the unused tensor holds its zeros) while the branch's
    gradient slot there is FREE, and must add nothing to the branch's reduced gradient."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1000))


def branch_batches(steps, batch=16, seed=0):
    """Like mlp_batches, but the first half of each batch says "branch" and the second not."""
    for x, y in mlp_batches(steps, batch, seed):
        half = batch // 2
        x[:half, 0] = x[:half, 0].abs() + 0.1
        x[half:, 0] = -x[half:, 0].abs() - 0.1
        yield x, y


def rare_branch_batches(steps, batch=16, seed=0):
    """branch_batches in the first step (one rank takes the branch), then no rank takes it
    but in the fourth step (both take it)."""
    for step, (x, y) in enumerate(mlp_batches(steps, batch, seed)):
        x[:, 0] = x[:, 0].abs() + 0.1 if step == 3 else -x[:, 0].abs() - 0.1
        if step == 0:
            x[:batch // 2, 0] = -x[:batch // 2, 0]
        yield x, y


def half_mlp_batches(steps, batch=16, seed=0):
    """fp16 inputs for fp16 parameters (the fp32 reference casts them back)."""
    for x, y in mlp_batches(steps, batch, seed):
        yield x.half(), y


def bf16_mlp_batches(steps, batch=16, seed=0):
    """bf16 inputs for bf16 parameters (the fp32 reference casts them back)."""
    for x, y in mlp_batches(steps, batch, seed):
        yield x.bfloat16(), y


class EmbeddingModel(nn.Module):
    """Two tensors larger than the chunk (the embedding and the output projection, 6400 elements
    each in chunks of 4096): each gets a padded group of its own, held by different ranks."""

    def __init__(self, vocab=100, width=64):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x, y):
        h = torch.relu(self.hidden(self.embedding(x).mean(dim=1)))
        return nn.functional.cross_entropy(self.out(h), y)


def token_batches(steps, batch=16, seed=0, vocab=100, length=8):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (torch.randint(0, vocab, (batch, length), generator=generator),
               torch.randint(0, vocab, (batch,), generator=generator))


class ReusedAndRecomputed(nn.Module):
    """A module called twice in one pass and blocks whose activations torch.utils.checkpoint
    recomputes in backward (a second use of their parameters after the forward ended). Tied
    weights are the GPT scenarios' (embedding and head)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.shared = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x, y):
        h = torch.relu(self.inp(x))
        h = torch.relu(self.shared(torch.relu(self.shared(h))))
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(
                lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=False)
        return nn.functional.cross_entropy(self.head(h), y)


def wide_batches(width: int):
    """mlp_batches for a model whose input has `width` features."""
    def batches(steps, batch=16, seed=0):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            yield (torch.randn(batch, width, generator=generator),
                   torch.randint(0, 10, (batch,), generator=generator))
    return batches


@dataclasses.dataclass
class Scenario:
    model: Callable[[], nn.Module]
    batches: Callable  # batches(steps) -> iterator of (x, y), whole batches
    config: dict
    steps: int
    optimizer: str = "AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 0.0
    accumulation: int = 1
    atol: float = 1e-6
    state_dtype: str = "fp32"  # optimizer.params.state_dtype
    # The worker calls (loss / accumulation).backward(), as a PyTorch loop does, instead of
    # model.backward(loss) (Note [loss.backward()] in backward_pass.py).
    autograd_backward: bool = False
    # torch.nn.utils.clip_grad_norm_(model.parameters(), clip) before each step instead of the
    # config's gradient_clipping (Note [torch's clip_grad_norm_] in clip_grad.py).
    torch_clip: bool = False
    clip_norm_type: float = 2.0  # its norm_type
    # (micro-step, rank) whose loss the worker makes NaN before backward (config nonfinite_loss
    # "skip": every rank skips that backward and the step it belongs to).
    nan_loss: tuple[int, int] | None = None
    # Optimizer steps the worker replaces by optimizer.zero_grad() (the gradients dropped).
    discarded_steps: tuple[int, ...] = ()
    # optimizer.zero_grad(set_to_none=...) after each step, in the worker and the reference.
    set_to_none: bool = True
    # New weights after initialize(), before training (`reinitialize` on the model):
    # "apply" model.apply(reinitialize); "load" model.load_state_dict(...) and "module_load"
    # model.module.load_state_dict(...) of a plain model it reinitialized.
    reinitialize: str = ""
    # Micro-batches per epoch (0: no epochs): a step also ends each epoch, so with an epoch that
    # is not a multiple of `accumulation` its last accumulation is short (Note [A short
    # accumulation] in data_parallel.py). `steps * accumulation` micro-batches in all.
    epoch: int = 0
    # Without the config key gradient_accumulation_steps (Note [Accumulation without the key
    # under data parallelism] in data_parallel.py), the worker's loop as DDP scripts write it:
    # "every" reduces at every backward, "no_sync" runs all but a step's last micro-step under
    # `with model.no_sync():` (accelerate), "flag" sets `model.require_backward_grad_sync` to
    # whether the micro-step is the last (nanoGPT), "never" runs every micro-step under
    # no_sync (the step reduces).
    open_sync: str = ""
    # After each step the worker runs a no_grad forward of the step's last micro-batch, and then
    # with `empty_cache` model.empty_partition_cache() (DeepSpeed's, as RLHF loops call it after
    # generation).
    eval_after_step: bool = False
    empty_cache: bool = False

    def ends_step(self, micro: int) -> bool:
        """Whether optimizer.step() follows micro-batch `micro` (counted from 0)."""
        in_epoch = micro % self.epoch if self.epoch else micro
        return (in_epoch + 1) % self.accumulation == 0 or in_epoch + 1 == self.epoch

    def step_applied(self, step: int) -> bool:
        """Whether optimizer step `step` updates the parameters (as opposed to being skipped
        for `nan_loss` or dropped for `discarded_steps`)."""
        if step in self.discarded_steps:
            return False
        return self.nan_loss is None or self.nan_loss[0] // self.accumulation != step


class BlockStack(nn.Module):
    """dp_memory.py's model at a test's size: residual blocks, many chunk groups."""

    def __init__(self, blocks=8, width=64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
            nn.LayerNorm(width)) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def _mlp_frozen_first():
    model = MLP()
    model.layers[0].weight.requires_grad_(False)
    return model


def _gpt():
    return GPT(gpt_config())


def _gpt_batches(steps):
    return synthetic_batches(gpt_config(), batch=4, steps=steps)


SCENARIOS = {
    "mlp": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=10),
    # 3 chunks of device memory for 2 x 2 compute + gradient chunks: evictions on every rank.
    "mlp_tight": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096,
                                             "memory": {"device_budget": 3 * 4096 * 4}},
                          steps=10),
    "mlp_accumulation_clipping": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096},
                                          steps=4, clip=0.5, accumulation=3),
    # torch.nn.utils.clip_grad_norm_ by the largest gradient element, over every rank's shard.
    "mlp_clip_inf": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=4, clip=0.01,
                             torch_clip=True, clip_norm_type=float("inf")),
    "mlp_accumulation_keep": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096,
        "parallel": {"reshard_after_forward": False, "gradient_accumulation": "full"}},
        steps=4, clip=0.5, accumulation=3),
    # "mlp" over the torch.distributed process group (gloo) instead of shared memory, which
    # parallel.transport "auto" takes for ranks on one host.
    "mlp_process_group": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096,
                                                     "parallel": {"transport": "process_group"}},
                                  steps=10),
    "mlp_memory_saving": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096,
                                                     "parallel": {"memory_saving": True}},
                                  steps=5),
    # Parameters that Adam drives through zero differ by a few 1e-5 absolute after some steps
    # (torch's CPU sqrt, see test_initialize.py's GPT test).
    "gpt": Scenario(_gpt, _gpt_batches, {"default_chunk_size": 8192}, steps=10,
                    weight_decay=0.1, atol=5e-5),
    "gpt_tight": Scenario(_gpt, _gpt_batches, {
        "default_chunk_size": 8192,
        "memory": {"device_budget": int(2 * model_bytes(_gpt) * 0.5)}},
        steps=10, weight_decay=0.1, atol=5e-5),
    # gpt_tight with every group gathered only when first used (parallel.gather_ahead 0): the
    # same bytes as gathering ahead.
    "gpt_tight_no_ahead": Scenario(_gpt, _gpt_batches, {
        "default_chunk_size": 8192,
        "memory": {"device_budget": int(2 * model_bytes(_gpt) * 0.5)},
        "parallel": {"gather_ahead": 0}},
        steps=10, weight_decay=0.1, atol=5e-5),
    # Gathered copies kept between forward and backward: an eval forward after each step
    # leaves them gathered for the next training forward, unless empty_partition_cache() drops
    # them (then that forward gathers again).
    "mlp_keep_eval": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"reshard_after_forward": False}},
        steps=4, eval_after_step=True),
    "mlp_keep_eval_empty_cache": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"reshard_after_forward": False}},
        steps=4, eval_after_step=True, empty_cache=True),
    # Every gathered group kept until the optimizer step (parallel.reshard_after_forward off):
    # one allgather per group and step.
    "gpt_keep": Scenario(_gpt, _gpt_batches, {"default_chunk_size": 8192,
                                              "parallel": {"reshard_after_forward": False}},
                         steps=10, weight_decay=0.1, atol=5e-5),
    # Mixed precision: tracked against fp32 PyTorch loosely (test_initialize.py's bf16 test).
    "gpt_bf16": Scenario(_gpt, _gpt_batches, {"default_chunk_size": 16384,
                                              "bf16": {"enabled": True}}, steps=10),
    "mlp_fp16": Scenario(MLP, half_mlp_batches, {"default_chunk_size": 4096, "fp16": {
        "enabled": True, "initial_scale_power": 8}}, steps=10),
    # Sharded accumulation (the default) with 16-bit compute: fp32 gradient chunks summed into
    # the owner's shard each micro-step, the loss scale and clipping at the boundary.
    "mlp_fp16_accumulation": Scenario(MLP, half_mlp_batches, {"default_chunk_size": 4096, "fp16": {
        "enabled": True, "initial_scale_power": 8}}, steps=4, accumulation=3, clip=0.5),
    # Adam's moments in bf16 chunks (optimizer.params.state_dtype, issue 21), on their owners.
    "mlp_bf16_state": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=10,
                               state_dtype="bf16"),
    # 8-bit moments and their scale chunks, which must sit with the moments' owners.
    "mlp_int8_state": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=10,
                               state_dtype="int8"),
    # bf16 parameters updated in place without an fp32 master, Kahan-compensated on their
    # owners, then gathered; with 8-bit state: issue 21's 8 bytes per parameter.
    "mlp_bf16_no_master": Scenario(MLP, bf16_mlp_batches, {"default_chunk_size": 4096, "bf16": {
        "enabled": True, "master_weights": False}}, steps=10, state_dtype="int8"),
    "gpt_bf16_accumulation": Scenario(_gpt, _gpt_batches, {"default_chunk_size": 16384,
                                                           "bf16": {"enabled": True}},
                                      steps=4, accumulation=2),
    # A frozen tensor registered first in the model: compute chunks are packed trainable-first
    # so each parameter's compute and optimizer-state chunks share an owner.
    "mlp_frozen": Scenario(_mlp_frozen_first, mlp_batches, {"default_chunk_size": 4096},
                           steps=5),
    # Per-rank model data (issue 18): 8 blocks of 33k parameters in chunks of 16384 elements.
    "blocks": Scenario(BlockStack, wide_batches(64), {"default_chunk_size": 16384}, steps=3,
                       optimizer="Adam", weight_decay=0.0, atol=1e-5),
    # The chunk size searched for 2 ranks (Note [Chunk-size search] in chunk/chunk_layout.h).
    "blocks_auto": Scenario(BlockStack, wide_batches(64), {"default_chunk_size": "auto"},
                            steps=3, optimizer="Adam", weight_decay=0.0, atol=1e-5),
    # Sharded against full accumulation of the same block stack: per-rank peak (issue 18).
    "blocks_accumulation": Scenario(BlockStack, wide_batches(64), {"default_chunk_size": 16384},
                                    steps=2, accumulation=2, optimizer="Adam", weight_decay=0.0,
                                    atol=1e-5),
    "blocks_accumulation_full": Scenario(BlockStack, wide_batches(64), {
        "default_chunk_size": 16384, "parallel": {"gradient_accumulation": "full"}},
        steps=2, accumulation=2, optimizer="Adam", weight_decay=0.0, atol=1e-5),
    "branch": Scenario(RankDependentBranch, branch_batches, {"default_chunk_size": 2048},
                       steps=6),
    # zero_grad(set_to_none=False): the branch's parameters keep zero gradients in the steps
    # no rank takes it, and Adam moves them (Note [Gradients zeroed, not dropped]).
    "branch_zeroed": Scenario(RankDependentBranch, rare_branch_batches,
                              {"default_chunk_size": 2048}, steps=5, set_to_none=False),
    "branch_unused": Scenario(BranchWithUnused, branch_batches, {"default_chunk_size": 2048},
                              steps=4),
    # Sharded accumulation (parallel.gradient_accumulation "sharded", the default): the branch's
    # owner never has a gradient of it and only sums the other rank's, micro-step by micro-step.
    "branch_accumulation": Scenario(BranchWithUnused, branch_batches,
                                    {"default_chunk_size": 2048}, steps=3, accumulation=3),
    "mlp_accumulation_full": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"gradient_accumulation": "full"}},
        steps=4, clip=0.5, accumulation=3),
    # Rank 1's loss is NaN on the first micro-step of step 1 (config nonfinite_loss "skip"):
    # every rank skips that backward and the step; the accumulation boundaries that follow must
    # stay every third backward() call, counting the skipped one.
    "mlp_accumulation_skip": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "nonfinite_loss": "skip"},
        steps=4, clip=0.5, accumulation=3, nan_loss=(3, 1)),
    "mlp_accumulation_full_skip": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "nonfinite_loss": "skip",
        "parallel": {"gradient_accumulation": "full"}},
        steps=4, clip=0.5, accumulation=3, nan_loss=(3, 1)),
    # Step 1's gradients are computed and dropped by optimizer.zero_grad() (a GAN's
    # discriminator, which the generator's loss runs through): training goes on from there.
    # An epoch of 5 micro-batches with 3 per step: every second step is short (2 of 3), with
    # the config's clip, torch's clip_grad_norm_ before it, and full-size accumulation.
    "mlp_accumulation_epoch": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096},
                                       steps=4, clip=0.5, accumulation=3, epoch=5),
    "mlp_accumulation_epoch_torch_clip": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096},
                                                  steps=4, clip=0.5, accumulation=3, epoch=5,
                                                  torch_clip=True),
    "mlp_accumulation_full_epoch": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"gradient_accumulation": "full"}},
        steps=4, clip=0.5, accumulation=3, epoch=5),
    "mlp_accumulation_discard": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096},
                                         steps=4, clip=0.5, accumulation=3,
                                         discarded_steps=(1,)),
    # Note [Accumulation without the key under data parallelism]: PyTorch/DDP accumulation
    # loops with no gradient_accumulation_steps in the config; mixed with a short epoch, fp16's
    # model.backward, clipping and a dropped step.
    "open_every": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=4, clip=0.5,
                           accumulation=3, autograd_backward=True, open_sync="every", epoch=5),
    "open_no_sync": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=4, clip=0.5,
                             accumulation=3, autograd_backward=True, open_sync="no_sync",
                             discarded_steps=(1,)),
    "open_flag": Scenario(_gpt, _gpt_batches, {"default_chunk_size": 8192}, steps=3,
                          accumulation=2, autograd_backward=True, open_sync="flag",
                          torch_clip=True, clip=1.0, atol=1e-5),
    "open_never": Scenario(BranchWithUnused, branch_batches, {"default_chunk_size": 2048},
                           steps=3, accumulation=2, autograd_backward=True, open_sync="never"),
    "open_fp16": Scenario(MLP, half_mlp_batches, {"default_chunk_size": 4096, "fp16": {
        "enabled": True, "initial_scale_power": 8}}, steps=3, accumulation=2,
        open_sync="every", atol=2e-3),
    # model.apply(fn) on every rank after initialize(): the owners write, every rank trains on
    # the new weights (gathered copies dropped), with and without resharding.
    "mlp_apply": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=3,
                          reinitialize="apply"),
    "mlp_apply_keep": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"reshard_after_forward": False}}, steps=3,
        reinitialize="apply"),
    "mlp_load_keep": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"reshard_after_forward": False}}, steps=3,
        reinitialize="load"),
    "mlp_module_load_keep": Scenario(MLP, mlp_batches, {
        "default_chunk_size": 4096, "parallel": {"reshard_after_forward": False}}, steps=3,
        reinitialize="module_load"),
    "mlp_discard": Scenario(MLP, mlp_batches, {"default_chunk_size": 4096}, steps=5,
                            discarded_steps=(1, 2)),
}

# Note [Compute chunks re-made from the master] (chunk/chunk_manager_remake.cc): mixed precision
# with the owner's 16-bit compute chunks dropped between uses (parallel.remake_compute, the
# default) against the same runs keeping them ("_kept"): bit for bit the same training. A frozen
# 16-bit parameter (no master) keeps its chunk; without resharding the owner's chunks are made
# once per step.
_KEPT = {"remake_compute": False}
SCENARIOS["gpt_bf16_accumulation_kept"] = dataclasses.replace(
    SCENARIOS["gpt_bf16_accumulation"],
    config={**SCENARIOS["gpt_bf16_accumulation"].config, "parallel": _KEPT})
SCENARIOS["mlp_fp16_accumulation_kept"] = dataclasses.replace(
    SCENARIOS["mlp_fp16_accumulation"],
    config={**SCENARIOS["mlp_fp16_accumulation"].config, "parallel": _KEPT})
SCENARIOS["mlp_frozen_bf16"] = Scenario(_mlp_frozen_first, bf16_mlp_batches, {
    "default_chunk_size": 4096, "bf16": {"enabled": True}}, steps=5)
SCENARIOS["mlp_frozen_bf16_kept"] = Scenario(_mlp_frozen_first, bf16_mlp_batches, {
    "default_chunk_size": 4096, "bf16": {"enabled": True}, "parallel": _KEPT}, steps=5)
SCENARIOS["gpt_bf16_no_reshard"] = Scenario(_gpt, _gpt_batches, {
    "default_chunk_size": 16384, "bf16": {"enabled": True},
    "parallel": {"reshard_after_forward": False}}, steps=4, accumulation=2)
SCENARIOS["gpt_bf16_no_reshard_kept"] = Scenario(_gpt, _gpt_batches, {
    "default_chunk_size": 16384, "bf16": {"enabled": True},
    "parallel": {"reshard_after_forward": False, **_KEPT}}, steps=4, accumulation=2)
# Weights loaded after state_dict() gathered every group, without resharding (stale gathered
# copies trained once: test_weights_changed_after_initialize_reach_every_rank), with re-made
# compute chunks.
SCENARIOS["mlp_bf16_load_no_reshard"] = Scenario(MLP, bf16_mlp_batches, {
    "default_chunk_size": 4096, "bf16": {"enabled": True},
    "parallel": {"reshard_after_forward": False}}, steps=3, accumulation=2,
    reinitialize="load")
SCENARIOS["mlp_bf16_load_no_reshard_kept"] = dataclasses.replace(
    SCENARIOS["mlp_bf16_load_no_reshard"],
    config={**SCENARIOS["mlp_bf16_load_no_reshard"].config,
            "parallel": {"reshard_after_forward": False, **_KEPT}})
REMAKE_PAIRS = ["gpt_bf16_accumulation", "mlp_fp16_accumulation", "mlp_frozen_bf16",
                "gpt_bf16_no_reshard", "mlp_bf16_load_no_reshard"]

# Chunk-size boundaries (issue 18). BoundaryMLP's layers.0.weight has 2048 elements, its bias 64,
# layers.1 640 and 10. A weight exactly filling a chunk puts its bias in the next chunk of the
# same group, owned by the other rank (this crashed at the first forward); one element more
# leaves a hole; one less (2047) and half (1024) make the weight oversize (a padded group of its
# own, Note [Oversize groups] in chunk/chunk_layout.h); multiples pack several tensors whole.
BOUNDARY_CHUNKS = [1024, 2047, 2048, 2049, 4096, 6144]


def _boundary_mlp():
    return MLP((32, 64, 10))


for _chunk in BOUNDARY_CHUNKS:
    SCENARIOS[f"boundary_{_chunk}"] = Scenario(_boundary_mlp, mlp_batches,
                                              {"default_chunk_size": _chunk}, steps=3)
# Tensors larger than the chunk (issue 18): trained on N ranks as on one.
SCENARIOS["embedding_oversize"] = Scenario(EmbeddingModel, token_batches,
                                           {"default_chunk_size": 4096}, steps=5)
SCENARIOS["embedding_oversize_bf16"] = Scenario(
    EmbeddingModel, token_batches, {"default_chunk_size": 4096, "bf16": {"enabled": True}},
    steps=5)
# Issue 18's list of what must neither deadlock nor pair different groups, in small chunks
# (many groups): a module called twice, checkpoint recomputation (tied weights: "gpt"). 2112
# elements: inp fills a chunk exactly, the 64 x 64 weights are oversize (padded groups).
SCENARIOS["reused_recomputed"] = Scenario(ReusedAndRecomputed, mlp_batches,
                                          {"default_chunk_size": 2112}, steps=4)
# loss.backward() instead of model.backward(loss): with sharded accumulation and torch's
# clip_grad_norm_ (collectives at the end of backward, from the autograd callback), and with a module called
# twice plus checkpoint recomputation (the first access inside backward is a recomputed forward).
SCENARIOS["mlp_loss_backward"] = dataclasses.replace(SCENARIOS["mlp_accumulation_clipping"],
                                                     autograd_backward=True, torch_clip=True)
SCENARIOS["reused_recomputed_loss_backward"] = dataclasses.replace(
    SCENARIOS["reused_recomputed"], autograd_backward=True)
class ParameterContainers(nn.Module):
    """nn.ParameterList / nn.ParameterDict read by their holder (Note [torch's external reads])."""

    def __init__(self):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(32, 32) * 0.2) for _ in range(3)])
        self.affine = nn.ParameterDict({"shift": nn.Parameter(torch.zeros(32)),
                                        "scale": nn.Parameter(torch.ones(32))})
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        for weight in self.weights:
            x = torch.tanh(x @ weight)
        x = (x + self.affine["shift"]) * self.affine["scale"]
        return nn.functional.cross_entropy(self.head(x), y)


SCENARIOS["parameter_containers"] = Scenario(ParameterContainers, mlp_batches,
                                             {"default_chunk_size": 2048}, steps=4)
# The issue's reproducer at its size: Linear(256, 256) in a 2^16-element chunk.
SCENARIOS["boundary_65536"] = Scenario(lambda: MLP((256, 256, 10)), wide_batches(256),
                                       {"default_chunk_size": 65536}, steps=3)


def reinitialize(module: nn.Module) -> None:
    """New weights for every Linear (a write and a reassignment)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.2)
        module.bias.data = torch.full_like(module.bias, 0.1)


def reinitialized_state(s: Scenario) -> dict:
    """The scenario's model, built and reinitialized as `reference` does."""
    torch.manual_seed(0)
    model = s.model()
    torch.manual_seed(5)
    return model.apply(reinitialize).state_dict()


def shard(batch, rank: int, world: int):
    """This rank's contiguous slice of every tensor of a batch."""
    return tuple(t.chunk(world)[rank] for t in batch)


def reference(name: str, world: int, grads_read: list | None = None,
              norms: list | None = None):
    """Plain PyTorch on the whole batch (the loss is the mean of the ranks' shard losses, which
    equals the whole-batch loss for the mean-reduced losses used here and keeps the per-shard
    control flow of RankDependentBranch). Returns (losses per optimizer step, state dict);
    `grads_read` gets what each p.grad holds after each zero_grad (None or its sum of
    magnitudes), as dp_worker records it; `norms` the gradient norm of each applied step,
    before clipping."""
    s = SCENARIOS[name]
    torch.manual_seed(0)
    model = s.model()
    if s.reinitialize:
        model.load_state_dict(reinitialized_state(s))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(s.optimizer, trainable, s.lr, s.weight_decay)
    losses = []
    for step, batch in enumerate(s.batches(s.steps * s.accumulation)):
        batch = tuple(t.float() if t.is_floating_point() else t for t in batch)
        loss = sum(model(*shard(batch, r, world)) for r in range(world)) / world
        (loss / s.accumulation).backward()
        losses.append(loss.item())
        if s.ends_step(step):
            if s.step_applied(step // s.accumulation):
                if norms is not None:
                    norms.append(float(nn.utils.get_total_norm(
                        [p.grad for p in trainable if p.grad is not None])))
                if s.clip:
                    nn.utils.clip_grad_norm_(model.parameters(), s.clip, s.clip_norm_type)
                optimizer.step()
            optimizer.zero_grad(set_to_none=s.set_to_none)
            if grads_read is not None:
                grads_read.append([None if p.grad is None else float(p.grad.abs().sum())
                                   for p in model.parameters()])
    return losses, model.state_dict()


class ExternalUse(nn.Module):
    """The parent's forward reads `head`'s parameters directly (Note [External parameters] in
    external_params.py); `register` says whether it registers them."""

    def __init__(self, register: bool = True):
        super().__init__()
        self.trunk = nn.Linear(32, 64)
        self.head = nn.Linear(64, 10)
        if register:
            import patrickstar
            patrickstar.register_external_parameter(self, self.head.weight)
            patrickstar.register_external_parameter(self, self.head.bias)

    def forward(self, x, y):
        h = torch.relu(self.trunk(x))
        return nn.functional.cross_entropy(h @ self.head.weight.t() + self.head.bias, y)


SCENARIOS["external_parameters"] = Scenario(ExternalUse, mlp_batches,
                                            {"default_chunk_size": 1024}, steps=4)
