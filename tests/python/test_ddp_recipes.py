"""PyTorch's DDP recipes with the engine in DDP's place, on two ranks over gloo, each against
torch's DistributedDataParallel run beside it on the same rank's data (ddp_recipes_worker.py):
the DDP tutorial's loop (DistributedSampler, uneven batches, the script's all_reduce and
barriers, a checkpoint saved on rank 0 and loaded everywhere), a branch unused on one rank
(find_unused_parameters), a BatchNorm CNN evaluated on rank 0 alone, join(), communication hooks
reentrant checkpoints and a rank whose data loader fails."""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

import patrickstar
from test_data_parallel import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_recipes_worker.py")
SCENARIOS = ["tutorial", "resume", "skip_bad_batch", "unused", "batchnorm", "raw_module",
             "sync_batchnorm", "sync_batchnorm_lonely", "join", "comm_hook", "reentrant",
             "lonely_writes", "reads_then_every_rank_reads"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank run of every scenario (processes start once: torch's import dominates)."""
    return launch(tmp_path_factory.mktemp("ddp_recipes"), 2, *SCENARIOS, worker=WORKER)


def scenario(two_ranks, name: str) -> list[dict]:
    results = [r[name] for r in two_ranks]
    return results


def no_errors(results) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"


def assert_close(ours, ref, what: str) -> None:
    if isinstance(ref, dict):
        assert set(ours) == set(ref), what
        for key, tensor in ref.items():
            torch.testing.assert_close(ours[key], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"{what} {k}: {m}")
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def assert_like_ddp(results, *keys: str) -> None:
    for rank, result in enumerate(results):
        for key in keys:
            assert_close(result[key], result["ref_" + key], f"rank {rank} {key}")


@pytest.mark.parametrize("name", ["tutorial", "resume", "unused"])
def test_ddp_loops_train_as_ddp(two_ranks, name):
    # tutorial: DistributedSampler.set_epoch, drop_last=False, a batch one sample short on
    # rank 1 only, the loss all_reduced and dist.barrier() between forward and backward or
    # backward and step, a checkpoint saved on rank 0 and loaded by every rank with the
    # tutorial's map_location. resume: PyTorch's ImageNet example's checkpoint (model,
    # optimizer and StepLR saved by rank 0) resumed by fresh engines on every rank. unused: a
    # branch taken on one rank only (and once on none).
    results = scenario(two_ranks, name)
    no_errors(results)
    assert_like_ddp(results, "losses", "state")
    if name == "tutorial":
        assert_like_ddp(results, "metrics")


def test_batchnorm_statistics_after_an_evaluation_on_rank_0_follow_ddp(two_ranks):
    # Rank 0 alone evaluates in train mode under no_grad (updating its statistics, as DDP's
    # `ddp.module(x)` there) and in eval mode; DDP's next training forward then gives rank 1
    # rank 0's statistics with that update. The engine's served evaluation had broadcast rank
    # 0's buffers before it and cleared the next forward's broadcast: rank 1 trained its next
    # step from its own statistics ("trained1" differed, num_batches_tracked by one).
    results = scenario(two_ranks, "batchnorm")
    no_errors(results)
    assert_like_ddp(results, "losses", "trained", "after_eval", "trained1", "trained2",
                    "final", "final_eval")
    assert_close(results[0]["train_mode_eval"], results[0]["ref_train_mode_eval"],
                 "train-mode evaluation")
    assert_close(results[0]["eval_mode_eval"], results[0]["ref_eval_mode_eval"],
                 "eval-mode evaluation")


def test_join_trains_even_inputs_and_raises_on_every_rank_for_uneven_ones(two_ranks):
    # DDP's model.join() was an AttributeError. Even inputs train as DDP; one batch more on
    # rank 1 raises at once on both ranks (DDP's join(throw_on_early_termination=True)).
    results = scenario(two_ranks, "join")
    for rank, result in enumerate(results):
        assert result["losses"][:3] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-6)
        assert len(result["losses"]) == 6  # rank 1's extra forward raised
        assert result["error_type"] == "RuntimeError", result.get("traceback")
        assert "the end of `with model.join():`" in result["error"]
        assert "as many batches" in result["error"]


def test_comm_hooks_accept_ddps_default_and_refuse_others_by_name(two_ranks):
    # register_comm_hook and _set_static_graph were AttributeErrors.
    for result in scenario(two_ranks, "comm_hook"):
        assert result["allreduce_hook"] == "ok"
        assert result["static_graph"] == "ok"
        assert result["fp16_compress_hook"].startswith("NotImplementedError: register_comm_hook"
                                                       "(state, fp16_compress_hook)")
        assert '"fp16" or "bf16"' in result["fp16_compress_hook"]


def test_script_collectives_mid_step_and_the_raw_module_on_rank_0_follow_ddp(two_ranks):
    results = scenario(two_ranks, "raw_module")
    no_errors(results)
    assert_like_ddp(results, "losses", "b0", "b1")
    assert_like_ddp(results[:1], "raw_train", "raw_eval")


def test_sync_batchnorm_on_the_cpu_raises_at_once_as_under_ddp(two_ranks):
    # convert_sync_batchnorm before initialize: torch's SyncBatchNorm has no CPU kernels, and
    # says so in the first training forward (DDP refuses it at construction); no rank hangs.
    for result in scenario(two_ranks, "sync_batchnorm"):
        assert result["ref"].startswith("ValueError: SyncBatchNorm"), result
        assert result["ours"].startswith("ValueError: SyncBatchNorm"), result


def test_sync_batchnorm_forward_on_one_rank_in_train_mode_raises_on_every_rank(two_ranks):
    # Served, the lone rank's SyncBatchNorm all-gathers (on a GPU) met the other rank's next
    # training forward's: statistics of two batches mixed, then a wait for the timeout. Now
    # such a forward is never served and both ranks raise at once (Note [SyncBatchNorm in a
    # forward on one rank]); in eval mode it is served as before.
    results = scenario(two_ranks, "sync_batchnorm_lonely")
    assert results[0]["eval"].shape == (2, 4)
    for result in results:
        for call in ("model", "model.module"):  # rank 0's call (rank 1 trains)
            assert result[call].startswith("RuntimeError"), result[call]
            assert "SyncBatchNorm layers in train mode" in result[call]


def test_a_load_save_or_apply_on_one_rank_raises_on_every_rank_at_once(two_ranks):
    # Note [Writes on one rank are refused] in data_parallel.py: rank 0 loading alone kept
    # rank 1's shards silently (training went on from a mix), and a save or an apply alone
    # waited for the collective timeout.
    results = scenario(two_ranks, "lonely_writes")
    for call, says in [("model.load_state_dict", "model.load_state_dict() (or model.module"),
                       ("model.module.load_state_dict", "model.load_state_dict() (or model.module"),
                       ("submodule.load_state_dict", "model.load_state_dict() (or model.module"),
                       ("vector_to_parameters", "model.load_state_dict() (or model.module"),
                       ("optimizer.load_state_dict", "optimizer.load_state_dict() (each rank"),
                       ("save_checkpoint", "model.save_checkpoint() (each rank writes"),
                       ("apply", "model.apply(fn) or summon_full_params()")]:
        for rank, result in enumerate(results):
            error = result[call]
            assert error.startswith("RuntimeError") and \
                "the ranks are not making the same call" in error, (rank, call, error)
            assert re.search(rf"rank 0: call \d+, {re.escape(says)}", error), (rank, error)
            assert re.search(r"rank 1: call \d+, a training forward", error), (rank, error)
            assert result[call + " seconds"] < 5, (rank, call)  # not the collective timeout


def test_a_read_on_one_rank_before_a_read_on_every_rank_is_served(two_ranks):
    # Note [Reads on one rank are served] in data_parallel.py: rank 0 evaluates or reads p.norm()
    # alone, then every rank reads the state dicts: two different reads met, rank 0's was
    # served first. Before, both ranks raised "not making the same call".
    results = scenario(two_ranks, "reads_then_every_rank_reads")
    no_errors(results)
    for name, value in results[0].items():
        if name.endswith(" alone"):
            assert math.isfinite(value), name
            assert name not in results[1]
        elif name != "after":
            assert not isinstance(value, str), (name, value)
            assert_close(results[1][name], value, name)
    assert_close(results[1]["after"], results[0]["after"], "after")


def test_reentrant_checkpoint_reusing_a_parameter_raises_naming_use_reentrant(two_ranks):
    # use_reentrant=False trains as DDP(static_graph=True). With use_reentrant=True a parameter
    # used inside and outside the checkpoint gets two gradients in one backward: without
    # resharding the second failed inside the chunk store ("... cannot move"), and the
    # resharding error's remedy (reshard_after_forward false) led there (Note [A second
    # gradient in one backward] in backward_pass.py).
    results = scenario(two_ranks, "reentrant")
    no_errors(results)
    assert_like_ddp(results, "losses")
    for result in results:
        for reshard in (True, False):
            error = result[f"reshard={reshard}"]
            assert "use_reentrant=False" in error, error
        assert "'a.bias' got a second gradient" in result["reshard=False"]


def test_a_rank_skipping_a_batch_whose_forward_raised_fails_both_at_once(two_ranks):
    # Rank 1's forward raises halfway through the chunk groups and its script skips the batch
    # (`except ValueError: continue`); rank 0 ends its forward. Both raise at their next call,
    # naming what each runs (not a timeout: Note [A forward's end agrees]).
    results = scenario(two_ranks, "skip_bad_batch")
    assert results[0]["groups"] > 1
    assert results[1]["skipped"] == 2
    for result in results:
        assert "the ranks are not making the same call" in result["error"], result
        assert re.search(r"rank 0: call \d+, the end of a training forward", result["error"])
        assert re.search(r"rank 1: call \d+, a training forward", result["error"])


@pytest.mark.parametrize("where", ["loader", "backward"])
def test_a_rank_failing_mid_epoch_fails_the_other_at_once(tmp_path, where):
    # Rank 1's data loader (or a backward hook, mid-backward) raises uncaught mid-epoch and its
    # script ends; rank 0's next collective (its forward's call agreement, or inside its
    # backward) raises naming rank 1, well within the 5 s parallel.collective_timeout (torch's
    # DDP would wait in its all-reduce for gloo's 30 min).
    results = launch(tmp_path, 2, "failing_" + where, worker=WORKER)
    first = results[0]
    assert "rank 1" in first.get("error", ""), first
    assert first["elapsed"] < 5  # within parallel.collective_timeout (it takes milliseconds)


def test_a_ddp_checkpoint_fails_to_load_naming_its_module_prefix():
    # The DDP tutorial saves ddp_model.state_dict(), whose keys carry 'module.'; the engine's
    # are its module's own, as torch's (and DeepSpeed's, FSDP's) load refuses them. The error
    # said to pass strict=False, which would load none of them.
    from ddp_recipes_worker import ToyModel, adam
    torch.manual_seed(0)
    saved = {"module." + k: v for k, v in ToyModel().state_dict().items()}
    model, _ = patrickstar.initialize(ToyModel, config=adam())
    with pytest.raises(RuntimeError, match="Unexpected key") as raised:
        model.load_state_dict(saved)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "consume_prefix_in_state_dict_if_present" in notes and "strict=False" not in notes
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(saved, "module.")
    model.load_state_dict(saved)
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, saved[key])
