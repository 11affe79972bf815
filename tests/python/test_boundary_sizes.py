"""Boundary sizes crossed with the issue-21 features: parameters of chunk - 1, chunk, chunk + 1
and 2 * chunk elements, of 2047 / 2048 / 2049 (around the 8-bit state's quantization block),
of 1 and of 0 elements, a model that is exactly one chunk, and parameters larger than a chunk
(oversize chunks of their own), vector tails (15 / 17 / 31 / 33) and 4095 / 4097 at unaligned
offsets inside a chunk, hundreds of tiny parameters, a model frozen but for one bias, each
trained with `optimizer.params.state_dtype` fp32 / bf16 / int8 and with fp32 weights or bf16
weights without a master (`bf16.master_weights: false`; on one rank also with one, and fp16
weights with a static loss scale of 1).

Each run is compared with a plain-PyTorch reference of the same arithmetic: fp32 and bf16 state
with torch.optim.AdamW's step op for op (with the IEEE square root of the kernels,
test_adam_lowp.adamw_step_ieee_sqrt), the bf16 moments rounded back, int8 state
with test_adam_lowp's blockwise quantization and 8-bit step, bf16 weights without a master with
the Kahan rounding of Note [Low-precision Adam] over a `.bfloat16()` copy of the model, bf16
(and fp16) weights with a master as that arithmetic on an fp32 copy rounded into the 16-bit
one. Each also resumes exactly (k steps, save, load into a new engine, N - k steps equals N
steps; and through the model's and optimizer's state dicts). Two gloo ranks (one launch of
boundary_worker.py for every 2-rank case) check the same sizes under
data parallelism, with checkpoints resharded 2 -> 1 and 1 -> 2 and consolidated into a plain
state dict; NVMe and estimate_memory sweep the same sizes. The chunk size is small (512
elements) so that every boundary is cheap."""
from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.consolidate import consolidate
from test_adam_lowp import adamw_step_ieee_sqrt, int8_adamw_step, ref_dequantize, ref_quantize
from test_data_parallel import HERE, check_no_errors, launch

CHUNK = 512
BLOCK = 2048  # the 8-bit state's quantization block (kernels/quantization.h)
STEPS = 4
RESUME_AT = 2
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
K = patrickstar._C.ChunkKind
WORKER = os.path.join(HERE, "boundary_worker.py")

# Parameter shapes of each case. "mixed" packs every boundary into one model (a 1-element
# tensor beside a (chunk - 1)-element one fills a chunk exactly; 0-element parameters stay
# outside the chunks); "exact_chunk" is a whole model of exactly one chunk; "oversize" holds
# tensors of several chunks and several quantization blocks, some 2-D.
CASES = {
    "chunk-1": [(CHUNK - 1,)],
    "chunk": [(CHUNK,)],
    "chunk+1": [(CHUNK + 1,)],
    "2chunk": [(2 * CHUNK,)],
    "one": [(1,)],
    "block-1": [(BLOCK - 1,)],
    "block": [(BLOCK,)],
    "block+1": [(BLOCK + 1,)],
    "exact_chunk": [(100,), (CHUNK - 100,)],
    "oversize": [(7, 3 * CHUNK + 5), (BLOCK + 1, 3), (1, CHUNK), (2 * BLOCK,)],
    "mixed": [(1,), (CHUNK - 1,), (0,), (CHUNK,), (CHUNK + 1,), (BLOCK - 1,), (BLOCK,),
              (BLOCK + 1,), (2 * CHUNK,), (3,), (0, 4)],
    "frozen_first": [(CHUNK,), (CHUNK,), (CHUNK,), (1,)],
    # Vector tails around the SIMD kernels' 16 lanes, in chunks of 32: 15 + 17 fill one, 31
    # one but for an element, 33 is oversize; three chunks per list (on 2 ranks, the second
    # group is half padding).
    "tails": [(15,), (17,), (31,), (33,)],
    # Tensors of 2 blocks -+ 1 at offsets of no block or vector multiple inside one chunk
    # (chunk size CHUNKS["unaligned"]): the 8-bit blocks count from each tensor's start.
    "unaligned": [(15,), (2 * BLOCK - 1,), (17,), (2 * BLOCK + 1,), (33,), (31,)],
    # Hundreds of tiny parameters (a model's biases and norms), many to a chunk.
    "biases": [((i % 7) + 1,) for i in range(200)],
    # Everything frozen but one small bias, whose chunk is the model's last.
    "one_bias": [(CHUNK,), (CHUNK + 1,), (3,)],
}
# Chunk sizes other than CHUNK, by case.
CHUNKS = {"tails": 32, "unaligned": 4 * BLOCK}
# Parameters built frozen (requires_grad False), by case: a frozen chunk first shifts the
# trainable parameters' chunks (and, under data parallelism, their owners) against the
# frozen-free lists of masters, compensations and moments.
FROZEN = {"frozen_first": {0}, "one_bias": {0, 1}}
STATE_DTYPES = ["fp32", "bf16", "int8"]
WEIGHTS = ["fp32", "bf16_no_master"]


class Weighted(nn.Module):
    """One parameter of any shape: the dot product of its flattened values with the input's."""

    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape) * 0.5)

    def forward(self, x):
        return (x * self.weight.reshape(-1)).sum(-1)


class Bag(nn.Module):
    """Parameters of the given shapes, each its own module (so each is gathered alone), all
    feeding one scalar output: every element gets a gradient of its own each step."""

    def __init__(self, shapes):
        super().__init__()
        self.sizes = [math.prod(shape) for shape in shapes]
        self.parts = nn.ModuleList(Weighted(shape) for shape in shapes)

    def forward(self, x):
        pieces = x.split(self.sizes, dim=-1)
        return sum(torch.tanh(part(piece) / math.sqrt(max(1, piece.shape[-1])))
                   for part, piece in zip(self.parts, pieces))


def builder(case: str):
    def build():
        torch.manual_seed(0)
        model = Bag(CASES[case])
        for index in FROZEN.get(case, ()):
            model.parts[index].weight.requires_grad_(False)
        return model
    return build


def batches(case: str, steps: int = STEPS, batch: int = 4):
    generator = torch.Generator().manual_seed(1)
    total = sum(math.prod(shape) for shape in CASES[case])
    return [(torch.randn(batch, total, generator=generator),
             torch.randn(batch, generator=generator)) for _ in range(steps)]


def config(state_dtype: str, weights: str, **extra) -> dict:
    result = {"default_chunk_size": CHUNK,
              "optimizer": {"type": "AdamW", "params": {
                  "lr": LR, "weight_decay": WEIGHT_DECAY, "state_dtype": state_dtype}}}
    if weights == "bf16_no_master":
        result["bf16"] = {"enabled": True, "master_weights": False}
    if weights == "bf16_master":
        result["bf16"] = {"enabled": True}
    if weights == "fp16_master":  # a static scale of 1: the reference has no loss scaling
        result["fp16"] = {"enabled": True, "loss_scale": 1.0}
    result.update(copy.deepcopy(extra))
    return result


def input_dtype(weights: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weights[:4], torch.float32)


def loss_of(model, x, y, dtype):
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def train(model, optimizer, data, dtype, accumulation: int = 1) -> list[float]:
    losses = []
    for x, y in data:
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
            loss = loss_of(model, xs, ys, dtype)
            model.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def initialize(build, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(build, config=cfg)


def weights_of(model) -> dict[str, torch.Tensor]:
    """The trained values as the optimizer holds them: fp32 weights, the fp32 masters of bf16
    weights, or, without a master, the bf16 weights plus their Kahan compensation (what the
    next step starts from)."""
    state = model.state_dict()
    names = {id(p): n for n, p in model.module.named_parameters()}
    result = {}
    for index, param in enumerate(model.params.params):
        name = names[id(param)]
        value = state[name].float()
        if model.params.ids[index].master is not None:
            value = model.params.read(index, K.MASTER_PARAM).float()
        if model.params.ids[index].compensation is not None:
            value = value + model.params.read(index, K.PARAM_COMPENSATION).float()
        result[name] = value
    return result


# ---- the reference ------------------------------------------------------------------------

def reference(case: str, state_dtype: str, weights: str, data=None, accumulation: int = 1):
    """Plain PyTorch on the whole batch: (the module after the steps, {name: the value the
    optimizer holds}), by the arithmetic the engine's kernels implement (see the module
    docstring)."""
    return reference_of(builder(case)(), data if data is not None else batches(case), loss_of,
                        state_dtype, weights, accumulation)


def reference_of(model: nn.Module, data, loss, state_dtype: str, weights: str,
                 accumulation: int = 1):
    """`reference` for any module and loss(model, x, y, input dtype) (tied weights too: a
    module's parameters() lists a tied one once, with the sum of its uses' gradients). With
    `accumulation` > 1 each batch is that many micro-batches whose gradients (of the loss
    divided by their count, as model.backward divides it) add up in fp32, as the engine's
    gradient accumulators do; the whole batch's 16-bit gradient may differ in sign where its
    terms cancel, which moves such an element by 2 lr."""
    bf16 = weights == "bf16_no_master"
    # 16-bit weights with an fp32 master: the update's arithmetic on the master, the weights
    # its 16-bit rounding.
    masters = {} if not weights.endswith("_master") or bf16 else {
        name: param.detach().float().clone() for name, param in model.named_parameters()}
    model = model.to(input_dtype(weights))
    masters = {param: masters[name] for name, param in model.named_parameters()
               if name in masters}
    dtype = input_dtype(weights)
    state = {}
    for step, (x, y) in enumerate(data, 1):
        grads = {}
        if accumulation == 1:
            loss(model, x, y, dtype).backward()
            grads = {param: param.grad for param in model.parameters()}
        else:
            for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
                (loss(model, xs, ys, dtype) / accumulation).backward()
                for param in model.parameters():
                    if param.grad is not None:
                        grads[param] = param.grad.float() + grads.get(param, 0)
                        param.grad = None
        with torch.no_grad():
            for param in model.parameters():
                param.grad = None
                if param.numel() == 0 or grads.get(param) is None:  # no elements, or frozen
                    continue
                flat = (masters[param] if masters else param.detach()).reshape(-1).float()
                grad = grads[param].reshape(-1).float()
                n = flat.numel()
                if param not in state:
                    state[param] = {"comp": torch.zeros(n), "m": torch.zeros(n),
                                    "v": torch.zeros(n)}
                s = state[param]
                if state_dtype == "int8":
                    update, m, v = int8_adamw_step(flat, grad, s["m"], s["v"], step, LR, BETAS,
                                                   EPS, WEIGHT_DECAY)
                    s["m"] = ref_dequantize(*ref_quantize(m, True), True)
                    s["v"] = ref_dequantize(*ref_quantize(v, False), False)
                else:
                    update, m, v = adamw_step_ieee_sqrt(flat, grad, s["m"], s["v"], step, LR,
                                                        BETAS, EPS, WEIGHT_DECAY)
                    if state_dtype == "bf16":
                        m, v = m.bfloat16().float(), v.bfloat16().float()
                    s["m"], s["v"] = m, v
                if bf16:  # Kahan: y = (q - p) + c; p' = bf16(p + y); c' = bf16(y - (p' - p))
                    y_ = (update - flat) + s["comp"]
                    rounded = (flat + y_).bfloat16()
                    s["comp"] = (y_ - (rounded.float() - flat)).bfloat16().float()
                    update = rounded.float()
                if masters:
                    masters[param].copy_(update.view(param.shape))
                param.copy_(update.view(param.shape))
    held = {}
    for name, param in model.named_parameters():
        # (a frozen parameter has no master: its weights are what the engine holds)
        value = (masters[param] if masters and param.requires_grad else param.detach()).float()
        if bf16 and param in state:
            value = value + state[param]["comp"].view(param.shape)
        held[name] = value
    return model, held


# An ulp of difference (torch's MKL square root, where a reference still takes it, differs from the
# kernels' by one now and then; see adamw_step_ieee_sqrt) grows over the steps. With int8 state it
# may move a moment across a code boundary (one code of one element: ~1e-4 here); without a
# master it may round a bf16 weight the other way, which the compensation then carries with
# bf16 precision (~1e-5). A quantization block or chunk mishandled at a boundary moves whole
# blocks by about lr per step.
# Gradients summed in another order than the reference's (micro-batches, two ranks' average)
# differ by an ulp here and there, and a bf16 moment may then round to its neighbour: that
# element moves by up to lr * 2^-8 per step (seen: 1.3e-5, one weight of 2047, on an AMD EPYC).
def tolerance(state_dtype: str, weights: str, reordered: bool = False) -> dict:
    if state_dtype == "int8":
        return dict(rtol=0, atol=2e-3)
    if weights == "bf16_no_master":
        return dict(rtol=1e-4, atol=2e-5)
    if state_dtype == "bf16" and reordered:
        return dict(rtol=1e-5, atol=STEPS * LR * 2 ** -8)
    return dict(rtol=1e-5, atol=1e-6)


def assert_matches(ours: dict, ref: dict, state_dtype: str, weights: str,
                   what: str = "", reordered: bool = False) -> None:
    assert set(ours) == {k for k, v in ref.items() if v.numel()}, what
    for name, value in ours.items():
        torch.testing.assert_close(value, ref[name],
                                   **tolerance(state_dtype, weights, reordered),
                                   msg=lambda m: f"{what} {name}: {m}")


def assert_equal_states(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{what} {key}"


def cpu_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_resumes_exactly(tmp_path, build, cfg, train_on, data, losses: list[float],
                           final: dict) -> list[dict]:
    """Trains to RESUME_AT, saves, and resumes through the checkpoint and through both state
    dicts (torch.save's recipe): each resumed run must give `losses` and end at `final`.
    Returns the resumed runs' module states."""
    model, optimizer = initialize(build, cfg)
    first = train_on(model, optimizer, data[:RESUME_AT])
    model.save_checkpoint(str(tmp_path), tag="t")
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    model.destroy()
    states = []
    for how in ("checkpoint", "state dicts"):
        model, optimizer = initialize(build, cfg)
        if how == "checkpoint":
            model.load_checkpoint(str(tmp_path), "t")
        else:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
        second = train_on(model, optimizer, data[RESUME_AT:])
        states.append(cpu_state(model))
        model.destroy()
        assert first + second == losses, how
        assert_equal_states(states[-1], final, how)
    return states


# ---- one rank -----------------------------------------------------------------------------

@pytest.mark.parametrize("weights", WEIGHTS + ["bf16_master", "fp16_master"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_trains_like_the_reference_and_resumes_exactly(tmp_path, case, state_dtype,
                                                                weights):
    build, data, dtype = builder(case), batches(case), input_dtype(weights)
    cfg = config(state_dtype, weights, default_chunk_size=CHUNKS.get(case, CHUNK))
    model, optimizer = initialize(build, cfg)
    losses = train(model, optimizer, data, dtype)
    held, final = weights_of(model), cpu_state(model)
    optimizer_state = optimizer.state_dict()
    model.destroy()
    ref_model, ref_held = reference(case, state_dtype, weights)
    assert_matches(held, ref_held, state_dtype, weights)
    # The module's view: every parameter (those without elements too) in the compute dtype.
    ref_state = ref_model.state_dict()
    assert final.keys() == ref_state.keys()
    assert all(final[k].dtype == ref_state[k].dtype and final[k].shape == ref_state[k].shape
               for k in final)
    # 8-bit state: one scale per 2048 elements of each tensor, counted from its start.
    for index, entry in optimizer_state["state"].items():
        if state_dtype == "int8" and entry["exp_avg"].numel():
            assert entry["exp_avg_scale"].numel() == -(-entry["exp_avg"].numel() // BLOCK)

    assert_resumes_exactly(tmp_path, build, cfg, lambda m, o, d: train(m, o, d, dtype), data,
                           losses, final)


@pytest.mark.parametrize("weights", WEIGHTS + ["bf16_master"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("case", ["mixed", "tails", "unaligned", "biases", "one_bias"])
def test_one_rank_accumulating_gradients_trains_like_the_reference_and_resumes_exactly(
        tmp_path, case, state_dtype, weights):
    # gradient_accumulation_steps 2: fp32 gradient accumulators (16-bit weights too) at every
    # boundary, against the reference of two micro-batches summed in fp32.
    build, data, dtype = builder(case), batches(case), input_dtype(weights)
    cfg = config(state_dtype, weights, default_chunk_size=CHUNKS.get(case, CHUNK),
                 gradient_accumulation_steps=2)
    model, optimizer = initialize(build, cfg)
    losses = train(model, optimizer, data, dtype, accumulation=2)
    held, final = weights_of(model), cpu_state(model)
    model.destroy()
    _, ref_held = reference(case, state_dtype, weights, accumulation=2)
    assert_matches(held, ref_held, state_dtype, weights, reordered=True)
    model, optimizer = initialize(build, cfg)
    first = train(model, optimizer, data[:RESUME_AT], dtype, accumulation=2)
    model.save_checkpoint(str(tmp_path), tag="t")
    model.destroy()
    model, optimizer = initialize(build, cfg)
    model.load_checkpoint(str(tmp_path), "t")
    second = train(model, optimizer, data[RESUME_AT:], dtype, accumulation=2)
    resumed = cpu_state(model)
    model.destroy()
    assert first + second == losses
    assert_equal_states(resumed, final, "resumed")


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_nvme_streams_every_boundary_size_bit_for_bit(nvme_dir, state_dtype, weights):
    # A host budget of a few chunks: the moments, their 8-bit scales (chunks of 1-2 floats
    # here) and the oversize chunks spill to NVMe and come back unchanged.
    case, dtype = "mixed", input_dtype(weights)
    data = batches(case)
    model, optimizer = initialize(builder(case), config(state_dtype, weights))
    expected = train(model, optimizer, data, dtype), cpu_state(model)
    model.destroy()
    small = config(state_dtype, weights,
                   memory={"host_budget": 3 * CHUNK * 4 + 160 * 1024, "nvme": {"path": nvme_dir}})
    model, optimizer = initialize(builder(case), small)
    losses = train(model, optimizer, data, dtype)
    assert sum(t["bytes_in"] for t in model.memory_stats() if t["kind"] == "nvme") > 0
    state = cpu_state(model)
    model.destroy()
    assert losses == expected[0]
    assert_equal_states(state, expected[1], "nvme")


@pytest.mark.parametrize("weights", WEIGHTS + ["bf16_master"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("chunk", [1, CHUNK, BLOCK, "auto"])
def test_estimate_memory_equals_the_layout_at_every_boundary(chunk, state_dtype, weights):
    for accumulation in (1, 2):
        cfg = config(state_dtype, weights, default_chunk_size=chunk,
                     gradient_accumulation_steps=accumulation)
        estimate = patrickstar.estimate_memory(builder("mixed"), config=cfg, verbose=False)
        mode = estimate["modes"][{"fp32": "fp32", "bf16_master": "fp16/bf16",
                                  "bf16_no_master": "bf16, no master"}[weights]]
        model, _ = initialize(builder("mixed"), cfg)
        chunks = json.loads(model.chunks.layout_json())["chunks"]
        model.destroy()
        assert mode["total"] == sum(c["bytes"] for c in chunks), (accumulation, mode)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("case", list(CHUNKS) + ["biases", "one_bias"])
def test_estimate_and_memory_stats_equal_the_layout_of_small_and_unaligned_tensors(
        case, state_dtype, weights):
    # Each chunk kind's bytes (frozen chunks have compute chunks only; 8-bit scale lists
    # mirror their moments) as estimate_memory counts them, and the peak of the tiers' chunk
    # bytes over the steps is the whole layout (one rank keeps every chunk).
    cfg = config(state_dtype, weights, default_chunk_size=CHUNKS.get(case, CHUNK))
    estimate = patrickstar.estimate_memory(builder(case), config=cfg, verbose=False)
    mode = estimate["modes"][{"fp32": "fp32", "bf16_no_master": "bf16, no master"}[weights]]
    model, optimizer = initialize(builder(case), cfg)
    chunks = json.loads(model.chunks.layout_json())["chunks"]
    train(model, optimizer, batches(case), input_dtype(weights))
    stats, peak = model.memory_stats(), model.peak_model_bytes
    model.destroy()
    total = sum(c["bytes"] for c in chunks)
    assert mode["total"] == total == peak, (mode, total, peak)
    assert sum(t["chunk_bytes"] for t in stats) <= total
    moments = [c for c in chunks if c["kind"] == "momentum"]
    assert sum(t["numel"] for c in moments for t in c["tensors"]) == sum(
        math.prod(shape) for index, shape in enumerate(CASES[case])
        if index not in FROZEN.get(case, ()))


# ---- parameters without elements ----------------------------------------------------------

class Prefixed(nn.Module):
    """Prefix tuning with `virtual` learned tokens in front of the embeddings (0: none)."""

    def __init__(self, virtual: int = 0, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.prefix = nn.Parameter(torch.randn(virtual, width))
        self.embedding = nn.Embedding(10, width)
        self.head = nn.Linear(width, 3)

    def forward(self, ids):
        tokens = torch.cat([self.prefix.expand(ids.shape[0], -1, -1), self.embedding(ids)], 1)
        return self.head(tokens).float().mean()


@pytest.mark.parametrize("master_weights", [True, False])
def test_a_parameter_without_elements_takes_the_compute_dtype(tmp_path, master_weights):
    # Note [Parameters without elements follow the compute dtype] in engine.py: it stayed fp32
    # in a bf16 engine, so torch.cat promoted the activations and the head raised "mat1 and
    # mat2 must have the same dtype"; PyTorch's model.bfloat16() trains.
    cfg = {"default_chunk_size": CHUNK, "bf16": {"enabled": True,
                                                 "master_weights": master_weights},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "state_dtype": "int8"}}}
    model, optimizer = initialize(Prefixed, cfg)
    reference = Prefixed().bfloat16()
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(3))
    assert {n: p.dtype for n, p in model.module.named_parameters()} == \
        {n: p.dtype for n, p in reference.named_parameters()}
    loss = model(ids)
    assert torch.equal(loss, reference(ids))
    model.backward(loss)
    optimizer.step()
    state = model.state_dict()
    assert {k: v.dtype for k, v in state.items()} == \
        {k: v.dtype for k, v in reference.state_dict().items()}
    model.save_checkpoint(str(tmp_path / "checkpoint"), tag="t")
    model.destroy()
    # Consolidated, it converts to --dtype as every other weight (Note [Saved parameters
    # without elements] in checkpoint/engine_state.py): it was kept as a buffer is, in its
    # saved dtype.
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                               ("fp16", torch.float16)):
        consolidated = consolidate(str(tmp_path / "checkpoint"),
                                   str(tmp_path / f"model-{dtype}.pt"), dtype=dtype)
        assert consolidated["tensors"] == len(state)
        plain = torch.load(tmp_path / f"model-{dtype}.pt")
        assert {k: v.dtype for k, v in plain.items()} == {k: torch_dtype for k in state}, dtype
    reference.load_state_dict(plain)  # loads into the plain model


def reference_gradients(case: str, weights: str, x, y) -> dict[str, torch.Tensor]:
    model = builder(case)()
    if weights == "bf16_no_master":
        model = model.bfloat16()
    loss_of(model, x, y, input_dtype(weights)).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def gradient_tolerance(weights: str) -> dict:
    return dict(rtol=1e-5, atol=1e-7) if weights == "fp32" else dict(rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_full_gradients_of_every_boundary_size_are_pytorchs(weights):
    # Note [Gradients of parameters without elements] in engine.py: the logging loop over
    # named_parameters() raised KeyError ("no parameter 'parts.2.weight'") at the first
    # parameter without elements, and safe_get_full_grad called it no engine's parameter.
    case = "mixed"
    model, optimizer = initialize(builder(case), config("int8", weights))
    x, y = batches(case)[0]
    model.backward(loss_of(model, x, y, input_dtype(weights)))
    expected = reference_gradients(case, weights, x, y)
    for name, param in model.module.named_parameters():
        for gradient in (model.full_gradient(name), patrickstar.safe_get_full_grad(param)):
            # (fp32, as DeepSpeed's: an fp32 copy of the 16-bit gradients)
            torch.testing.assert_close(gradient.float(), expected[name].float(),
                                       **gradient_tolerance(weights),
                                       msg=lambda m: f"{name}: {m}")
    optimizer.step()
    optimizer.zero_grad()
    assert all(model.full_gradient(name) is None for name, _ in model.named_parameters())
    model.destroy()


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_the_state_view_of_a_parameter_without_elements_is_torchs(state_dtype):
    # Note [Saved state of parameters without elements] in optimizer.py: state_dict() gave a
    # parameter without elements torch's stepped entry (step, empty moments) while
    # `optimizer.state[p]` was {} and `optimizer.state` did not list it, so a loop over
    # `optimizer.state[p]["exp_avg"]` for each parameter raised KeyError where torch's works.
    case, weights = "mixed", "fp32"
    model, optimizer = initialize(builder(case), config(state_dtype, weights))
    reference = builder(case)()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    params = list(model.module.parameters())
    assert len(optimizer.state) == len(torch_optimizer.state) == 0
    assert all(optimizer.state[p] == {} for p in params)
    x, y = batches(case)[0]
    model.backward(loss_of(model, x, y, torch.float32))
    optimizer.step()
    loss_of(reference, x, y, torch.float32).backward()
    torch_optimizer.step()
    assert len(optimizer.state) == len(torch_optimizer.state) == len(params)
    assert {id(p) for p in optimizer.state} == {id(p) for p in params}
    saved = optimizer.state_dict()["state"]
    for number, (param, plain) in enumerate(zip(params, reference.parameters())):
        entry, expected = optimizer.state[param], torch_optimizer.state[plain]
        assert set(expected) <= set(entry), number
        assert all(entry[k].shape == expected[k].shape for k in ("exp_avg", "exp_avg_sq"))
        assert float(entry["step"]) == float(expected["step"]) == 1
        assert set(entry) == set(saved[number]), number  # the state dict's entry
    model.destroy()


class ReadsAnEmptyChild(nn.Module):
    """Reads parameters its children own without calling them: one without elements through
    an attribute and one in an nn.ParameterList (found as external reads, Note [Reads found in
    the module's code] in external_params.py)."""

    def __init__(self):
        super().__init__()
        self.child = nn.Module()
        self.child.empty = nn.Parameter(torch.zeros(0))
        self.child.scale = nn.Parameter(torch.full((3,), 0.5))
        self.listed = nn.ParameterList([nn.Parameter(torch.zeros(0, 4)),
                                        nn.Parameter(torch.linspace(-1, 1, 4))])

    def forward(self, x):
        total = self.child.empty.sum() + self.listed[0].sum()
        return ((x @ self.listed[1]) * self.child.scale.sum()).square().mean() + total


def test_a_parameter_without_elements_read_by_another_module_trains_as_in_pytorch():
    # initialize() raised "ReadsAnEmptyChild holds a parameter of shape (0,) that is not one
    # model_func built into the chunks": the empty parameter, kept outside the chunks, was
    # taken for a Parameter made after model_func.
    torch.manual_seed(0)
    model, optimizer = initialize(ReadsAnEmptyChild,
                                  {"default_chunk_size": CHUNK, "optimizer": {
                                      "type": "AdamW", "params": {"lr": LR}}})
    reference = ReadsAnEmptyChild()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        loss, expected = model(x), reference(x)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)
    model.destroy()


def test_a_built_module_whose_initialize_fails_gets_its_fp32_empty_parameter_back():
    # Note [A built module given back when initialize() fails]: every parameter returns in the
    # dtype it was built in, the one without elements too.
    built = Prefixed()

    def groups(model):
        raise KeyError("no such layer")

    with pytest.raises(KeyError):
        patrickstar.initialize(built, config={"default_chunk_size": CHUNK,
                                              "bf16": {"enabled": True}}, param_groups=groups)
    assert {n: p.dtype for n, p in built.named_parameters()} == \
        {n: torch.float32 for n, _ in built.named_parameters()}
    built(torch.randint(0, 10, (2, 5))).backward()  # the plain fp32 module trains


# ---- two ranks ----------------------------------------------------------------------------

# (case, state dtype, weights, variant) of each 2-rank run: the cases whose chunk groups differ
# (padding chunks, oversize groups, a 1-element model, one chunk for the whole model), each
# state dtype with both kinds of weights on the mixed case, and NVMe and gradient accumulation
# there too.
TWO_RANK = [(case, state, weights, "plain") for case in ("mixed", "oversize")
            for state in STATE_DTYPES for weights in WEIGHTS] + [
    ("exact_chunk", "int8", "bf16_no_master", "plain"),
    ("frozen_first", "int8", "bf16_no_master", "plain"),
    ("frozen_first", "bf16", "fp32", "plain"),
    ("one", "int8", "fp32", "plain"),
    ("chunk+1", "int8", "bf16_no_master", "plain"),
    ("mixed", "int8", "bf16_no_master", "nvme"),
    ("mixed", "int8", "fp32", "nvme"),
    ("mixed", "int8", "bf16_no_master", "accumulation"),
    ("mixed", "bf16", "fp32", "accumulation"),
    # Rank 1 owns the frozen-free lists' padding only (one trainable 3-element bias, one
    # moment chunk); hundreds of tiny tensors; 8-bit blocks and vector tails inside a chunk.
    ("one_bias", "int8", "bf16_no_master", "plain"),
    ("one_bias", "fp32", "fp32", "plain"),
    ("biases", "int8", "fp32", "plain"),
    ("unaligned", "int8", "bf16_no_master", "plain"),
    ("tails", "bf16", "fp32", "plain"),
]


def run_id(run) -> str:
    return "-".join(run)


def run_config(run, nvme_path: str | None = None, world: int = 2) -> dict:
    case, state, weights, variant = run
    extra = {}
    if world > 1:
        extra["parallel"] = {"collective_timeout": 30}
    if variant == "nvme":
        # A few chunks beside the activations of this rank's share of the batch (bf16 ones
        # are half as large, as are the bf16 chunks). With slabs that grow with their size's
        # use, a rank's share of bf16 chunks fitted three fp32 chunks' bytes and rank 1's NVMe
        # took nothing: the bf16 budget of two ranks is 8 KiB tighter.
        half = weights == "bf16_no_master"
        activations = {1: 400, 2: 282}[world] // (2 if half else 1) - (8 if half and world == 2
                                                                       else 0)
        extra["memory"] = {"host_budget": 3 * CHUNK * (2 if half else 4) + activations * 1024,
                           "nvme": {"path": nvme_path}}
    if variant == "accumulation":
        extra["gradient_accumulation_steps"] = 2
    return config(state, weights, default_chunk_size=CHUNKS.get(case, CHUNK), **extra)


def one_rank_source(out, run) -> str:
    return os.path.join(out, f"one-{run_id(run)}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One rank's checkpoint after RESUME_AT steps of each run (the 2 ranks load it), then one
    launch of boundary_worker.py for every run."""
    out = tmp_path_factory.mktemp("boundary")
    ones = {}
    for run in TWO_RANK:
        cfg = run_config(run, nvme_path=str(out), world=1)
        model, optimizer = initialize(builder(run[0]), cfg)
        train(model, optimizer, batches(run[0], batch=8)[:RESUME_AT], input_dtype(run[2]),
              cfg.get("gradient_accumulation_steps", 1))
        model.save_checkpoint(one_rank_source(out, run), tag="t")
        ones[run] = cpu_state(model)
        model.destroy()
    results = launch(out, 2, *map(run_id, TWO_RANK), worker=WORKER)
    check_no_errors(results)
    return out, ones, results


@pytest.mark.parametrize("run", TWO_RANK, ids=run_id)
def test_two_ranks_train_resume_and_reshard_at_every_boundary(two_ranks, run):
    out, ones, results = two_ranks
    case, state_dtype, weights, variant = run
    per_rank = [r.get(run_id(run), {"error": "no result"}) for r in results]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
    first, second = per_rank
    # Both ranks hold the same model, and each resumed bit for bit from its checkpoint.
    assert_equal_states(first["final"], second["final"], "rank 0 vs 1")
    for rank, result in enumerate(per_rank):
        assert result["resumed_losses"] == result["losses"], rank
        assert_equal_states(result["resumed"], result["final"], f"rank {rank} resumed")
        # The 1-rank checkpoint split over 2 ranks: its values exactly.
        assert_equal_states(result["from_one"], ones[run], f"rank {rank} 1 -> 2")
        if "initial_losses" in result:  # restored to the start: a new engine's steps
            assert result["initial_losses"] == result["fresh_losses"], rank
            assert_equal_states(result["initial_final"], result["fresh_final"], "initial")
        if weights == "bf16_no_master":  # Note [The weights a compensation belongs to]
            assert result["dcp_losses"] == result["losses"][-len(result["dcp_losses"]):], rank
            assert_equal_states(result["dcp_final"], result["final"], f"rank {rank} dcp")
    if variant == "nvme":
        assert all(r["nvme_bytes"] > 0 for r in per_rank), [r["nvme_bytes"] for r in per_rank]
    # The averaged gradients of the first batch, on every rank, as one process's p.grad (an
    # accumulation's two halves: the mean of their gradients, as the whole batch's).
    x, y = batches(case, batch=8)[0]
    expected = reference_gradients(case, weights, x, y)
    for rank, result in enumerate(per_rank):
        assert result["gradients"].keys() == expected.keys()
        for name, gradient in result["gradients"].items():
            if expected[name] is None:  # frozen
                assert gradient is None, (rank, name)
                continue
            torch.testing.assert_close(gradient.float(), expected[name].float(),
                                       **gradient_tolerance(weights),
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    # Against the whole-batch reference: fp32 weights to the one-rank tolerance (the gradient
    # average's order aside); bf16 weights within two of their ulps (the ranks' bf16 gradients
    # are averaged in another order than one rank's backward sums them).
    # An accumulation's reference: the micro-batches of both ranks (2 rows each) summed in
    # fp32, as the engine's accumulators and the ranks' average add them (in another order).
    data = batches(case, batch=8)
    ref_model, ref_held = reference(case, state_dtype, weights, data,
                                    accumulation=4 if variant == "accumulation" else 1)
    if weights == "fp32":
        assert_matches({k: v.float() for k, v in first["final"].items() if v.numel()},
                       ref_held, state_dtype, weights, "2 ranks", reordered=True)
    else:
        for name, value in ref_model.state_dict().items():
            torch.testing.assert_close(first["final"][name].float(), value.float(),
                                       rtol=2 ** -7, atol=2e-2, msg=lambda m: f"{name}: {m}")

    # 2 -> 1: the 2-rank checkpoint loads on one rank exactly, and so does its consolidation.
    path = os.path.join(out, f"two-{run_id(run)}")
    cfg = run_config(run, nvme_path=str(out), world=1)
    model, optimizer = initialize(builder(case), cfg)
    with pytest.raises(Exception, match="allow_reshard=True"):
        model.load_checkpoint(path, "t")
    model.load_checkpoint(path, "t", allow_reshard=True)
    assert_equal_states(cpu_state(model), first["at_save"], "2 -> 1")
    rest = train(model, optimizer, batches(case, batch=8)[RESUME_AT:], input_dtype(weights),
                 cfg.get("gradient_accumulation_steps", 1))
    assert all(math.isfinite(loss) for loss in rest)
    model.destroy()
    compute = "bf16" if weights == "bf16_no_master" else "fp32"
    consolidate(path, str(out / f"{run_id(run)}.pt"), dtype=compute)
    assert_equal_states(torch.load(out / f"{run_id(run)}.pt"), first["at_save"], "consolidated")
