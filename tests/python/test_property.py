"""Property test (issue 20): random small models (property_models.py) trained with PatrickStar
and with plain PyTorch give the same losses and parameters: tensor sizes just below, at, above
and at multiples of the chunk size; tied, frozen, unused and twice-called parameters; an integer
buffer; 1, 2 and 4 gloo ranks; no budget and the tightest device budget initialize() accepts;
gradient accumulation over 2 micro-steps for odd seeds; fp32; fixed seeds. About 30 cases; PS_PROPERTY_LONG=N runs N seeds per (world, budget).

Multi-rank cases of one world size share one launch of property_worker.py (processes start
once: torch's import dominates)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import property_models as pm
from test_data_parallel import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "property_worker.py")
CASES = pm.cases()

PARAMS = [pytest.param(case, id=case.id) for case in CASES]


@pytest.fixture(scope="module")
def multi_rank(tmp_path_factory):
    """Every multi-rank case's per-rank results: one launch per world size (processes start
    once: torch's import dominates)."""
    launches = [(world, [case.id for case in CASES if case.world == world])
                for world in sorted({case.world for case in CASES if case.world > 1})]
    results = {}
    for world, ids in launches:
        if not ids:
            continue
        ranks = launch(tmp_path_factory.mktemp(f"property{world}"), world, *ids, worker=WORKER)
        for case_id in ids:
            results[case_id] = [rank.get(case_id, {"error": "the rank wrote no result"})
                                for rank in ranks]
    return results


def _check(case: pm.Case, per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result['error'])}"
    ref_losses, ref_state = pm.reference(case)
    losses = [sum(r["losses"][i] for r in per_rank) / case.world
              for i in range(len(ref_losses))]
    assert len(ref_losses) == pm.STEPS * case.accumulation
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"step {step}: {a} vs {b}"
    for rank, result in enumerate(per_rank):
        state = result["state"]
        assert set(state) == set(ref_state), rank
        for name, tensor in ref_state.items():
            assert state[name].dtype == tensor.dtype, name  # the integer buffer stays integer
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    if case.budget == "tight":
        device = per_rank[0]["device"]
        assert device["peak_chunk_bytes"] <= device["budget_bytes"]


@pytest.mark.parametrize("case", PARAMS)
def test_random_model_trains_like_pytorch(case, multi_rank):
    if case.world == 1:
        _check(case, [pm.train(case)])
    else:
        _check(case, multi_rank[case.id])
