"""Checkpoints (issue 10): exact resume, atomicity under SIGKILL, checksums, mismatch errors,
resharding by tensor name."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy
import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import checkpoint
from patrickstar.checkpoint import CheckpointError, CheckpointReader

HERE = os.path.dirname(os.path.abspath(__file__))


class DropoutMLP(nn.Module):
    """Dropout and a BatchNorm buffer, so resume depends on RNG states and buffers."""

    def __init__(self, sizes=(32, 64, 64, 10)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.norm = nn.BatchNorm1d(sizes[1], affine=False)  # fp32 buffers in every mode
        self.drop = nn.Dropout(0.1)

    def forward(self, x, y):
        x = x.to(self.layers[0].weight.dtype)  # the compute dtype (fp32, fp16 or bf16)
        x = self.drop(torch.relu(self.norm(self.layers[0](x).float()).to(x.dtype)))
        for layer in self.layers[1:-1]:
            x = self.drop(torch.relu(layer(x)))
        return nn.functional.cross_entropy(self.layers[-1](x).float(), y)


def batches(steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=generator),
             torch.randint(0, 10, (16,), generator=generator)) for _ in range(steps)]


PRECISIONS = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "bf16": {"bf16": {"enabled": True}},
    # Issue 21's 8 bytes per parameter: bf16 without master (Kahan compensation), 8-bit moments.
    "bf16_lowp": {"bf16": {"enabled": True, "master_weights": False},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01,
                                                            "state_dtype": "int8"}}},
}


def make(config, model_func=DropoutMLP, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(model_func, config=config)
    return model, opt


def train(model, opt, data, scheduler=None):
    losses = []
    for x, y in data:
        loss = model(x, y)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def full_state(model, opt):
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    for index, entry in opt_state["state"].items():
        for key, value in entry.items():
            state[f"opt.{index}.{key}"] = value.clone()
    state["loss_scale"] = torch.tensor(opt.loss_scale)
    return state


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), f"{key} differs"


def base_config(precision, **extra):
    config = {"default_chunk_size": 4096,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    config.update(PRECISIONS[precision])
    config.update(extra)
    return config


def resume_pair(tmp_path, config, before=3, after=3):
    """Trains `before` steps, saves, trains `after` more; a fresh engine loads the checkpoint
    and trains the same `after` steps. Returns both runs' losses and final states."""
    data = batches(before + after)
    model, opt = make(config)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt, data[:before], sched)
    assert model.save_checkpoint(tmp_path, client_state={"epoch": 7}, lr_scheduler=sched)
    rng_after_save = (torch.get_rng_state(), random.random(), numpy.random.rand())
    losses = train(model, opt, data[before:], sched)
    expected = full_state(model, opt)

    other, other_opt = make(config, seed=123)  # different init and RNG: all must be restored
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=2, gamma=0.5)
    torch.manual_seed(999), random.seed(999), numpy.random.seed(999)
    path, client_state = other.load_checkpoint(tmp_path, lr_scheduler=other_sched)
    # DeepSpeed's is TAG/mp_rank_00_model_states.pt: dirname is the tag's directory.
    assert path == os.path.join(tmp_path, f"global_step{before}", "meta.json")
    assert client_state == {"epoch": 7}
    assert torch.equal(torch.get_rng_state(), rng_after_save[0])
    assert random.random() == rng_after_save[1] and numpy.random.rand() == rng_after_save[2]
    assert other_sched.state_dict() == {**sched.state_dict(), "last_epoch": before,
                                        "_step_count": before + 1,
                                        "_last_lr": other_sched.state_dict()["_last_lr"]}
    torch.set_rng_state(rng_after_save[0])
    resumed = train(other, other_opt, data[before:], other_sched)
    return losses, resumed, expected, full_state(other, other_opt)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "bf16_lowp"])
def test_exact_resume_is_bit_identical(tmp_path, precision):
    losses, resumed, expected, actual = resume_pair(tmp_path, base_config(precision))
    assert losses == resumed  # bit for bit, not approximately
    assert_identical(expected, actual)


def test_exact_resume_with_nvme_state_and_tight_budgets(tmp_path, nvme_dir):
    # 4096-element fp32 chunks are 16 KiB; device 3 + host 4 of the 8 chunks: the rest is on
    # NVMe at every save and load.
    config = base_config("fp32", memory={"device_budget": 3 * 16384, "host_budget": 4 * 16384,
                                         "nvme": {"path": nvme_dir}})
    losses, resumed, expected, actual = resume_pair(tmp_path, config)
    assert losses == resumed
    assert_identical(expected, actual)


def test_fp16_loss_scaler_and_skipped_steps_are_restored(tmp_path):
    config = base_config("fp16")
    config["fp16"].update({"loss_scale_window": 3, "hysteresis": 1})
    model, opt = make(config)
    x, y = batches(1)[0]
    model.backward(model(x, y) * float("inf"))
    opt.step(), opt.zero_grad()
    train(model, opt, batches(2, seed=1))
    assert opt.skipped_steps == 1 and opt.loss_scale == 128
    model.save_checkpoint(tmp_path, tag="t")
    other, other_opt = make(config)
    other.load_checkpoint(tmp_path, "t")
    assert other_opt.skipped_steps == 1 and other_opt.loss_scale == 128
    assert other.loss_scaler.state_dict() == model.loss_scaler.state_dict()
    # One more clean step completes the window of 3 in both.
    data = batches(1, seed=2)
    train(model, opt, data), train(other, other_opt, data)
    assert opt.loss_scale == other_opt.loss_scale == 256


def test_layout_on_disk_and_latest_pointer(tmp_path):
    model, opt = make(base_config("bf16"))
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path)
    model.save_checkpoint(tmp_path, tag="named")
    assert (tmp_path / "latest").read_text().strip() == "named"
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest", "named"]
    assert sorted(os.listdir(tmp_path / "named")) == ["meta.json", "rank_00000.shard",
                                                      "rank_00000_extra.pt"]
    meta = checkpoint.read_meta(str(tmp_path / "named"))
    assert meta["precision"] == "bf16" and meta["world_size"] == 1
    assert meta["layout"]["chunk_elements"] == 4096
    assert meta["layout"]["hash"] == f"{model.layout['layout_hash']:016x}"
    assert meta["engine"]["step_counts"]["layers.0.weight"] == 2
    with CheckpointReader(str(tmp_path)) as reader:
        kinds = {kind for _, kind in reader.index}
        assert kinds == {"param", "master", "exp_avg", "exp_avg_sq", "buffer"}
        assert reader.entry("layers.0.weight", "param").dtype == "bfloat16"
        assert reader.entry("layers.0.weight", "master").offset % 64 == 0
    # Overwriting an existing tag swaps it atomically and leaves no partial directory.
    model.save_checkpoint(tmp_path, tag="named")
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest", "named"]


def test_missing_latest_returns_none_like_deepspeed(tmp_path):
    model, _ = make(base_config("fp32"))
    with pytest.warns(UserWarning, match="no 'latest' file"):
        assert model.load_checkpoint(tmp_path) == (None, None)
    with pytest.warns(UserWarning, match=f"'{tmp_path / 'typo'}' does not exist; nothing loaded"):
        assert model.load_checkpoint(tmp_path / "typo") == (None, None)
    with pytest.raises(CheckpointError, match="does not exist"):
        model.load_checkpoint(tmp_path, tag="nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="/file' is a file, not a tag's directory"):
        model.load_checkpoint(tmp_path, tag="file")
    with pytest.raises(ValueError, match="tag"):
        model.save_checkpoint(tmp_path, tag="../escape")


def test_a_file_at_the_tags_path_or_a_directory_at_latest_is_refused_before_writing(tmp_path):
    """A file named like the tag was swapped out of the way under a hidden name and left there
    (".t1.partial-..."); a directory at 'latest' failed after the checkpoint was published."""
    model, _ = make(base_config("fp32"))
    (tmp_path / "t1").write_text("mine")
    with pytest.raises(CheckpointError, match=f"'{tmp_path / 't1'}' exists and is not a "
                                              f"checkpoint directory"):
        model.save_checkpoint(tmp_path, tag="t1")
    assert sorted(os.listdir(tmp_path)) == ["t1"] and (tmp_path / "t1").read_text() == "mine"
    (tmp_path / "latest").mkdir()
    with pytest.raises(CheckpointError, match=f"'{tmp_path / 'latest'}' exists and is not the "
                                              f"file naming the latest checkpoint"):
        model.save_checkpoint(tmp_path, tag="t2")
    assert sorted(os.listdir(tmp_path)) == ["latest", "t1"]
    assert model.save_checkpoint(tmp_path, tag="t2", save_latest=False)
    assert model.load_checkpoint(tmp_path, tag="t2")[0] == str(tmp_path / "t2" / "meta.json")


def _saved(tmp_path, precision="fp32", **config_extra):
    model, opt = make(base_config(precision, **config_extra))
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag="t")
    return model, opt


@pytest.mark.parametrize("damage", ["flip", "truncate", "flip_extra", "meta"])
def test_corrupt_or_truncated_files_are_named_and_change_nothing(tmp_path, damage):
    _saved(tmp_path)
    target = {"flip": "rank_00000.shard", "truncate": "rank_00000.shard",
              "flip_extra": "rank_00000_extra.pt", "meta": "meta.json"}[damage]
    path = tmp_path / "t" / target
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2:]
    else:
        data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    model, opt = make(base_config("fp32"), seed=5)
    before = full_state(model, opt)
    with pytest.raises(CheckpointError, match=target):
        model.load_checkpoint(tmp_path)
    assert_identical(before, full_state(model, opt))


def test_mismatched_checkpoints_name_the_difference(tmp_path):
    _saved(tmp_path)
    other_model, _ = make(base_config("fp32"), model_func=lambda: DropoutMLP((32, 48, 64, 10)))
    with pytest.raises(CheckpointError, match=r"other model: 'layers.0.weight' has shape "
                                              r"\[64, 32\] in the checkpoint but \[48, 32\]"):
        other_model.load_checkpoint(tmp_path)
    bf16, _ = make(base_config("bf16"))
    with pytest.raises(CheckpointError, match="other dtype: the checkpoint was written in fp32"):
        bf16.load_checkpoint(tmp_path)
    relaid, opt = make(base_config("fp32", default_chunk_size=8192))
    before = full_state(relaid, opt)
    with pytest.raises(CheckpointError, match=r"other layout: chunk layout hash .* \(4096 "
                                              r"elements per chunk\) .* \(8192 elements\)"):
        relaid.load_checkpoint(tmp_path)
    assert_identical(before, full_state(relaid, opt))
    # By tensor name the values load exactly into the other layout.
    relaid.load_checkpoint(tmp_path, allow_reshard=True)
    original, original_opt = make(base_config("fp32"))
    original.load_checkpoint(tmp_path)
    assert_identical(full_state(original, original_opt), full_state(relaid, opt))


def test_another_state_dtype_is_named_when_refused(tmp_path):
    # The refusal named two layout hashes and the same chunk size twice ("(4096 elements per
    # chunk) in the checkpoint, ... (4096 elements) in the model"), not what had changed.
    _saved(tmp_path)
    config = base_config("fp32")
    config["optimizer"]["params"]["state_dtype"] = "bf16"
    model, _ = make(config)
    with pytest.raises(CheckpointError, match=r"optimizer.params.state_dtype 'fp32' in the "
                                              r"checkpoint, 'bf16' in the model; momentum: "
                                              r"float32 in the checkpoint, bfloat16 in the model"):
        model.load_checkpoint(tmp_path)
    model.load_checkpoint(tmp_path, allow_reshard=True)


def test_save_refuses_pending_gradients_and_load_module_only(tmp_path):
    config = base_config("fp32", gradient_accumulation_steps=2)
    model, opt = make(config)
    x, y = batches(1)[0]
    model.backward(model(x, y))
    with pytest.raises(RuntimeError, match="pending"):
        model.save_checkpoint(tmp_path)
    assert not os.path.exists(tmp_path / "latest")
    model.backward(model(x, y))
    opt.step(), opt.zero_grad()
    model.save_checkpoint(tmp_path)
    fresh, fresh_opt = make(config, seed=3)
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key])
    assert fresh_opt.state_dict()["state"] == {}  # optimizer state untouched


def _fake_two_rank_checkpoint(source_dir, tag, target_dir):
    """Rewrites a 1-rank checkpoint as the 2-rank one a data-parallel run would write: each rank's
    shard holds the tensors of the chunks the chunk manager's 2-rank layout gives that rank
    (Note [Resharding]); buffers and extra state go with every rank."""
    with CheckpointReader(source_dir, tag) as reader:
        meta = dict(reader.meta)
        os.makedirs(os.path.join(target_dir, tag))
        shards, extras = [], []
        for rank in range(2):
            owned = checkpoint.owned_tensor_names(meta, world_size=2, rank=rank)
            entries = [checkpoint.Entry(name, kind, e.dtype, e.shape)
                       for (name, kind), (_, e) in reader.index.items()
                       if (name, kind) in owned or kind == "buffer"]
            path = os.path.join(target_dir, tag, checkpoint.shard_name(rank))
            size, digest = checkpoint.write_shard(
                path, {"rank": rank, "world_size": 2}, entries,
                lambda e: reader.tensor(e.name, e.kind).clone())
            shards.append({"rank": rank, "file": checkpoint.shard_name(rank), "bytes": size,
                           "sha256": digest})
            extra = os.path.join(reader.directory, checkpoint.extra_name(0))
            target_extra = os.path.join(target_dir, tag, checkpoint.extra_name(rank))
            with open(extra, "rb") as src, open(target_extra, "wb") as dst:
                dst.write(src.read())
            extras.append({**meta["extras"][0], "rank": rank,
                           "file": checkpoint.extra_name(rank)})
        meta.update(world_size=2, shards=shards, extras=extras)
        meta["layout"] = {**meta["layout"], "world_size": 2}
        with open(os.path.join(target_dir, tag, "meta.json"), "w") as handle:
            json.dump({"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                       "sha256": checkpoint.meta_checksum(meta), "body": meta}, handle)
        return shards, reader


def test_a_save_between_backward_and_step_names_both_ways_on(tmp_path):
    """Without gradient accumulation the refusal spoke of "an unfinished accumulation" only."""
    model, opt = make(base_config("fp32"))
    x, y = batches(1)[0]
    model.backward(model(x, y))
    with pytest.raises(RuntimeError, match=r"not yet applied by optimizer.step\(\).*call it "
                                           r"after optimizer.step\(\), or drop them with "
                                           r"optimizer.zero_grad\(\)"):
        model.save_checkpoint(tmp_path)
    opt.zero_grad()
    model.save_checkpoint(tmp_path)
    assert os.path.exists(tmp_path / "latest")
    model.destroy()


def test_two_rank_layout_loads_on_one_rank_and_one_rank_splits_for_two(tmp_path):
    original, original_opt = _saved(tmp_path / "one", "fp16")
    _fake_two_rank_checkpoint(str(tmp_path / "one"), "t", str(tmp_path / "two"))
    with CheckpointReader(str(tmp_path / "two"), "t") as two:
        per_rank = [{key for key, (shard, _) in two.index.items() if shard is s}
                    for s in two.shards]
        params = [{k for k in keys if k[1] != "buffer"} for keys in per_rank]
        assert params[0] and params[1] and not params[0] & params[1]  # a real split
    model, opt = make(base_config("fp16"), seed=9)
    with pytest.raises(CheckpointError, match="written by 2 rank"):
        model.load_checkpoint(tmp_path / "two", "t")
    model.load_checkpoint(tmp_path / "two", "t", allow_reshard=True)
    assert_identical(full_state(original, original_opt), full_state(model, opt))
    # 1 -> 2: each rank of a 2-rank layout finds all of its tensors in the 1-rank checkpoint.
    with CheckpointReader(str(tmp_path / "one"), "t") as one:
        for rank in range(2):
            for name, kind in checkpoint.owned_tensor_names(one.meta, 2, rank):
                assert one.has(name, kind), (rank, name, kind)


# ---- Crashes ---------------------------------------------------------------------------------

WRITER = os.path.join(HERE, "checkpoint_writer.py")


def _run_writer(save_dir, mode, crash_at=None):
    env = dict(os.environ)
    env.pop("PATRICKSTAR_CHECKPOINT_CRASH_AT", None)
    if crash_at:
        env["PATRICKSTAR_CHECKPOINT_CRASH_AT"] = crash_at
    return subprocess.Popen([sys.executable, WRITER, str(save_dir), mode], env=env,
                            stdout=subprocess.PIPE, text=True)


def _load_latest(save_dir):
    model, opt = make(base_config("fp32"), seed=4)
    path, client = model.load_checkpoint(save_dir)
    return os.path.basename(os.path.dirname(path)), client, model


CRASH_POINTS = {"shard_half_written": "first", "before_meta": "first",
                "before_rename": "first", "before_latest": "first", "after_latest": "second"}


def test_sigkill_at_every_stage_leaves_the_previous_checkpoint_loadable(tmp_path):
    writers = {point: _run_writer(tmp_path / point, "two", point) for point in CRASH_POINTS}
    for point, expected in CRASH_POINTS.items():
        writer = writers[point]
        writer.communicate(timeout=120)
        assert writer.returncode == -signal.SIGKILL, point
        tag, client, _ = _load_latest(tmp_path / point)
        assert tag == expected and client == {"tag": expected}, point
        # The dead writer's partial directory is removed by the next save.
        model, opt = make(base_config("fp32"))
        model.save_checkpoint(tmp_path / point, tag="third")
        assert sorted(os.listdir(tmp_path / point)) == sorted(
            {"first", "latest", "third"} | ({"second"} if expected == "second"
                                            or point == "before_latest" else set())), point


def test_sigkill_at_random_moments_never_breaks_latest(tmp_path):
    rng = random.Random(1234)
    for attempt in range(3):
        save_dir = tmp_path / f"run{attempt}"
        writer = _run_writer(save_dir, "loop")
        assert writer.stdout.readline().strip() == "ready"  # the first checkpoint exists
        time.sleep(rng.uniform(0.0, 0.5))
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=60)
        tag, client, model = _load_latest(save_dir)
        assert client == {"tag": tag}
        expected = torch.full((64, 32), float(client["tag"].split("-")[1]))
        assert torch.equal(model.state_dict()["layers.0.weight"], expected)


def test_an_adamw_checkpoint_in_an_adam_config_trains_the_configs_adam_and_says_so(tmp_path):
    """Its groups' decoupled_weight_decay (True) loaded into an Adam config's groups, which then
    said AdamW while the config's Adam (L2 decay) trained. As in DeepSpeed the config's type
    decides: the groups keep it, a warning names both, and the run is an Adam engine's loaded
    from the same weights and moments (Note [Saved groups of another optimizer])."""
    _saved(tmp_path)  # AdamW, weight_decay 0.01
    config = base_config("fp32")
    config["optimizer"]["type"] = "Adam"
    model, opt = make(config, seed=1)
    with pytest.warns(UserWarning, match=r"saved by AdamW; the config's optimizer type 'Adam' "
                                         r"decides the update"):
        model.load_checkpoint(tmp_path, tag="t")
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    data = batches(2, seed=4)
    train(model, opt, data)
    reference, reference_opt = make(config, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.load_checkpoint(tmp_path, tag="t")  # the same rng states, for the dropout
    train(reference, reference_opt, data)
    assert_identical(full_state(model, opt), full_state(reference, reference_opt))


def _masters_and_compensations(model):
    """Each trainable parameter's (16-bit weight, fp32 master or None, compensation or None)."""
    state = checkpoint.EngineState(model)
    result = {}
    for index, name in enumerate(state.names):
        kinds = state.kinds(index)
        views = {}
        for kind in ("param", "master", "compensation"):
            if kind in kinds:
                with state.view(index, kind) as view:
                    views[kind] = view.clone()
        result[name] = views
    return result


@pytest.mark.parametrize("precision", ["fp16", "bf16", "bf16_lowp"])
@pytest.mark.parametrize("module_only", [False, True])
def test_a_load_without_optimizer_states_rebuilds_masters_from_the_weights(tmp_path, precision,
                                                                            module_only):
    # DeepSpeed's load_checkpoint(load_optimizer_states=False) and load_module_only=True load
    # the 16-bit weights and rebuild the fp32 masters from them (_restore_from_bit16_weights,
    # refresh_fp32_params); the optimizer state stays the engine's; global_steps and
    # skipped_steps are restored unless load_module_only (Note [Masters rebuilt from the
    # weights]).
    config = base_config(precision)
    model, opt = make(config)
    train(model, opt, batches(3))
    saved = _masters_and_compensations(model)
    hidden = [name for name, views in saved.items()
              if ("master" in views and not torch.equal(views["master"],
                                                        views["param"].float()))
              or ("compensation" in views and views["compensation"].any())]
    assert hidden  # the checkpoint holds more than its weights show
    model.save_checkpoint(tmp_path)

    fresh, fresh_opt = make(config, seed=5)
    scale = fresh_opt.loss_scale
    fresh.load_checkpoint(tmp_path, load_optimizer_states=False, load_module_only=module_only)
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key
    for name, views in _masters_and_compensations(fresh).items():
        assert torch.equal(views["param"], saved[name]["param"]), name
        if "master" in views:
            assert torch.equal(views["master"], views["param"].float()), name
        if "compensation" in views:
            assert not views["compensation"].any(), name
    assert fresh_opt.state_dict()["state"] == {}  # the optimizer state is not loaded
    assert fresh_opt.loss_scale == scale  # it goes with the optimizer state
    assert fresh.global_steps == (0 if module_only else 3)
    train(fresh, fresh_opt, batches(1, seed=1))  # and it trains on


def test_deepspeeds_checkpoint_arguments_mean_what_they_mean_in_deepspeed(tmp_path):
    # Note [DeepSpeed's checkpoint signatures]: DeepSpeed's positional order, its keywords
    # (exclude_frozen_parameters, load_module_strict: Hugging Face's Trainer passes it), the
    # `latest` file as DeepSpeed writes it, and the loop's counters after a resume.
    config = base_config("bf16", train_batch_size=16, train_micro_batch_size_per_gpu=16)
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(DropoutMLP, config=config, lr_scheduler=schedule)
    for x, y in batches(2):
        model.backward(model(x, y))
        model.step()
    client = {"epoch": 3, "ids": torch.arange(4)}
    assert model.save_checkpoint(tmp_path, None, client, True, True)  # exclude_frozen_parameters
    assert (tmp_path / "latest").read_text() == "global_step2"  # no newline, as DeepSpeed's
    with pytest.raises(TypeError, match="exclude_frozen_parameters .* lr_scheduler="):
        model.save_checkpoint(tmp_path, "x", None, True, model.lr_scheduler)

    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh, fresh_opt = patrickstar.initialize(DropoutMLP, config=config, lr_scheduler=schedule)
    # DeepSpeed's order: load_module_strict=True, load_optimizer_states=False.
    path, loaded = fresh.load_checkpoint(tmp_path, "global_step2", True, False)
    assert path == os.path.join(tmp_path, "global_step2", "meta.json")
    assert loaded.keys() == client.keys() and torch.equal(loaded["ids"], client["ids"])
    assert fresh_opt.state_dict()["state"] == {}  # no optimizer state, as asked
    assert fresh.lr_scheduler.last_epoch == 2  # the scheduler's state is loaded
    assert fresh.global_steps == 2 and fresh.global_samples == model.global_samples == 32
    assert not fresh.was_step_applied() and fresh.is_gradient_accumulation_boundary()
    fresh.load_checkpoint(tmp_path, load_module_strict=False)
    assert fresh.get_lr() == model.get_lr() == [0.0025]  # the groups' lr with the optimizer's
    assert fresh_opt.state_dict()["state"].keys() == model.optimizer.state_dict()["state"].keys()
    with pytest.raises(TypeError, match="custom_load_fn"):
        fresh.load_checkpoint(tmp_path, custom_load_fn=lambda src, dst: None)


def test_a_load_starts_a_new_accumulation_of_model_step_calls(tmp_path):
    # model.step() calls count as micro-steps (Note [model.step() without a backward] in
    # deepspeed_loop.py); a load drops the gradients, so it starts the count again.
    model, opt = make(base_config("fp32", gradient_accumulation_steps=2))
    data = batches(2)
    model.save_checkpoint(tmp_path)
    model.backward(model(*data[0]))
    model.step()
    assert model.is_gradient_accumulation_boundary()
    model.load_checkpoint(tmp_path)
    assert not model.is_gradient_accumulation_boundary()
    model.backward(model(*data[0]))
    model.step()
    assert model.global_steps == 0  # one micro-step of two: no optimizer step yet
    model.backward(model(*data[1]))
    model.step()
    assert model.global_steps == 1


class FrozenFirstLayer(DropoutMLP):
    """A LoRA run's shape: the first layer is the base model's, frozen."""

    def __init__(self):
        super().__init__()
        self.layers[0].requires_grad_(False)


def test_exclude_frozen_parameters_leaves_them_out_and_a_load_keeps_the_engines(tmp_path):
    # Note [Frozen parameters left out]: DeepSpeed's save_checkpoint(exclude_frozen_parameters=
    # True) saves no frozen parameter; ours raised TypeError on the keyword.
    from patrickstar.consolidate import consolidate
    config = base_config("bf16")
    model, opt = make(config, FrozenFirstLayer)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path / "all", tag="t")
    model.save_checkpoint(tmp_path / "some", tag="t", exclude_frozen_parameters=True)
    frozen = {"layers.0.weight", "layers.0.bias"}
    with CheckpointReader(tmp_path / "some", "t") as reader:
        assert sorted(reader.meta["excluded_frozen"]) == sorted(frozen)
        assert not any(reader.has(name, "param") for name in frozen)
        assert reader.has("layers.1.weight", "param") and reader.has("norm.running_mean",
                                                                     "buffer")
    size = lambda name: sum(f.stat().st_size for f in (tmp_path / name / "t").iterdir())  # noqa
    assert size("some") < size("all")

    fresh, fresh_opt = make(config, FrozenFirstLayer, seed=7)  # other base weights
    base = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh.load_checkpoint(tmp_path / "some", "t")
    for key, value in fresh.state_dict().items():
        expected = base[key] if key.removeprefix("module.") in frozen else model.state_dict()[key]
        assert torch.equal(value, expected), key
    assert fresh.global_steps == 2
    train(fresh, fresh_opt, batches(1))

    consolidate(tmp_path / "some", tmp_path / "some.pt", dtype="bf16", tag="t")
    keys = torch.load(tmp_path / "some.pt", weights_only=True).keys()
    assert set(keys) == set(DropoutMLP().state_dict()) - frozen

    trainable, _ = make(config)  # layers.0 trains here: nothing in the checkpoint to load
    with pytest.raises(CheckpointError, match="exclude_frozen_parameters=True .* 'layers.0"):
        trainable.load_checkpoint(tmp_path / "some", "t", allow_reshard=True)


def test_global_samples_count_on_from_the_checkpoint_across_batch_sizes(tmp_path):
    # Note [Samples counted across batch sizes]: DeepSpeed saves global_samples; ours was
    # global_steps times the current batch size, which rewrote the past at a resume with
    # another train_batch_size.
    model, _ = make(base_config("fp32", train_batch_size=16, train_micro_batch_size_per_gpu=16))
    for x, y in batches(2):
        model.backward(model(x, y))
        model.step()
    assert model.global_samples == 32
    model.save_checkpoint(tmp_path)
    bigger, _ = make(base_config("fp32", train_batch_size=32, train_micro_batch_size_per_gpu=16))
    bigger.load_checkpoint(tmp_path, allow_reshard=True)
    assert bigger.global_steps == 2 and bigger.global_samples == 32
    for x, y in batches(2):
        bigger.backward(bigger(x, y))
        bigger.step()
    assert bigger.global_steps == 3 and bigger.global_samples == 64
