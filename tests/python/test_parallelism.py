"""Pipeline stages and Megatron tensor slicing above the chunk runtime (issue 11): a 4-layer GPT
split into 2 pipeline stages (1F1B, GPipe), sliced over 2 tensor ranks, and both combined with
2 data-parallel ranks under tight device budgets, trains like plain PyTorch in one process.
Multi-process runs launch parallel_worker.py once per rank count and run several scenarios per
launch (torch's import dominates); the rest runs in this process."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patrickstar
from patrickstar import tensor_parallel
from patrickstar.checkpoint import CheckpointError
from patrickstar.checkpoint.meta import read_meta, write_meta
from patrickstar.consolidate import consolidate
from patrickstar.examples.gpt import synthetic_batches
from patrickstar.examples.gpt_parallel import ParallelGPT, gpt_loss, gpt_pipeline
from patrickstar.pipe import PipelineModule, partition_balanced
from patrickstar.pipe.p2p import check_gradients
from patrickstar.pipe.schedule import SCHEDULES
from patrickstar.topology import PipeDataTensorTopology
from parallel_scenarios import TIGHT, gpt_config, reference
from test_data_parallel import launch
from test_initialize import MLP, assert_same_training, make_optimizer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")
PARAM_ATOL = 5e-5  # Adam near zero amplifies sqrt rounding (test_initialize.py's GPT test)


# ---- In-process: topology, config, partitioning, schedules, layers ---------------------------

def test_topology_maps_ranks_like_deepspeed():
    topo = PipeDataTensorTopology(num_pp=2, num_dp=2, num_tp=2)
    assert topo.world_size == 8
    for rank in range(8):
        coord = topo.get_coord(rank)
        assert rank == (coord.pipe * 2 + coord.data) * 2 + coord.tensor
        assert topo.get_rank(**coord._asdict()) == rank
    assert topo.get_axis_comm_lists("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=1, tensor=0) == [4, 6]
    with pytest.raises(ValueError, match="unknown topology axis 'model'"):
        topo.get_axis_comm_lists("model")
    with pytest.raises(ValueError, match="coordinate data=2"):
        topo.get_rank(pipe=0, data=2, tensor=0)


def test_parallel_sizes_must_multiply_to_the_world_and_name_the_keys():
    # No torch.distributed here: a world of one.
    with pytest.raises(ValueError, match=r"'parallel.pipeline' \(2\) x 'parallel.tensor' \(1\)"):
        patrickstar.initialize(MLP, config={"parallel": {"pipeline": 2}})
    with pytest.raises(ValueError, match=r"'parallel.data' \(1\) x 'parallel.pipeline' \(1\) x "
                                         r"'parallel.tensor' \(2\) = 2 ranks, but torch."
                                         r"distributed has a world of 1"):
        patrickstar.initialize(MLP, config={"parallel": {"data": 1, "tensor": 2}})
    with pytest.raises(ValueError, match="'parallel.schedule'"):
        patrickstar.initialize(MLP, config={"parallel": {"schedule": "interleaved"}})
    with pytest.raises(ValueError, match=r"num_stages=3\) but config key 'parallel.pipeline'"):
        patrickstar.initialize(gpt_pipeline(gpt_config(), num_stages=3))


def test_partition_methods():
    cfg = gpt_config()  # embed, positions, 4 blocks, final norm, tied head: 8 layers
    assert gpt_pipeline(cfg).partition(2) == [0, 4, 8]  # parameters: 30016 vs 25472
    assert gpt_pipeline(cfg, partition_method="uniform").partition(3) == [0, 3, 6, 8]
    assert gpt_pipeline(cfg, partition_method="type:Block").partition(2) == [0, 4, 8]
    assert gpt_pipeline(cfg, partition_method="type:Block").partition(4) == [0, 3, 4, 5, 8]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    with pytest.raises(ValueError, match="matches none of the layers"):
        gpt_pipeline(cfg, partition_method="type:Conv").partition(2)
    with pytest.raises(ValueError, match="unknown partition_method 'random'"):
        gpt_pipeline(cfg, partition_method="random").partition(2)
    with pytest.raises(ValueError, match="9 pipeline stages for 8 layers"):
        gpt_pipeline(cfg).partition(9)
    with pytest.raises(TypeError, match="pass LayerSpec\\(Linear"):
        PipelineModule([nn.Linear(2, 2)])


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedules_run_every_micro_batch_once_and_never_deadlock(schedule):
    for stages in range(1, 5):
        for micro in range(1, 7):
            plans = [SCHEDULES[schedule](micro, stages, s) for s in range(stages)]
            for s, plan in enumerate(plans):
                assert sorted(plan) == sorted([("F", i) for i in range(micro)]
                                              + [("B", i) for i in range(micro)])
                in_flight = peak = 0
                for op, _ in plan:
                    in_flight += 1 if op == "F" else -1
                    peak = max(peak, in_flight)
                if schedule == "1f1b":  # activation memory bounded by the depth, not by M
                    assert peak <= min(stages - s, micro), (stages, micro, s, plan)
            # Blocking receives: F(i) on s needs F(i) on s-1, B(i) on s needs B(i) on s+1.
            done = [set() for _ in range(stages)]
            cursor = [0] * stages
            progress = True
            while progress:
                progress = False
                for s in range(stages):
                    if cursor[s] == len(plans[s]):
                        continue
                    op, i = plans[s][cursor[s]]
                    ready = (s == 0 or (op, i) in done[s - 1]) if op == "F" else \
                        (s == stages - 1 or (op, i) in done[s + 1])
                    if ready:
                        done[s].add((op, i))
                        cursor[s] += 1
                        progress = True
            assert cursor == [len(p) for p in plans], (schedule, stages, micro, cursor)


def test_tensor_parallel_layers_of_size_one_are_the_plain_layers():
    torch.manual_seed(0)
    column = tensor_parallel.ColumnParallelLinear(8, 6)
    row = tensor_parallel.RowParallelLinear(6, 4)
    embedding = tensor_parallel.VocabParallelEmbedding(10, 4)
    torch.manual_seed(0)
    plain = [nn.Linear(8, 6), nn.Linear(6, 4), nn.Embedding(10, 4)]
    for ours, theirs in zip((column, row, embedding), plain):
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    x = torch.randn(3, 8)
    torch.testing.assert_close(row(column(x)), plain[1](plain[0](x)))
    logits, target = torch.randn(2, 5, 10), torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(tensor_parallel.vocab_parallel_cross_entropy(logits, target),
                               F.cross_entropy(logits.view(-1, 10), target.view(-1),
                                               reduction="none").view(2, 5))


def test_strided_slices_join_back_to_the_full_tensor():
    full = torch.arange(24.0).view(12, 2)  # [q; k; v], 4 rows each
    parts = [tensor_parallel.split_tensor(full, 0, 2, r, stride=3) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]  # first half of q, of k, of v
    torch.testing.assert_close(tensor_parallel.join_slices(parts, 0, 3), full)
    with pytest.raises(ValueError, match="out_features = 6 is not divisible by the "
                                         "tensor-parallel size 4"):
        tensor_parallel._divide(6, 4, "out_features")


def test_received_gradients_must_match_the_sent_activations():
    sent = [torch.zeros(2, 16, 32)]
    check_gradients(0, "stage 1 (rank 1)", 3, sent, [torch.zeros(2, 16, 32)])
    with pytest.raises(ValueError, match=r"from stage 1 \(rank 1\) for micro batch 3 are "
                                         r"\[\(2, 16, 48\) float32\], but the activations this "
                                         r"stage sent are \[\(2, 16, 32\) float32\]"):
        check_gradients(0, "stage 1 (rank 1)", 3, sent, [torch.zeros(2, 16, 48)])


@pytest.fixture
def one_thread():
    """This tiny model trains faster on one thread when other processes share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_stage_pipeline_with_tied_head_and_checkpointing_matches_pytorch(one_thread,
                                                                           tmp_path):
    """PipelineModule on a single stage: the tied embedding is one module used twice,
    activations of every layer are recomputed in backward; train_batch and eval_batch."""
    cfg = gpt_config()
    accumulation, steps = 2, 4
    config = {"default_chunk_size": 8192, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    pipe = gpt_pipeline(cfg, seed_layers=True, activation_checkpoint_interval=1)
    engine, _ = patrickstar.initialize(pipe, config=config)
    model = gpt_pipeline(cfg, seed_layers=True).sequential()
    optimizer = make_optimizer("AdamW", model.parameters(), 1e-3, 0.1)
    batches = list(synthetic_batches(cfg, batch=2, steps=steps * accumulation))
    ref_losses, losses = [], []
    for step in range(steps):
        micro = batches[step * accumulation:(step + 1) * accumulation]
        total = 0.0
        for ids, targets in micro:
            loss = gpt_loss(model(ids), targets)
            (loss / accumulation).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(total / accumulation)
        losses.append(engine.train_batch(iter(micro)).item())
    with torch.no_grad():
        ref_eval = sum(gpt_loss(model(i), t).item() for i, t in batches[:2]) / 2
    assert math.isclose(engine.eval_batch(iter(batches[:2])).item(), ref_eval, rel_tol=1e-5)
    # DeepSpeed's eval_batch(return_logits=True) and stage queries (they raised TypeError /
    # AttributeError).
    loss, logits = engine.eval_batch(iter(batches[:2]), return_logits=True)
    assert math.isclose(loss.item(), ref_eval, rel_tol=1e-5)
    with torch.no_grad():
        ref_logits = torch.cat([model(i) for i, _ in batches[:2]])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert engine.is_first_stage() and engine.is_last_stage()
    assert_same_training(ref_losses, losses, model.state_dict(), engine.state_dict(),
                         atol=PARAM_ATOL)
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(batches[0][0])
    with pytest.raises(TypeError, match="data_iter must be an iterator"):
        engine.train_batch(batches)
    # A stage checkpoint restores the stage's parameters (and optimizer state) exactly.
    engine.save_checkpoint(tmp_path)
    saved = engine.state_dict()
    engine.train_batch(iter(batches[:accumulation]))
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == steps
    for key, tensor in engine.state_dict().items():
        torch.testing.assert_close(tensor, saved[key], rtol=0, atol=0)
    # DeepSpeed's save_16bit_model: one stage is the whole model (AttributeError before).
    assert engine.save_16bit_model(tmp_path / "hf") is True
    written = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[key], saved[key]) for key in saved)


# ---- Multi-process -------------------------------------------------------------------------

def check_no_errors(results):
    failed = {rank: result["traceback"] for rank, result in enumerate(results) if "error" in result}
    # Every failing rank's traceback: the first to fail explains the others' broken links.
    assert not failed, "\n".join(f"rank {rank}: {trace}" for rank, trace in failed.items())


def check_matches_reference(results, name: str):
    ref_losses, ref_state, ref_eval, ref_norms = reference(name)
    merged = {}
    for rank, result in enumerate(results):
        r = result[name]
        assert len(r["losses"]) == len(ref_losses)
        # Every rank reports the global batch's loss.
        for step, (a, b) in enumerate(zip(ref_losses, r["losses"])):
            assert math.isclose(a, b, rel_tol=1e-5), f"rank {rank} step {step}: {a} vs {b}"
        # Every stage and slice reports the global gradient norm (get_global_grad_norm), clipped
        # or not: the duplicated parameters of tensor slices counted once.
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-4), (rank, r["norms"], ref_norms)
        assert r["norm_without_gradients"] == 0.0, rank
        if "eval" in r:
            assert math.isclose(r["eval"], ref_eval, rel_tol=1e-5), (rank, r["eval"], ref_eval)
        for key, tensor in r["state"].items():
            if key in merged:  # replicas, tensor ranks and the tied copies agree exactly
                torch.testing.assert_close(tensor, merged[key], rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {key}: {m}")
            merged[key] = tensor
    assert set(merged) == set(ref_state)
    assert_same_training([], [], ref_state, merged, atol=PARAM_ATOL)  # losses: checked above


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    results = launch(tmp_path_factory.mktemp("pp2"), 2, "pp_1f1b",
                     "pp_gpipe_checkpointed_clipped", "tp_clipped", "pp_fp16_clipped",
                     "pp_frozen_last_stage", "pp_frozen_last_stage_clipped", worker=WORKER)
    check_no_errors(results)
    return results


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    results = launch(tmp_path_factory.mktemp("pp4"), 4, "pp_dp_tight", "tp_dp_tight",
                     "pp_tp_clipped", worker=WORKER)
    check_no_errors(results)
    return results


@pytest.mark.parametrize("name", ["pp_1f1b", "pp_gpipe_checkpointed_clipped"])
def test_two_pipeline_stages_match_one_process(two_ranks, name):
    check_matches_reference(two_ranks, name)
    assert [r[name]["layers"] for r in two_ranks] == [(0, 4), (4, 8)]
    assert two_ranks[0][name]["eval"] == two_ranks[1][name]["eval"]


@pytest.mark.parametrize("name", ["pp_frozen_last_stage", "pp_frozen_last_stage_clipped"])
def test_a_stage_without_trainable_parameters_joins_the_norm_and_training_matches(two_ranks,
                                                                                  name):
    # The last stage has no gradients of its own (its backward only passes the activations'
    # gradients on); its steps add 0 to the norm the first stage's steps all-reduce over the
    # model group (to clip, or for get_global_grad_norm()), and both report the global norm.
    check_matches_reference(two_ranks, name)
    assert two_ranks[0][name]["norms"] == two_ranks[1][name]["norms"]


def test_fp16_stages_skip_the_same_steps_and_track_fp32(two_ranks):
    name = "pp_fp16_clipped"
    ref_losses = reference(name)[0]  # fp32
    stage0, stage1 = (r[name] for r in two_ranks)
    # 2^20 overflows on some steps: the overflow flag is OR-ed over the stages, so both skip
    # the same ones (a stage skipping alone would leave the tied copies different).
    assert stage0["skipped_steps"] == stage1["skipped_steps"] > 0
    assert stage0["losses"] == stage1["losses"]
    for step, (ours, ref) in enumerate(zip(stage0["losses"], ref_losses)):
        assert abs(ours - ref) <= 0.02 * abs(ref), (step, ours, ref)
    tied = "tied.embed.weight"
    torch.testing.assert_close(stage0["state"][tied], stage1["state"][tied], rtol=0, atol=0)


def test_two_tensor_slices_match_one_process(two_ranks):
    check_matches_reference(two_ranks, "tp_clipped")
    # Each rank holds half of every sliced weight; norms, biases of row-parallel layers and
    # position embeddings are whole on both.
    full = sum(t.numel() for t in reference("tp_clipped")[1].values())
    for result in two_ranks:
        assert 0.5 * full < result["tp_clipped"]["local_elements"] < 0.55 * full


@pytest.mark.parametrize("name", ["pp_dp_tight", "tp_dp_tight", "pp_tp_clipped"])
def test_four_ranks_match_one_process(four_ranks, name):
    check_matches_reference(four_ranks, name)
    if name.endswith("tight"):
        for rank, result in enumerate(four_ranks):
            device = result[name]["stats"][0]
            assert device["budget_bytes"] == TIGHT
            assert device["evictions"] > 0, rank
            assert device["peak_chunk_bytes"] <= device["budget_bytes"], rank


def test_pipeline_and_tensor_slices_consolidate_to_the_full_model(four_ranks, tmp_path):
    # 2 stages x 2 tensor slices: patrickstar-consolidate refused any tensor slices.
    name = "pp_tp_clipped"
    consolidate(four_ranks[0][name]["checkpoint"], tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    merged = {}
    for result in four_ranks:
        merged.update(result[name]["state"])
    ref_state = reference(name)[1]
    assert set(full) == set(merged) == set(ref_state)
    for key, value in merged.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)
    plain = gpt_pipeline(gpt_config()).sequential()
    plain.load_state_dict(full)
    assert_same_training([], [], ref_state, plain.state_dict(), atol=PARAM_ATOL)
    # The same checkpoint loaded by 2 stages x 2 data-parallel replicas: refused, then with
    # allow_reshard=True converted to unsliced stages holding exactly the consolidated values.
    (tmp_path / "converted").mkdir()
    converted = launch(tmp_path / "converted", 4, "--convert-pp-tp",
                       four_ranks[0][name]["checkpoint"], worker=WORKER)
    check_no_errors(converted)
    for rank, result in enumerate(converted):
        assert "allow_reshard=True" in result["refused"]["error"], rank
        assert result["state"], rank
        for key, value in result["state"].items():
            torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_pipeline_data_and_tensor_parallel_at_once_match_one_process(tmp_path):
    name = "pp_dp_tp_tight_clipped"
    results = launch(tmp_path, 8, name, worker=WORKER)
    check_no_errors(results)
    check_matches_reference(results, name)
    assert [r[name]["coord"] for r in results] == [(p, d, t) for p in range(2) for d in range(2)
                                                   for t in range(2)]
    for result in results:
        assert result[name]["stats"][0]["evictions"] > 0


def test_mismatched_stages_are_clear_errors(tmp_path):
    results = launch(tmp_path, 2, "--mismatch", worker=WORKER)
    for rank, result in enumerate(results):
        agreement = result["agreement"]
        assert agreement["error_type"] == "RuntimeError", agreement
        assert "ranks disagree on gradient_accumulation_steps" in agreement["error"]
        assert "rank 0: gradient_accumulation_steps = 2; rank 1: gradient_accumulation_steps = 3" \
            in agreement["error"]
        tied = result["tied"]
        assert tied["error_type"] == "ValueError", tied
        assert "'embed'" in tied["error"] and "stage 0: [(128, 32)]" in tied["error"] \
            and "stage 1: [(128, 48)]" in tied["error"]
    stage1 = results[1]["activation"]
    assert stage1["error_type"] == "RuntimeError", stage1
    assert "pipeline stage 1" in stage1["error"] and "[(4, 32) float32]" in stage1["error"] \
        and "from stage 0 (rank 0)" in stage1["error"]
    stage0 = results[0]["activation"]
    assert stage0["error_type"] in ("PipelinePeerError", "TimeoutError"), stage0
    assert "stage 1 (rank 1)" in stage0["error"]


def test_evaluating_on_one_rank_of_stages_or_slices_raises_on_both_at_once(tmp_path):
    """Note [Calls on one rank of a model replica]: DDP's `if rank == 0:` evaluation, with
    stages or slices and no data parallelism. Without the agreement the stages paired rank 0's
    evaluation with rank 1's training until the collective timeout (20 s here), and the slices
    all-reduced an evaluation with a training forward (a wrong loss) before gloo aborted."""
    results = launch(tmp_path, 2, "--alone", worker=WORKER)
    calls = {"pipe_alone": ("eval_batch()", "train_batch()"),
             "tensor_alone": ("a forward without backward", "a training forward")}
    for key, (evaluating, training) in calls.items():
        for rank, result in enumerate(results):
            error = result[key]
            assert error.get("error_type") == "RuntimeError", (key, rank, error)
            assert error["elapsed"] < 10, (key, rank, error)
            assert "not making the same call" in error["error"]
            assert "rank 0: call " in error["error"] and evaluating in error["error"]
            assert "rank 1: call " in error["error"] and training in error["error"]
            assert "on every rank" in error["error"]
    # Afterwards the ranks evaluate and train together, agreeing on every value; a read on one
    # rank alone (each slice's own state dict) makes no collective and needs no agreement.
    for key in ("pipe_together", "tensor_together"):
        assert results[0][key] == results[1][key]
        assert all(math.isfinite(value) for value in results[0][key])
    assert results[0]["tensor_read_alone"] > 0


def test_a_dead_stage_is_an_error_naming_it(tmp_path):
    survivor = launch(tmp_path, 2, "--kill", worker=WORKER)[0]
    assert survivor.get("error_type") in ("PipelinePeerError", "TimeoutError"), survivor
    assert "stage 1 (rank 1)" in survivor["error"]


def test_a_stalled_stage_is_a_timeout_naming_it(tmp_path):
    survivor = launch(tmp_path, 2, "--stall", worker=WORKER)[0]
    assert survivor.get("error_type") == "TimeoutError", survivor
    assert "stage 1 (rank 1)" in survivor["error"] and "2 s" in survivor["error"]
    assert survivor["elapsed"] < 6


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    results = launch(tmp_path_factory.mktemp("profiled"), 2, "--profile", worker=WORKER)
    check_no_errors(results)
    return results


def test_tensor_and_pipeline_collectives_are_in_the_profile_and_bad_strides_name_sizes(profiled):
    # The tensor slicing's all-reduces and the pipeline's tied-gradient sum used to bypass the
    # profiler: a profile of a tensor-parallel run showed no communication at all.
    results = profiled
    layers = gpt_config().layers
    for rank, result in enumerate(results):
        tp = [c for c in result["tp"] if c["name"] == "tensor_all_reduce"]
        # Forward: g after the embedding, after each block's attention and MLP, and the cross
        # entropy's max, target logit and sum; backward: f before each block's qkv and fc and
        # before the tied head.
        assert len(tp) == (1 + 2 * layers + 3) + (2 * layers + 1), (rank, len(tp))
        batch, seq, hidden = result["tp_activation_shape"]
        partial = [c for c in tp if c["args"]["label"] == "g forward: partial outputs"]
        assert len(partial) == 1 + 2 * layers
        assert all(c["bytes"] == batch * seq * hidden * 4 and c["phase"] == "forward"
                   for c in partial), partial
        assert {c["phase"] for c in tp if c["args"]["label"].startswith("f backward")} \
            == {"backward"}
        assert [c["args"]["op"] for c in tp if c["args"]["label"].endswith(": max")] == ["max"]
        tied = [c for c in result["pp"] if c["name"] == "pipeline_all_reduce"]
        # The tied embedding's gradient, summed over the two stages once per batch.
        assert [c["args"]["label"] for c in tied] == ["tied gradient tied.embed.weight"]
        assert tied[0]["bytes"] == (128 * 32 + 1) * 4
        assert [c["name"] for c in result["pp"] if c["name"].startswith("pipeline")].count(
            "pipeline_broadcast") == 1
        # Two micro batches: stage 0 sends two activations and receives their two gradients,
        # stage 1 the other way round; each the hidden states plus a 16-element int64 header.
        sent, received = ("pipeline_send", "pipeline_recv")[::1 if rank == 0 else -1]
        for name, kind in ((sent, "activation"), (received, "gradient")):
            records = [c for c in result["pp"] if c["name"] == name]
            assert [c["args"]["label"].split(" of ")[0] for c in records] == [f"the {kind}"] * 2
            assert all(c["bytes"] == 2 * 16 * 32 * 4 + 16 * 8 for c in records), records
            assert all(c["args"]["peer"] == 1 - rank for c in records)
        stride = result["stride"]
        assert stride["error_type"] == "ValueError"
        assert "out_features = 99 is not divisible by stride 3 x the tensor-parallel size 2" \
            in stride["error"], stride


def test_parallel_tensor_over_an_unsliced_model_warns(profiled):
    # parallel.tensor = 2 over a model without tensor_parallel layers (a Hugging Face model)
    # trained silently with the whole model on both tensor ranks.
    for result in profiled:
        assert result["sliced_warnings"] == []
        [(message, filename)] = [w for w in result["unsliced_warnings"]
                                 if "no sliced parameters" in w[0]]
        assert "'parallel.tensor' is 2" in message and "(Sequential)" in message
        assert filename == "parallel_worker.py"  # points at the initialize() call


def test_tensor_slices_checkpoint_apart_and_other_layouts_are_refused(tmp_path):
    # Both tensor ranks wrote rank_00000.shard into the same directory: the checkpoint kept one
    # slice, and loading gave rank 0 rank 1's slices (another model) without a word.
    results = launch(tmp_path, 2, "--checkpoint", worker=WORKER)
    check_no_errors(results)
    for rank, result in enumerate(results):
        assert result["directories"] == ["pipe_00-tensor_00", "pipe_00-tensor_01"]
        assert result["differing_after_load"] == [], rank
        for key, value in result["next_state"].items():  # optimizer state restored too
            torch.testing.assert_close(result["resumed_state"][key], value, rtol=0, atol=0)
        for what, saved in (("as_data_parallel", "parallel.pipeline = 1, parallel.tensor = 2"),
                            ("stages_as_slices", "parallel.pipeline = 2, parallel.tensor = 1"),
                            ("whole_as_slices", "whole model")):
            error = result[what]
            assert error["error_type"] == "CheckpointError", error
            assert saved in error["error"], error
        assert "allow_reshard=True" in result["as_data_parallel"]["error"]
        assert "allow_reshard" not in result["stages_as_slices"]["error"]  # pipelines never
        # allow_reshard=True converts 2 tensor slices to none and back (a loading run refused
        # both): the saved weights exactly, then a step as the unconverted run's (to rounding,
        # the sliced and unsliced matmuls sum in other orders).
        saved = results[0]["saved_state"]
        for key, value in saved.items():
            torch.testing.assert_close(result["unsliced_loaded"][key], value, rtol=0, atol=0)
            torch.testing.assert_close(result["sliced_again"][key], value, rtol=0, atol=0)
        assert_same_training([], [], result["next_state"], result["unsliced_next_state"],
                             atol=PARAM_ATOL)
        assert_same_training([], [], result["next_state"], result["sliced_again_next_state"],
                             atol=PARAM_ATOL)
    # 8-bit moments across tensor slicings (Note [Converting tensor slices at load]; the load
    # was refused): each saved slice dequantized, joined, then quantized in the unsliced
    # engine's blocks, so within half a code step of the saved values (the map's widest step is
    # 0.9 / 64 of a block's absmax: 1% of the tensor's absmax bounds it), and training goes on.
    partitions = results[0]["int8_partitions"]
    assert partitions  # the GPT's sliced layers
    for rank, result in enumerate(results):
        assert "int8_unsliced_error" not in result, result["int8_unsliced_error"]
        assert math.isfinite(result["int8_unsliced_loss"])
        assert set(result["int8_unsliced"]) == set(results[0]["int8_slices"])
        for name, moments in result["int8_unsliced"].items():
            for key, value in moments.items():
                parts = [each["int8_slices"][name][key] for each in results]
                saved = (tensor_parallel.join_slices(parts, *partitions[name])
                         if name in partitions else parts[0])
                assert value.shape == saved.shape, (name, key)
                torch.testing.assert_close(value, saved, rtol=0,
                                           atol=0.01 * float(saved.abs().max()),
                                           msg=f"rank {rank} {name} {key}")
                if name not in partitions:  # neither joined nor split: the very codes
                    assert torch.equal(value, saved), (name, key)
    # patrickstar-consolidate of the pipeline's directory: the whole model (it said "no 'latest'
    # file"), sequential()'s keys, each stage's values; tensor slices are refused, naming them.
    merged = {**results[1]["staged_state"], **results[0]["staged_state"]}
    consolidate(tmp_path / "staged", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt")
    assert set(whole) == set(gpt_pipeline(gpt_config()).sequential().state_dict())
    for key, value in merged.items():
        torch.testing.assert_close(whole[key], value, rtol=0, atol=0)
    # Tensor slices join into the full model (patrickstar-consolidate refused them: nothing
    # recorded how): what the engine gathered, loadable into the plain model.
    consolidate(tmp_path / "sliced", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt")
    saved = results[0]["saved_state"]
    assert set(full) == set(saved)
    for key, value in saved.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)
    plain = ParallelGPT(gpt_config())  # no topology here: the plain PyTorch layers
    plain.load_state_dict(full)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
    # A checkpoint saved before the slicing was recorded: refused as before, naming why.
    meta_dir = tmp_path / "sliced" / "pipe_00-tensor_01" / "t"
    body = read_meta(meta_dir)
    del body["model_parallel"]
    write_meta(meta_dir, body)
    with pytest.raises(CheckpointError, match="saved before PatrickStar recorded how tensor "
                                              "slices join"):
        consolidate(tmp_path / "sliced", tmp_path / "sliced.pt")
    shutil.rmtree(tmp_path / "sliced" / "pipe_00-tensor_01")
    os.mkdir(tmp_path / "sliced" / "pipe_00-tensor_02")
    with pytest.raises(ValueError, match=r"lacks the slice directories \['pipe_00-tensor_01'\]"):
        consolidate(tmp_path / "sliced", tmp_path / "sliced.pt")


def test_pipeline_stages_with_data_parallelism_checkpoint_and_resume(tmp_path):
    # save_checkpoint of 2 stages x 2 replicas raised NotImplementedError ("the engine's
    # checkpoints are written by one rank"), which engine checkpoints no longer are.
    results = launch(tmp_path, 4, "--checkpoint-pp-dp", worker=WORKER)
    check_no_errors(results)
    for rank, result in enumerate(results):
        assert result["files"] == ["meta.json", "rank_00000.shard", "rank_00000_extra.pt",
                                   "rank_00001.shard", "rank_00001_extra.pt"]
        for key, value in result["saved"].items():
            torch.testing.assert_close(result["loaded"][key], value, rtol=0, atol=0)
        assert result["resumed_loss"] == result["next_loss"], rank
        for key, value in result["next_state"].items():  # optimizer state restored too
            torch.testing.assert_close(result["resumed_state"][key], value, rtol=0, atol=0)
