"""Boundary sizes of the low-precision options that test_boundary_sizes.py's one-parameter-per-
module bag does not reach: a GPT-2-sized vocabulary (50257, odd, not a multiple of the 8-bit
state's 2048-element block nor of a 16-lane vector) on an embedding tied to the head, whose
gradient is the sum of its two uses, with a head bias of the same odd size; each with every
state dtype, fp32 weights or bf16 weights without a master, against the plain-PyTorch
reference of test_boundary_sizes.py; resumed through a checkpoint and through the optimizer's
state dict, bit for bit, and streamed through NVMe bit for bit. Also torch.optim.AdamW's state
dict of boundary sizes (0 and 1 elements, chunk and block edges) loaded into each state dtype,
and checkpoints of boundary sizes loaded across state dtypes."""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.moment_state import dequantize_moment
from test_boundary_sizes import BLOCK, BETAS, CHUNKS, EPS, LR, RESUME_AT, STATE_DTYPES, STEPS
from test_boundary_sizes import CHUNK as BOUNDARY_CHUNK
from test_boundary_sizes import (WEIGHT_DECAY, WEIGHTS, assert_equal_states, assert_matches,
                                 assert_resumes_exactly, batches, builder, config, cpu_state,
                                 initialize, input_dtype, loss_of, reference_of, train,
                                 weights_of)
from test_data_parallel import HERE, check_no_errors, launch

VOCAB, WIDTH = 50257, 8
CHUNK = 1 << 16  # smaller than the tied embedding (an oversize chunk), larger than the bias


class TiedLM(nn.Module):
    """An embedding and a head sharing one weight (GPT-2's), the head with a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.wte(ids))


def tied_loss(model, ids, targets, dtype):
    return nn.functional.cross_entropy(model(ids).float().view(-1, VOCAB), targets.view(-1))


def tied_batches(steps: int = STEPS, batch: int = 2):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, 6), generator=generator),
             torch.randint(0, VOCAB, (batch, 6), generator=generator)) for _ in range(steps)]


def tied_train(model, optimizer, data) -> list[float]:
    losses = []
    for ids, targets in data:
        loss = tied_loss(model, ids, targets, None)
        model.backward(loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_a_tied_odd_vocabulary_trains_like_the_reference_and_resumes_exactly(
        tmp_path, state_dtype, weights):
    cfg, data = config(state_dtype, weights, default_chunk_size=CHUNK), tied_batches()
    model, optimizer = initialize(TiedLM, cfg)
    assert [n for n, _ in model.module.named_parameters()] == ["wte.weight", "head.bias"]
    losses = tied_train(model, optimizer, data)
    held, final = weights_of(model), cpu_state(model)
    model.destroy()
    _, ref_held = reference_of(TiedLM(), data, tied_loss, state_dtype, weights)
    assert_matches(held, ref_held, state_dtype, weights)

    for resumed in assert_resumes_exactly(tmp_path, TiedLM, cfg, tied_train, data, losses, final):
        # The tied keys share one tensor, as in PyTorch's state dict.
        assert resumed["wte.weight"].data_ptr() != 0 and torch.equal(resumed["wte.weight"],
                                                                     resumed["head.weight"])


# Host budgets (MiB) just above what one Adam update of the tied weight holds there at once
# (below it, initialize refuses the budget): the other chunks spill to NVMe during training.
NVME_HOST_MIB = {("fp32", "fp32"): 3.2, ("fp32", "bf16_no_master"): 4.0,
                 ("bf16", "fp32"): 1.6, ("bf16", "bf16_no_master"): 2.4,
                 ("int8", "fp32"): 1.6, ("int8", "bf16_no_master"): 1.6}


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_a_tied_odd_vocabulary_streams_through_nvme_bit_for_bit(nvme_dir, state_dtype, weights):
    data = tied_batches()
    model, optimizer = initialize(TiedLM, config(state_dtype, weights, default_chunk_size=CHUNK))
    expected = tied_train(model, optimizer, data), cpu_state(model)
    model.destroy()
    cfg = config(state_dtype, weights, default_chunk_size=CHUNK,
                 memory={"host_budget": int(NVME_HOST_MIB[state_dtype, weights] * 2 ** 20),
                         "nvme": {"path": nvme_dir}})
    model, optimizer = initialize(TiedLM, cfg)
    losses = tied_train(model, optimizer, data)
    assert sum(t["bytes_in"] for t in model.memory_stats() if t["kind"] == "nvme") > 0
    state = cpu_state(model)
    model.destroy()
    assert losses == expected[0]
    assert_equal_states(state, expected[1], "nvme")


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_torchs_adamw_state_of_boundary_sizes_loads_and_trains_on(state_dtype):
    # torch.optim.AdamW's state dict after RESUME_AT steps of test_boundary_sizes' "mixed"
    # model (parameters of 0 and 1 elements, around the chunk and the 8-bit block), loaded
    # into an engine of each state dtype (quantized or rounded at the load), trains on as
    # torch does: fp32 state to the one-rank tolerance; bf16 and int8 state within the int8
    # tolerance, since torch's moments stay fp32 after the load. An fp32 engine's state dict
    # loads back into torch the same way.
    case, data = "mixed", batches("mixed")
    reference = builder(case)()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                        weight_decay=WEIGHT_DECAY)

    def torch_steps(module, optimizer, steps):
        for x, y in steps:
            loss_of(module, x, y, torch.float32).backward()
            optimizer.step()
            optimizer.zero_grad()

    torch_steps(reference, torch_optimizer, data[:RESUME_AT])
    saved = copy.deepcopy(reference.state_dict()), copy.deepcopy(torch_optimizer.state_dict())
    torch_steps(reference, torch_optimizer, data[RESUME_AT:])
    expected = {k: v for k, v in reference.state_dict().items() if v.numel()}

    model, optimizer = initialize(builder(case), config(state_dtype, "fp32"))
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    train(model, optimizer, data[RESUME_AT:], torch.float32)
    assert_matches(weights_of(model), expected, "fp32" if state_dtype == "fp32" else "int8",
                   "fp32", state_dtype)
    model.destroy()

    if state_dtype == "fp32":
        model, optimizer = initialize(builder(case), config("fp32", "fp32"))
        train(model, optimizer, data[:RESUME_AT], torch.float32)
        ours = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        model.destroy()
        plain = builder(case)()
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                            weight_decay=WEIGHT_DECAY)
        plain.load_state_dict(ours[0])
        plain_optimizer.load_state_dict(ours[1])
        torch_steps(plain, plain_optimizer, data[RESUME_AT:])
        assert_matches({k: v for k, v in plain.state_dict().items() if v.numel()}, expected,
                       "fp32", "fp32", "engine -> torch")


# ---- two ranks ----------------------------------------------------------------------------

# (state dtype, weights) of each 2-rank run of the tied vocabulary: two chunks per list (the
# tied weight's oversize one, the bias's), split between the ranks.
TWO_RANK = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int8", "bf16_no_master")]
WORKER = os.path.join(HERE, "lowp_boundaries_worker.py")


def run_id(run) -> str:
    return "-".join(run)


def run_config(run, world: int) -> dict:
    extra = {"parallel": {"collective_timeout": 30}} if world > 1 else {}
    return config(*run, default_chunk_size=CHUNK, **extra)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowp")
    results = launch(out, 2, *map(run_id, TWO_RANK), "tables-fp32", "tables-int8",
                     worker=WORKER)
    check_no_errors(results)
    return out, results


@pytest.mark.parametrize("run", TWO_RANK, ids=run_id)
def test_two_ranks_train_a_tied_odd_vocabulary_and_reshard_its_checkpoint(two_ranks, run):
    out, results = two_ranks
    state_dtype, weights = run
    per_rank = [r.get(run_id(run), {"error": "no result"}) for r in results]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        assert result["resumed_losses"] == result["losses"], rank
        assert_equal_states(result["resumed"], result["final"], f"rank {rank} resumed")
    first, second = per_rank
    assert_equal_states(first["final"], second["final"], "rank 0 vs 1")
    # Against the whole batch: fp32 weights to the one-rank tolerance (the gradient average's
    # order aside), bf16 weights within two of their ulps (as test_boundary_sizes' 2 ranks).
    # With bf16 moments that order may round a moment the other way (one bf16 ulp, 2^-8 of
    # it): a few of the 400k elements then move by up to that much of lr more or less each step.
    data = tied_batches(batch=4)
    ref_model, ref_held = reference_of(TiedLM(), data, tied_loss, state_dtype, weights)
    if weights == "fp32" and state_dtype == "bf16":
        for name, value in ref_held.items():
            torch.testing.assert_close(first["final"][name], value, rtol=0,
                                       atol=len(data) * LR * 2 ** -7,
                                       msg=lambda m: f"{name}: {m}")
    elif weights == "fp32":
        assert_matches({k: v for k, v in first["final"].items() if k != "head.weight"},
                       ref_held, state_dtype, weights, "2 ranks")
    else:
        for name, value in ref_model.state_dict().items():
            torch.testing.assert_close(first["final"][name].float(), value.float(),
                                       rtol=2 ** -7, atol=2e-2, msg=lambda m: f"{name}: {m}")
    # 2 -> 1: the 2-rank checkpoint loads on one rank exactly and trains on.
    model, optimizer = initialize(TiedLM, run_config(run, 1))
    model.load_checkpoint(os.path.join(out, f"two-{run_id(run)}"), "t", allow_reshard=True)
    assert_equal_states(cpu_state(model), first["at_save"], "2 -> 1")
    assert all(math.isfinite(loss) for loss in tied_train(model, optimizer, data[RESUME_AT:]))
    model.destroy()


# ---- checkpoints across state dtypes at boundary sizes -------------------------------------

def dequantized_moments(optimizer) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    result = {}
    for index, entry in optimizer.state_dict()["state"].items():
        if "exp_avg_scale" in entry:
            result[index] = tuple(
                dequantize_moment(key, entry[key], entry[f"{key}_scale"]).reshape(-1)
                for key in ("exp_avg", "exp_avg_sq"))
        else:
            result[index] = (entry["exp_avg"].float().reshape(-1),
                             entry["exp_avg_sq"].float().reshape(-1))
    return result


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("case", ["mixed", "unaligned"])
def test_checkpoints_of_boundary_sizes_load_across_state_dtypes(tmp_path, case, weights):
    # Each state dtype's checkpoint (0- and 1-element tensors, chunk and block edges; 4095 /
    # 4097 elements at unaligned offsets in one chunk) loads into each other's engine: fp32
    # moments hold the saved values exactly (8-bit ones dequantized in their own blocks), bf16
    # within a rounding (2^-8 of the value), 8-bit within half the widest code gap of the
    # block's scale (test_adam_lowp's bound), and training goes on.
    def cfg(state_dtype):
        return config(state_dtype, weights, default_chunk_size=CHUNKS.get(case, BOUNDARY_CHUNK))

    saved = {}
    for source in STATE_DTYPES:
        model, optimizer = initialize(builder(case), cfg(source))
        train(model, optimizer, batches(case)[:RESUME_AT], input_dtype(weights))
        model.save_checkpoint(str(tmp_path / source), tag="t")
        saved[source] = dequantized_moments(optimizer)
        model.destroy()
    for source, moments in saved.items():
        for target in STATE_DTYPES:
            model, optimizer = initialize(builder(case), cfg(target))
            model.load_checkpoint(str(tmp_path / source), "t", allow_reshard=True)
            loaded = dequantized_moments(optimizer)
            assert loaded.keys() == moments.keys(), (source, target)
            for index, pair in moments.items():
                for want, got in zip(pair, loaded[index]):
                    what = f"{source} -> {target}, state {index} ({want.numel()} elements)"
                    if target == "fp32" or target == source:
                        assert torch.equal(got, want), what
                    elif target == "bf16":
                        torch.testing.assert_close(got, want, rtol=2 ** -8, atol=0, msg=what)
                    else:
                        for start in range(0, want.numel(), BLOCK):
                            block = slice(start, start + BLOCK)
                            bound = 0.0079 * float(want[block].abs().max())
                            assert float((got[block] - want[block]).abs().max()) <= bound, what
            losses = train(model, optimizer, batches(case)[RESUME_AT:], input_dtype(weights))
            assert all(math.isfinite(loss) for loss in losses), (source, target)
            model.destroy()


# ---- budgets of data-parallel ranks with oversize tensors ----------------------------------

class TwoTables(nn.Module):
    """Two embeddings larger than the chunk (oversize groups, one held by each of 2 ranks, the
    other rank's chunk of each group padding) with a small head, over a few ids: the model data
    is almost all in the tables, the activations small."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(20000, 16)
        self.b = nn.Embedding(20000, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, ids):
        return self.head(self.a(ids) + self.b(ids)).pow(2).mean()


# What each rank of TwoTables holds on the host at once stays below 3.9 MB, while the padding
# chunks of its layout (chunks of the tables' size that never get memory) bring the compute
# list alone to 5.2 MB.
TABLES_HOST_BUDGET = 4_000_000


def tables_config(state_dtype: str, host_budget: int | None) -> dict:
    return {"default_chunk_size": 4096, "parallel": {"collective_timeout": 30},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "state_dtype": state_dtype}},
            **({"memory": {"host_budget": host_budget}} if host_budget else {})}


def tables_train(model, optimizer, rank: int) -> list[float]:
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randint(0, 20000, (2, 4), generator=generator))
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_padding_chunks_count_for_no_budget(two_ranks, state_dtype):
    # Note [Padding chunks are not memory] in guards.py: initialize() refused this budget
    # ("smaller than the fp32 parameter chunks initialization writes on the host: 5160960
    # bytes"), counting the tables' padding chunks; each rank trains within it, as without one.
    _, results = two_ranks
    for rank, result in enumerate(results):
        result = result[f"tables-{state_dtype}"]
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        compute = [c for c in result["layout"] if c["kind"] == "compute_param"]
        assert sum(c["bytes"] for c in compute) > TABLES_HOST_BUDGET
        budgeted, free = result[TABLES_HOST_BUDGET], result[None]
        assert budgeted["host_peak"] <= TABLES_HOST_BUDGET
        assert budgeted["losses"] == free["losses"], rank


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_data_parallel_profile_counts_no_padding_chunk(two_ranks, state_dtype):
    # Note [Model data of a data-parallel rank] in profiling/summary.py: the model data is
    # the whole model's, estimate_memory()'s total, and the ranks' owned bytes add up to it.
    # Each table's padding chunks counted: 5160960 bytes of compute chunks where the model has
    # 2580480, and so for each kind.
    out, _ = two_ranks
    estimate = patrickstar.estimate_memory(TwoTables, config=tables_config(state_dtype, None),
                                           verbose=False)["modes"]["fp32"]
    owned = []
    for rank in range(2):
        with open(os.path.join(out, f"profile-{state_dtype}", f"rank{rank}",
                               "summary.json")) as f:
            chunks = json.load(f)["chunks"]
        assert chunks["model_data_bytes"] == estimate["total"], rank
        assert sum(k["bytes"] for k in chunks["by_kind"].values()) == estimate["total"], rank
        owned.append(chunks["owned_bytes"])
    assert sum(owned) == estimate["total"]
