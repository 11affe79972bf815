"""Module buffers under data parallelism (BatchNorm's running statistics), as torch's DDP keeps
them with its default broadcast_buffers=True: the first forward and each forward after a
training forward start from rank 0's buffers (Note [Buffers follow the first rank] in data_parallel.py)."""
from __future__ import annotations

import os

import pytest
import torch

from test_data_parallel import check_no_errors, launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "buffers_worker.py")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_batchnorm_statistics_follow_ddp_on_every_rank(tmp_path, accumulation):
    # With gradient accumulation DDP runs the micro-steps before the last under no_sync().
    results = launch(tmp_path, 2, str(accumulation), worker=WORKER)
    check_no_errors(results)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["losses"], result["ref_losses"], rtol=1e-5, atol=1e-6)
        for when in ("trained", "buffers"):  # after training; after the evaluation forward
            for key, tensor in result["ref_" + when].items():
                torch.testing.assert_close(
                    result[when][key], tensor, rtol=1e-5, atol=1e-6,
                    msg=lambda m, k=key, r=rank, w=when: f"rank {r} {k} ({w}): {m}")
        torch.testing.assert_close(result["eval"], result["ref_eval"], rtol=1e-5, atol=1e-6)
    # Under DDP rank 1 trains from rank 0's statistics plus its own last batch; its evaluation
    # forward then takes rank 0's.
    first, second = (r["ref_trained"]["norm.running_mean"] for r in results)
    assert not torch.equal(first, second)
    torch.testing.assert_close(results[1]["buffers"], results[0]["buffers"], rtol=0, atol=0)
