"""Checkpoints of data-parallel runs (issue 10): 2 gloo ranks write one shard each into one
atomic checkpoint (Note [Multi-rank checkpoints] in checkpoint/__init__.py). Exact resume on 2 ranks,
resharding 2 -> 1 and 1 -> 2, an error on one rank raised on every rank, SIGKILL while 2 ranks
save, and consolidation of a 2-rank checkpoint. The scenarios run in dp_checkpoint_worker.py;
one launch of 2 processes runs all of them (torch's import dominates)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from dp_checkpoint_worker import STEPS, _initialize, capture, mlp_config
from patrickstar.checkpoint import CheckpointError, CheckpointReader, read_meta
from patrickstar.consolidate import main as consolidate_main
from patrickstar.examples.gpt import GPT
from test_checkpoint import assert_identical, train
from test_data_parallel import HERE, check_no_errors, finish, free_port, launch
from test_initialize import MLP, gpt_config, mlp_batches

CHECKPOINT_WORKER = os.path.join(HERE, "dp_checkpoint_worker.py")
SCENARIOS = ["resume_fp32", "resume_bf16", "resume_fp16", "resume_bf16_lowp", "resume_fp32_nvme",
             "resume_bf16_nvme", "masters_from_weights",
             "reshard_2to1", "reshard_2to1_int8", "reshard_1to2", "consolidate_gpt", "errors"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-rank run that 1 -> 2 loads (here, before the launch), then one 2-rank launch of
    every scenario."""
    out = tmp_path_factory.mktemp("dp_checkpoint")
    data = list(mlp_batches(2 * STEPS))
    model, opt = _initialize(MLP, mlp_config())
    train(model, opt, data[:STEPS])
    model.save_checkpoint(out / "one_to_two", tag="t", client_state={"rank": 0})
    one = {"at_save": capture(model, opt), "losses": train(model, opt, data[STEPS:]),
           "final": model.state_dict()}
    model.destroy()
    results = launch(out, 2, "--checkpoint", *SCENARIOS)
    check_no_errors(results)
    return out, one, results


def _model_keys(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.startswith("model.")}


def _owned_keys(state: dict) -> dict:
    """The master / Adam tensors in a capture() (this rank's own)."""
    return {k: v for k, v in state.items() if k.split(".")[0] in (
        "param", "master", "compensation", "exp_avg", "exp_avg_sq", "exp_avg_scale",
        "exp_avg_sq_scale")}


def _assert_close_runs(losses, ref_losses, state, ref_state):
    """1e-6 relative: the same arithmetic but for the order of the gradient average."""
    assert len(losses) == len(ref_losses)
    for step, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(ours - ref) <= 1e-6 * abs(ref), (step, ours, ref)
    assert state.keys() == ref_state.keys()
    for key in state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_lowp", "fp32_nvme",
                                       "bf16_nvme"])
def test_two_ranks_resume_bit_for_bit(runs, precision):
    """fp32_nvme: tight budgets over each rank's NVMe tier (chunks move through it)."""
    out, _, results = runs
    name = f"resume_{precision}"
    for rank, result in enumerate(r[name] for r in results):
        assert (result["nvme_bytes"] > 0) == precision.endswith("nvme"), result["nvme_bytes"]
        assert result["losses"] == result["resumed"], rank  # bit for bit, on every rank
        assert_identical(result["expected"], result["actual"])
        assert result["client_state"] == {"rank": rank}  # each rank's own extra file
        assert result["path"] == str(out / name / "t" / "meta.json")
        assert result["listing"] == ["latest", "t"]  # no partial directory left
        assert result["files"] == ["meta.json", "rank_00000.shard", "rank_00000_extra.pt",
                                   "rank_00001.shard", "rank_00001_extra.pt"]
    # What makes per-rank state matter: the ranks' RNG streams and BatchNorm statistics differ.
    first, second = (r[name] for r in results)
    assert not torch.equal(first["expected"]["rng"], second["expected"]["rng"])
    assert any(not torch.equal(first["buffers"][k], second["buffers"][k])
               for k in first["buffers"] if k.endswith("running_mean"))
    # Each rank wrote the tensors of its own chunks: a real, disjoint split covering the model.
    meta = read_meta(str(out / name / "t"))
    assert meta["world_size"] == 2 and meta["layout"]["world_size"] == 2
    assert set(meta["engine"]["step_counts"].values()) == {STEPS}  # merged from both ranks
    with CheckpointReader(str(out / name)) as reader:
        tensors = [{k for k in reader.by_rank[r] if k[1] != "buffer"} for r in (0, 1)]
        assert tensors[0] and tensors[1] and not tensors[0] & tensors[1]
        kinds = {"param", "exp_avg", "exp_avg_sq"} | (
            {"master"} if precision in ("bf16", "fp16", "bf16_nvme") else set()) | (
            {"compensation", "exp_avg_scale", "exp_avg_sq_scale"}
            if precision == "bf16_lowp" else set())
        assert tensors[0] | tensors[1] == {(t["name"], kind) for t in meta["tensors"]
                                           for kind in kinds}
        assert all((k, "buffer") in reader.by_rank[r] for r in (0, 1) for k in first["buffers"])


def test_two_rank_checkpoint_reshards_to_one_rank(runs):
    out, _, results = runs
    ranks = [r["reshard_2to1"] for r in results]
    model, opt = _initialize(MLP, mlp_config(), seed=7)
    before = capture(model, opt)
    with pytest.raises(CheckpointError, match=r"other layout: written by 2 rank\(s\), loading "
                                              r"on 1 \(pass allow_reshard=True\)"):
        model.load_checkpoint(out / "two_to_one", "t")
    assert_identical(before, capture(model, opt))
    model.load_checkpoint(out / "two_to_one", "t", allow_reshard=True)
    loaded = capture(model, opt)
    # Exact: the parameters the ranks had, and each rank's own master / Adam tensors.
    assert_identical(_model_keys(loaded), _model_keys(ranks[0]["at_save"]))
    owned = {**_owned_keys(ranks[0]["at_save"]), **_owned_keys(ranks[1]["at_save"])}
    assert_identical(_owned_keys(loaded), owned)
    assert torch.equal(loaded["step_counts"], torch.maximum(ranks[0]["at_save"]["step_counts"],
                                                            ranks[1]["at_save"]["step_counts"]))
    # Training on whole batches continues the 2-rank run on half batches.
    losses = train(model, opt, list(mlp_batches(2 * STEPS))[STEPS:])
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    _assert_close_runs(losses, mean, model.state_dict(), ranks[0]["final"])


def test_a_two_rank_checkpoint_of_8bit_state_reshards_to_one_rank(runs):
    # 8-bit moments and their scale chunks, written by their owners, load by tensor name into
    # one rank exactly, and training goes on as the 2-rank run did.
    out, _, results = runs
    ranks = [r["reshard_2to1_int8"] for r in results]
    model, opt = _initialize(MLP, mlp_config("int8"), seed=7)
    model.load_checkpoint(out / "two_to_one_int8", "t", allow_reshard=True)
    loaded = capture(model, opt)
    assert_identical(_model_keys(loaded), _model_keys(ranks[0]["at_save"]))
    owned = {**_owned_keys(ranks[0]["at_save"]), **_owned_keys(ranks[1]["at_save"])}
    assert any(k.startswith("exp_avg_scale.") for k in owned)
    assert_identical(_owned_keys(loaded), owned)
    losses = train(model, opt, list(mlp_batches(2 * STEPS))[STEPS:])
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    for step, (ours, ref) in enumerate(zip(losses, mean)):
        # A gradient averaged in another order may flip an 8-bit code: close, not 1e-6.
        assert abs(ours - ref) <= 1e-3 * abs(ref), (step, ours, ref)
    model.destroy()


def test_one_rank_checkpoint_reshards_to_two_ranks(runs):
    _, one, results = runs
    for rank, result in enumerate(r["reshard_1to2"] for r in results):
        assert "other layout: written by 1 rank(s), loading on 2" in result["refused"], rank
        assert result["unchanged"], rank  # the refused load changed nothing
        assert result["client_state"] == {"rank": 0}  # rank 1 has no counterpart: rank 0's
        assert_identical(_model_keys(result["at_load"]), _model_keys(one["at_save"]))
        owned = _owned_keys(result["at_load"])
        assert owned and owned.keys() < _owned_keys(one["at_save"]).keys()
        assert_identical(owned, {k: one["at_save"][k] for k in owned})
    first, second = (r["reshard_1to2"] for r in results)
    mean = [(a + b) / 2 for a, b in zip(first["losses"], second["losses"])]
    _assert_close_runs(mean, one["losses"], first["final"], one["final"])
    assert_identical(first["final"], second["final"])


def test_an_error_on_one_rank_is_raised_on_every_rank_and_keeps_the_last_checkpoint(runs):
    _, _, results = runs
    for rank, result in enumerate(r["errors"] for r in results):
        # A full disk on rank 1: both ranks raise, naming rank 1 and its error.
        assert "failed on 1 of 2 ranks: rank 1: OSError: [Errno 28] No space left on device" \
            in result["save_error"], rank
        assert "rank_00001.shard" in result["save_error"]
        assert result["listing"] == ["good", "latest"] and result["latest"] == "good"
        assert result["reloaded_good"], rank  # the previous checkpoint loads exactly
        # A corrupted shard read only by rank 1: rank 0 refuses too, and nothing changes.
        assert "failed on 1 of 2 ranks: rank 1: CheckpointError" in result["load_error"], rank
        assert "rank_00001.shard' is corrupted" in result["load_error"], rank
        assert result["load_changed_nothing"], rank


def test_consolidated_two_rank_checkpoint_reproduces_our_forward(runs, tmp_path):
    out, _, results = runs
    gpt = results[0]["consolidate_gpt"]
    assert consolidate_main([str(out / "gpt"), str(tmp_path / "gpt.pt")]) == 0
    state = torch.load(tmp_path / "gpt.pt", weights_only=True)
    plain = GPT(gpt_config())
    plain.load_state_dict(state)  # strict
    assert state["head.weight"].data_ptr() == state["tokens.weight"].data_ptr()  # still tied
    assert_identical(state, gpt["state"])
    # DeepSpeed's save_16bit_model on 2 ranks: the whole model's state dict, as consolidated.
    assert_identical(torch.load(out / "gpt16" / "pytorch_model.bin", weights_only=True), state)
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(gpt["probe"]), gpt["logits"], rtol=0, atol=1e-6)
    # Buffers differ between ranks; the consolidated file has rank 0's (DDP's choice).
    assert consolidate_main([str(out / "resume_fp32"), str(tmp_path / "mlp.pt")]) == 0
    assert_identical(torch.load(tmp_path / "mlp.pt", weights_only=True),
                     results[0]["resume_fp32"]["at_save"])


# ---- SIGKILL while 2 ranks save ---------------------------------------------------------------

def _spawn(save_dir, *args, world=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep
               + os.environ.get("PYTHONPATH", ""), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.pop("PATRICKSTAR_CHECKPOINT_CRASH_AT", None)
    return [subprocess.Popen([sys.executable, CHECKPOINT_WORKER, str(save_dir), *args],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                             stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
            for r in range(world)]


def _load_latest(save_dir):
    """The latest checkpoint on one rank (resharding the 2-rank checkpoint)."""
    model, _ = _initialize(MLP, mlp_config(), seed=4)
    path, client = model.load_checkpoint(save_dir, allow_reshard=True)
    assert client["tag"] == os.path.basename(os.path.dirname(path))
    state = model.state_dict()
    model.save_checkpoint(save_dir, tag="check")  # removes the dead writers' partials
    assert not [n for n in os.listdir(save_dir) if ".partial-" in n]
    return client, state


def test_sigkill_at_random_moments_of_two_rank_saves_never_breaks_latest(tmp_path):
    rng = random.Random(2024)
    attempts = []
    for attempt in range(3):
        save_dir = tmp_path / f"run{attempt}" / "ckpt"
        attempts.append((save_dir, _spawn(save_dir, "loop")))
    for save_dir, procs in attempts:
        assert procs[0].stdout.readline().strip() == "ready"  # "step-0" is complete
    for save_dir, procs in attempts:
        time.sleep(rng.uniform(0.0, 0.5))
        victims = rng.choice([[0], [1], [0, 1]])
        for victim in victims:
            procs[victim].send_signal(signal.SIGKILL)
        # A survivor sees its peer's connection close at its next gather and raises.
        codes = finish(procs)
        assert [codes[v] for v in victims] == [-signal.SIGKILL] * len(victims)
        for survivor in set(range(2)) - set(victims):
            assert codes[survivor] == 0
            result = torch.load(save_dir.parent / f"rank{survivor}.pt", weights_only=False)
            assert result.get("error_type") == "CheckpointError", result
        client, state = _load_latest(save_dir)
        expected = torch.full((64, 32), float(client["step"]))
        assert torch.equal(state["layers.0.weight"], expected), client


# (rank killed, where) -> the tag `latest` names afterwards. Rank 0's stages between meta.json
# and `latest` are the single-rank protocol's (test_checkpoint.py kills the writer at each).
CRASH_POINTS = {(1, "shard_half_written"): "first", (0, "before_meta"): "first",
                (0, "after_latest"): "second"}


def test_sigkill_of_one_rank_at_every_stage_of_a_two_rank_save(tmp_path):
    runs = {}
    for (victim, point) in CRASH_POINTS:
        save_dir = tmp_path / f"{point}-{victim}" / "ckpt"
        runs[(victim, point)] = (save_dir, _spawn(save_dir, "two", str(victim), point))
    for (victim, point), (save_dir, procs) in runs.items():
        codes = finish(procs)
        assert codes[victim] == -signal.SIGKILL, point
        survivor = 1 - victim
        result = torch.load(save_dir.parent / f"rank{survivor}.pt", weights_only=False)
        # Not a hang: the survivor's gather fails and it raises, naming the collective.
        assert result.get("error_type") == "CheckpointError", (point, result)
        assert "could not exchange its outcome with the other ranks" in result["error"]
        client, _ = _load_latest(save_dir)
        assert client["tag"] == CRASH_POINTS[(victim, point)], point


def test_two_ranks_load_without_optimizer_states_rebuild_masters_from_the_weights(runs):
    # Note [Masters rebuilt from the weights]: each rank's masters are its weights' values,
    # read from its own shard (the owner of a master owns its weight too).
    _, _, results = runs
    owned = set()
    for rank, result in enumerate(results):
        run = result["masters_from_weights"]
        assert run["global_steps"] == 3 and run["optimizer_state"] == 0
        for key, value in run["saved"].items():
            assert torch.equal(run["loaded"][key], value), (rank, key)
        for name, master in run["masters"].items():
            assert torch.equal(master, run["saved"][name].float()), (rank, name)
        owned |= set(run["masters"])
    assert owned == {k for k in results[0]["masters_from_weights"]["saved"] if "norm" not in k}
