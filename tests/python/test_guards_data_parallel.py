"""A non-finite loss on one rank of two (issue 20, item 7): the ranks decide together, so no
rank misses a collective the others run (Note [Training call order] in guards.py)."""
from __future__ import annotations

import os

import torch

from test_data_parallel import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "nonfinite_worker.py")


def _results(tmp_path, policy):
    results = launch(tmp_path, 2, policy, worker=WORKER)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
    return results


def test_skip_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = _results(tmp_path, "skip")
    for result in results:
        assert result["skipped_steps"] == 1
        assert len(result["losses"]) == 4 and result["errors"] == []
    for name, tensor in results[0]["state"].items():  # the ranks stayed in step
        assert torch.equal(results[1]["state"][name], tensor), name
        assert torch.isfinite(tensor).all(), name


def test_raise_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    results = _results(tmp_path, "raise")
    assert "the loss is nan on rank(s) [1]" in results[1]["errors"][0]
    assert "the loss of rank(s) [1] is not finite" in results[0]["errors"][0]
    for result in results:
        assert len(result["errors"]) == 1 and len(result["losses"]) == 3
    for name, tensor in results[0]["state"].items():
        assert torch.equal(results[1]["state"][name], tensor), name
