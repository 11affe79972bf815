"""Upstream PatrickStar scripts run unchanged (issue 20, item 4): its import paths, config keys
and attributes work, or fail with a message that says what to use instead."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import patrickstar
from patrickstar import _C, _upstream

SCRIPTS = os.path.join(os.path.dirname(__file__), "upstream_scripts")


def test_upstream_style_training_script_runs_unchanged(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "train_simple_net.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    losses = [float(value) for value in lines["losses"].split()]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4])  # it trains
    assert float(lines["loss_scale"]) == 2.0**8  # initial_scale_power 8, no overflow
    # Embedding (tied with the head) + two linears: the counts of the plain module.
    assert lines["model_size"] == f"{32 * 16 + 2 * (16 * 16 + 16)} 5"
    # Every key accepted without effect is named, in one warning.
    warned = [line for line in result.stderr.splitlines() if "have no effect" in line]
    assert len(warned) == 1
    for key in ("use_fake_dist", "client.mem_tracer.use_async_mem_monitor",
                "client.mem_tracer.with_static_partition", "client.opts.with_mem_cache"):
        assert key in warned[0]
    assert (tmp_path / "model.pt").exists() and (tmp_path / "optimizer.pt").exists()


def test_runtime_and_utils_are_the_package_objects():
    from patrickstar.runtime import PatrickStarEngine, initialize_engine
    from patrickstar.utils import get_rank, get_world_size, log_dist, logger
    assert initialize_engine is patrickstar.initialize_engine
    assert PatrickStarEngine is patrickstar.PatrickStarEngine
    assert (get_rank(), get_world_size()) == (0, 1)
    assert isinstance(logger, logging.Logger) and log_dist is not None


def test_logger_level_sets_the_runtime_level(capfd):
    from patrickstar.utils import logger
    before = logger.level
    try:
        logger.setLevel(logging.ERROR)
        # A C++ warning (a tier destroyed with a block still allocated) is now quiet...
        tier = _C.HostTier(budget=0, name="quiet")
        tier.allocate(4096)
        del tier
        assert "destroyed with" not in capfd.readouterr().err
        logger.setLevel(logging.WARNING)  # ...and back
        tier = _C.HostTier(budget=0, name="loud")
        tier.allocate(4096)
        del tier
        assert "destroyed with" in capfd.readouterr().err
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("name", sorted(_upstream.UPSTREAM_ONLY))
def test_upstream_only_modules_say_what_to_use_instead(name):
    with pytest.raises(ModuleNotFoundError, match="upstream PatrickStar's") as error:
        __import__(name)
    assert _upstream.UPSTREAM_ONLY[name] in str(error.value)
    # Submodules too, and real modules are untouched.
    with pytest.raises(ModuleNotFoundError, match="what|use|PatrickStar"):
        __import__(name + ".anything")
    import patrickstar.utils.logging  # noqa: F401


def test_optimizer_loss_scaler_has_upstream_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(
            lambda: torch.nn.Linear(4, 4),
            config={"default_chunk_size": 1024,
                    "fp16": {"enabled": True, "initial_scale_power": 5}})
    assert opt.loss_scaler.loss_scale == opt.loss_scaler.cur_scale == opt.loss_scale == 32.0
    model.destroy()


def test_upstream_config_spellings():
    with pytest.warns(UserWarning, match="use_fake_dist") as caught:
        config = patrickstar.load_config({"use_fake_dist": True, "chunk_size": 4096,
                                          "optimizer": {"params": {"LR": 0.5, "Eps": 1e-5}}})
    assert len(caught) == 1
    assert config.default_chunk_size == 4096  # the GUIDE's name for default_chunk_size
    assert (config.optimizer.lr, config.optimizer.eps) == (0.5, 1e-5)
    with pytest.raises(ValueError, match="'chunk_size' and 'default_chunk_size'.*1 and 2"):
        patrickstar.load_config({"chunk_size": 1, "default_chunk_size": 2})
    with pytest.raises(ValueError, match="'optimizer.params.lr': given twice"):
        patrickstar.load_config({"optimizer": {"params": {"lr": 1, "LR": 2}}})
    with pytest.raises(ValueError, match="use_fake_dist.*expected true or false"):
        patrickstar.load_config({"use_fake_dist": "yes"})


def test_upstream_v040_readme_config_with_mem_sampler_loads():
    """Upstream v0.4.0's README names the client section `mem_sampler` (later `mem_tracer`):
    it was refused as an unknown key, so the README's own snippet did not run."""
    with pytest.warns(UserWarning, match="client.mem_sampler.use_async_mem_monitor"):
        config = patrickstar.load_config({
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": (0.9, 0.999),
                                                     "eps": 1e-6, "weight_decay": 0,
                                                     "use_hybrid_adam": True}},
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 2 ** 3,
                     "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
            "default_chunk_size": 64 * 1024 * 1024, "release_after_init": True,
            "use_cpu_embedding": False,
            "client": {"mem_sampler": {"use_async_mem_monitor": True}}})
    assert config.precision == "fp16" and config.fp16.initial_scale_power == 8
    with pytest.raises(ValueError, match="'client.mem_sampler.bogus'"):
        patrickstar.load_config({"client": {"mem_sampler": {"bogus": 1}}})


@pytest.mark.parametrize("key,instead", [
    ("zero_optimization", "memory.host_budget"), ("seed", "torch.manual_seed"),
    ("aio", "memory.nvme"), ("amp", "bf16")])
def test_deepspeed_keys_say_what_to_use_instead(key, instead):
    with pytest.raises(ValueError, match=f"'{key}' \\(DeepSpeed's\\).*{instead}"):
        patrickstar.load_config({key: {}})


def test_upstream_arguments_and_names_without_counterpart_say_what_to_use():
    from patrickstar.runtime import initialize_engine
    with pytest.raises(TypeError, match="PatrickStarClient does not exist.*drop the argument"):
        initialize_engine(lambda: torch.nn.Linear(2, 2), 0, None, client=object())
    import patrickstar.profiler as module
    assert not hasattr(module, "no_such_name")  # other names stay plain AttributeErrors


def _deepspeed_model(accumulation):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(
            lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 2)),
            config={"default_chunk_size": 1024, "gradient_accumulation_steps": accumulation,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})


def test_deepspeed_engine_step_at_the_accumulation_boundary_matches_optimizer_step():
    """DeepSpeed's loop (backward and model.step() every micro-step) trains as PatrickStar's
    (optimizer.step() after every gradient_accumulation_steps backward calls)."""
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(6)]
    ds_model, ds_optimizer = _deepspeed_model(3)
    ps_model, ps_optimizer = _deepspeed_model(3)
    assert ds_model.gradient_accumulation_steps() == 3 and ds_model.get_lr() == [1e-2]
    for micro, (x, y) in enumerate(batches):
        ds_model.backward(torch.nn.functional.mse_loss(ds_model(x), y))
        ds_model.step()
        ps_model.backward(torch.nn.functional.mse_loss(ps_model(x), y))
        if micro % 3 == 2:
            ps_optimizer.step()
            ps_optimizer.zero_grad()
        assert ds_model.global_steps == (micro + 1) // 3
    for (name, a), b in zip(ds_model.state_dict().items(), ps_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert ds_model.global_steps == 2
    # One loop, not both: the second step of one accumulation finds no gradients.
    ds_model.backward(torch.nn.functional.mse_loss(ds_model(batches[0][0]), batches[0][1]))
    ds_model.backward(torch.nn.functional.mse_loss(ds_model(batches[1][0]), batches[1][1]))
    ds_model.backward(torch.nn.functional.mse_loss(ds_model(batches[2][0]), batches[2][1]))
    ds_optimizer.step()
    ds_model.step()  # micro-steps, as DeepSpeed's (Note [model.step() without a backward])
    ds_model.step()
    with pytest.raises(RuntimeError, match="model.step\\(\\) at an accumulation boundary\\) "
                                           "with no backward and no optimizer.zero_grad"):
        ds_model.step()
    ds_model.destroy()
    ps_model.destroy()


@pytest.mark.parametrize("name", ["getsizeof", "get_memory_info", "SingletonMeta"])
def test_upstream_utils_names_without_counterpart_say_what_to_use(name):
    with pytest.raises(ImportError, match=f"'patrickstar.utils.{name}' is upstream"):
        exec(f"from patrickstar.utils import {name}")
    import patrickstar.utils
    assert not hasattr(patrickstar.utils, "no_such_name")


def test_upstream_pretrain_demo_timers_and_profiler_work(tmp_path, caplog):
    """Upstream's examples/pretrain_demo.py: `import patrickstar.utils.global_timer as
    global_timer` and `from patrickstar.profiler import profiler`, started before the engine is
    built, printed and saved after the steps."""
    import patrickstar.utils.global_timer as global_timer
    from patrickstar.profiler import profiler
    from patrickstar.runtime import initialize_engine
    from patrickstar.utils import logger

    profiler.start()
    model, optimizer = initialize_engine(
        model_func=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)),
        local_rank=0, config={"default_chunk_size": 4096,
                              "memory": {"device_budget": 3 * 4096 * 4}})
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        for step in range(3):
            if step == 1:
                profiler.warmup_finish()
            if step == 2:
                global_timer.my_timer.start()
            optimizer.zero_grad()
            global_timer.my_timer.start_profile("FWD")
            loss = model(torch.randn(8, 64)).pow(2).mean()
            global_timer.my_timer.finish_profile("FWD")
            model.backward(loss)
            optimizer.step()
        with caplog.at_level(logging.INFO, logger="patrickstar"):
            global_timer.my_timer.print()
            global_timer.data_move_cnter.print()
    finally:
        logger.setLevel(before)
    profiler.end()
    directory = profiler.save(str(tmp_path / "torch_bert_profile.pkl"))
    assert directory == str(tmp_path / "torch_bert_profile")
    assert (tmp_path / "torch_bert_profile.pkl").is_file()  # upstream's pickle, at its path
    for name in ("trace.json", "summary.json", "memory.csv", "report.html"):
        assert (tmp_path / "torch_bert_profile" / name).exists(), name
    assert "span since my_timer.start()" in caplog.text and "FWD, " in caplog.text
    stats = model.memory_stats()
    device = next(tier for tier in stats if tier["kind"] == "device")
    assert device["bytes_in"] > 0  # the tight budget moved chunks, and the counter says so
    assert f"tier {device['name']}: " in caplog.text
    global_timer.data_move_cnter.reset()
    assert f"tier {device['name']}: 0.000 MB in, 0.000 MB out" in \
        "\n".join(global_timer.data_move_cnter.lines())
    with pytest.raises(RuntimeError, match="'FWD' was not started"):
        global_timer.my_timer.finish_profile("FWD")
    model.destroy()


def test_upstream_profiler_records_the_engine_built_after_start_not_an_older_one(tmp_path):
    """start() picks an engine already alive only until one is built: an older engine still
    alive (an earlier model of the script) was recorded instead of the script's, and once the
    collector destroyed it, save() failed with a TypeError."""
    import json

    from patrickstar.profiler import profiler
    from patrickstar.runtime import initialize_engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        older, _ = initialize_engine(model_func=lambda: torch.nn.Linear(8, 8), local_rank=0,
                                     config={"default_chunk_size": 1024})
        profiler.start()
        model, optimizer = initialize_engine(
            model_func=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64),
                                                   torch.nn.Linear(64, 4)),
            local_rank=0, config={"default_chunk_size": 4096})
    older.destroy()
    del older
    for _ in range(2):
        model.backward(model(torch.randn(8, 64)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    profiler.end()
    directory = profiler.save(str(tmp_path / "profile.pkl"))
    with open(f"{directory}/profile.json") as handle:
        layout = json.load(handle)["layout"]
    assert layout["chunk_elements"] == 4096
    model.destroy()


# ---- Upstream's profile pickle (profiling/upstream_format.py) --------------------------------

UPSTREAM_PROFILE_KEYS = {"start_time", "end_time", "warmup_finish_time", "gpu_memory_used",
                         "gpu_chunk_memory_used", "cpu_memory_used", "cpu_chunk_memory_used",
                         "stage_convert_time", "chunk_life_cycle"}


def _plot_memory(state, memory_type, rm_warmup):
    """What upstream's tools/profile_visualizer.py does with a memory figure, written again
    here: it reads the pickled dict only by these keys, stage `.value`s in 1..3 and
    `device.type`, and fails on anything else."""
    import matplotlib.pyplot as plt
    prefix = {"GPU": "gpu", "CPU": "cpu"}[memory_type]
    used = state[f"{prefix}_memory_used"]
    chunk = state[f"{prefix}_chunk_memory_used"]
    origin = state["warmup_finish_time"] if rm_warmup else used[0][1]
    times = [entry[1] - origin for entry in used]
    total_mb = [entry[2] / 2**20 for entry in used]
    chunk_mb = [entry[2] / 2**20 for entry in chunk]
    non_model = [(t, a - b) for t, a, b in zip(times, total_mb, chunk_mb) if t >= 0]
    colours = {1: "g", 2: "tab:blue", 3: "tab:purple"}
    stages = [(t - origin, stage.value) for t, stage in state["stage_convert_time"]]
    figure = plt.figure()
    for (begin, value), (finish, _) in zip(stages, stages[1:]):
        plt.axvspan(begin, finish, facecolor=colours[value], alpha=0.3)
    plt.axvspan(stages[-1][0], times[-1], facecolor="tab:purple", alpha=0.2)
    plt.plot(times, total_mb, label="total")
    plt.plot(times, chunk_mb, label="chunk")
    plt.plot([t for t, _ in non_model], [m for _, m in non_model], label="non-model")
    plt.legend()
    return figure


def _plot_access(state):
    """Upstream's chunk-location figure, as above: one row per chunk with accesses."""
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt
    cycles = state["chunk_life_cycle"]
    origin = min(c["life_cycle"][0][0] for c in cycles.values() if c["life_cycle"])
    rows = {}
    for cycle in cycles.values():
        if cycle["life_cycle"]:
            rows.setdefault(cycle["type"], []).append(
                [(entry[0] - origin, entry[2]) for entry in cycle["life_cycle"]])
    figure, axis = plt.subplots()
    end = state["end_time"] - origin
    row = 0
    for lives in rows.values():
        for life in lives:
            row += 1
            for (at, device), (following, _) in zip(life, life[1:] + [(end, None)]):
                colour = "#fff" if device is None else (
                    "#e9616c" if device.type == "cpu" else "#3385fe")
                axis.add_patch(patches.Rectangle((at, row), following - at, 1, color=colour,
                                                 alpha=0 if device is None else 1))
    axis.set_xlim([0, end])
    axis.set_ylim([0, row + 1])
    return figure


def _csv_rows(path):
    import csv
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_upstream_profiler_save_writes_upstreams_pickle(tmp_path):
    """Upstream's tools/profile_visualizer.py does pickle.load(open(path, "rb")); save() wrote
    only a directory, so it failed with FileNotFoundError. The pickle holds upstream's keys,
    built from the same record as memory.csv (Note [Upstream profile mapping])."""
    import json
    import pickle

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from patrickstar.profiler import TrainingStage, profiler
    from patrickstar.runtime import initialize_engine

    steps = 3
    profiler.start()
    model, optimizer = initialize_engine(
        model_func=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)),
        local_rank=0, config={"default_chunk_size": 4096,
                              "memory": {"device_budget": 3 * 4096 * 4}})
    warmup_called = None
    for step in range(steps):
        if step == 1:
            profiler.warmup_finish()
            warmup_called = profiler.state_dict()["warmup_finish_time"]
        optimizer.zero_grad()
        model.backward(model(torch.randn(8, 64)).pow(2).mean())
        optimizer.step()
    running = profiler.state_dict()  # before end(): the recording so far, as upstream's
    assert set(running) == UPSTREAM_PROFILE_KEYS and running["gpu_memory_used"]
    profiler.end()
    path = tmp_path / "new" / "dir" / "x.pkl"  # save() creates the directories
    directory = profiler.save(str(path))
    assert profiler.pickle_path == str(path)
    with open(path, "rb") as handle:
        state = pickle.load(handle)
    assert set(state) == UPSTREAM_PROFILE_KEYS
    assert state == profiler.state_dict()

    start, end = state["start_time"], state["end_time"]
    assert start < end and start < state["warmup_finish_time"] < end
    assert state["warmup_finish_time"] == warmup_called
    for key in ("gpu_memory_used", "gpu_chunk_memory_used", "cpu_memory_used",
                "cpu_chunk_memory_used"):
        times = [entry[1] for entry in state[key]]
        assert times == sorted(times) and start <= times[0] and times[-1] <= end, key
    stage_times = [t for t, _ in state["stage_convert_time"]]
    assert stage_times == sorted(stage_times) and start <= stage_times[0] < end

    # Memory: memory.csv's per-tier figures, moment for moment.
    rows = _csv_rows(os.path.join(directory, "memory.csv"))
    for prefix, kind in (("gpu", "device"), ("cpu", "host")):
        used, chunk = state[f"{prefix}_memory_used"], state[f"{prefix}_chunk_memory_used"]
        assert len(used) == len(chunk) == len(rows)
        for row, (moment, at, total), (_, at_chunk, chunk_bytes) in zip(rows, used, chunk):
            assert moment == int(row["moment"]) and at == at_chunk
            assert chunk_bytes == int(row[f"{kind}_model_bytes"])
            assert total == chunk_bytes + int(row[f"{kind}_non_model_bytes"])
            assert abs((at - start) * 1e3 - float(row["time_ms"])) < 1e-3
    assert max(entry[2] for entry in state["gpu_chunk_memory_used"]) > 0

    # Stages: FWD, BWD, ADAM per iteration, as upstream's enum values.
    stages = [stage for _, stage in state["stage_convert_time"]]
    assert all(isinstance(stage, TrainingStage) for stage in stages)
    assert [stage.value for stage in stages] == [1, 2, 3] * steps
    # warmup_finish() was called between the first iteration's optimizer step and the second
    # iteration's forward.
    assert stage_times[2] < state["warmup_finish_time"] < stage_times[3]

    # Chunks: the engine's, with their kinds; devices cpu, cuda:0 or None.
    layout = json.loads(model.chunks.manager.dump_json(0))["layout"]["chunks"]
    assert {c["id"]: c["kind"] for c in layout} == \
        {cid: cycle["type"] for cid, cycle in state["chunk_life_cycle"].items()}
    devices = set()
    for cycle in state["chunk_life_cycle"].values():
        times = [entry[0] for entry in cycle["life_cycle"]]
        assert times == sorted(times) and all(start <= t <= end for t in times)
        assert {entry[1] for entry in cycle["life_cycle"]} <= {"allocate", "move", "release"}
        devices |= {entry[2] for entry in cycle["life_cycle"]}
    assert devices == {torch.device("cpu"), torch.device("cuda", 0), None}  # moved, dropped

    # Upstream's visualizer, rewritten above, runs on it (its default is rm_warmup=True).
    for memory_type in ("GPU", "CPU"):
        for rm_warmup in (True, False):
            figure = _plot_memory(state, memory_type, rm_warmup)
            figure.savefig(tmp_path / f"{memory_type}-{rm_warmup}.png")
            plt.close(figure)
    figure = _plot_access(state)
    figure.savefig(tmp_path / "access.png")
    plt.close(figure)
    assert len(list(tmp_path.glob("*.png"))) == 5

    # A process of its own (as the visualizer is) loads it by plain pickle.
    code = ("import pickle, sys; state = pickle.load(open(sys.argv[1], 'rb')); "
            "print(state['stage_convert_time'][0][1].value)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
    model.destroy()


def test_upstream_profiler_pickle_without_warmup_call_or_extension(tmp_path):
    """Without warmup_finish() the warm-up is the first iteration, as in the other outputs
    (upstream left None, which its visualizer's default rm_warmup=True cannot plot); a path
    without an extension is the pickle, and the directory gets '_profile'."""
    import pickle

    from patrickstar.profiler import profiler
    from patrickstar.runtime import initialize_engine

    profiler.start()
    model, optimizer = initialize_engine(model_func=lambda: torch.nn.Linear(16, 4),
                                         local_rank=0, config={"default_chunk_size": 1024})
    for _ in range(2):
        model.backward(model(torch.randn(2, 16)).sum())
        optimizer.step()
        optimizer.zero_grad()
    profiler.end()
    directory = profiler.save(tmp_path / "noext")
    assert directory == str(tmp_path / "noext_profile")
    assert (tmp_path / "noext_profile" / "memory.csv").is_file()
    with open(tmp_path / "noext", "rb") as handle:
        state = pickle.load(handle)
    times = [t for t, _ in state["stage_convert_time"]]
    assert [stage.value for _, stage in state["stage_convert_time"]] == [1, 2, 3, 1, 2, 3]
    assert times[2] < state["warmup_finish_time"] < times[3]  # the first iteration's end
    model.destroy()


def test_upstream_profiler_save_errors_name_what_to_do(tmp_path):
    from patrickstar.profiling.analysis import ProfileError
    from patrickstar.profiling.upstream import UpstreamProfiler
    from patrickstar.runtime import initialize_engine

    fresh = UpstreamProfiler()
    with pytest.raises(RuntimeError, match=r"profiler.save\(\): nothing was recorded; call "
                                           r"profiler.start\(\)"):
        fresh.save(str(tmp_path / "x.pkl"))
    with pytest.raises(RuntimeError, match=r"profiler.state_dict\(\): nothing was recorded"):
        fresh.state_dict()
    assert not list(tmp_path.iterdir())

    fresh.start()
    model, optimizer = initialize_engine(model_func=lambda: torch.nn.Linear(16, 4),
                                         local_rank=0, config={"default_chunk_size": 1024})
    fresh.engine_built(model)  # (what patrickstar.initialize() tells the global profiler)
    model.backward(model(torch.randn(2, 16)).sum())
    optimizer.step()
    fresh.end()
    (tmp_path / "taken.pkl").mkdir()  # the pickle's path is a directory
    with pytest.raises(ProfileError, match="cannot write the profile pickle '.*taken.pkl'"):
        fresh.save(str(tmp_path / "taken.pkl"))
    (tmp_path / "file").write_text("")  # a file where a directory would be
    with pytest.raises(ProfileError, match="'.*file/x'"):
        fresh.save(str(tmp_path / "file" / "x.pkl"))
    model.destroy()


def test_upstream_profiler_saves_an_engine_destroyed_before_end(tmp_path):
    """A script that destroys (or `del`s) its model before profiler.end() and save() was told
    "the recorded engine was destroyed before profiler.end(); call end() while the model is
    alive", though destroy() stops the recorder with its record complete: save() now writes
    that record, which ends where the engine was destroyed."""
    import json
    import pickle

    from patrickstar.profiling.upstream import UpstreamProfiler
    from patrickstar.runtime import initialize_engine

    fresh = UpstreamProfiler()
    fresh.start()
    model, optimizer = initialize_engine(
        model_func=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)),
        local_rank=0, config={"default_chunk_size": 4096,
                              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                              "memory": {"device_budget": 3 * 4096 * 4}})
    fresh.engine_built(model)  # (what patrickstar.initialize() tells the global profiler)
    for _ in range(2):
        model.backward(model(torch.randn(8, 64)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    at_destroy = {t["name"]: t["bytes_in"] for t in model.memory_stats()}
    model.destroy()
    fresh.end()
    directory = fresh.save(str(tmp_path / "x.pkl"))
    with open(tmp_path / "x.pkl", "rb") as handle:
        assert pickle.load(handle) == fresh.state_dict()
    summary = json.loads((tmp_path / "x" / "summary.json").read_text())
    assert directory == str(tmp_path / "x") and summary["run"]["iterations"] == 2
    assert {name: t["bytes_in"] for name, t in summary["tiers"].items()} == at_destroy
    assert sum(at_destroy.values()) == summary["moves"]["bytes"] > 0

def test_upstream_pickle_path_per_rank():
    """Note [One upstream pickle per rank]: rank 0 writes the path upstream's scripts hand to
    the visualizer, rank k > 0 a name of its own beside it."""
    from patrickstar.profiling.upstream import rank_pickle_path
    assert rank_pickle_path("out/p.pkl", {"world_size": 1, "rank": 0}) == "out/p.pkl"
    assert rank_pickle_path("out/p.pkl", {"world_size": 2, "rank": 0}) == "out/p.pkl"
    assert rank_pickle_path("out/p.pkl", {"world_size": 2, "rank": 1}) == "out/p.rank1.pkl"
    assert rank_pickle_path("out/p", {"world_size": 4, "rank": 3}) == "out/p.rank3"


_UPSTREAM_RANK_SCRIPT = """
import sys, torch, patrickstar
from patrickstar.profiler import profiler
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
gpt = GPTConfig(vocab_size=64, max_seq_len=8, hidden=32, layers=1, heads=2)
torch.manual_seed(0)
profiler.start()
model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={"default_chunk_size": 4096})
for ids, targets in synthetic_batches(gpt, 2, 2):
    model.backward(model(ids, targets))
    optimizer.step()
    optimizer.zero_grad()
profiler.end()
profiler.save(sys.argv[1] + "/profile.pkl")
model.destroy()
"""


def test_upstream_profiler_data_parallel_ranks_keep_their_own_pickles(tmp_path):
    import pickle

    from test_data_parallel import finish, free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", _UPSTREAM_RANK_SCRIPT, str(tmp_path)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    codes = finish(procs)
    assert codes == [0, 0], [proc.stderr.read()[-2000:] for proc in procs]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == \
        ["profile.pkl", "profile.rank1.pkl"]
    for rank, name in enumerate(("profile.pkl", "profile.rank1.pkl")):
        with open(tmp_path / name, "rb") as handle:
            state = pickle.load(handle)
        assert [stage.value for _, stage in state["stage_convert_time"]] == [1, 2, 3] * 2
        assert (tmp_path / "profile" / f"rank{rank}" / "memory.csv").is_file()


def test_hugging_face_parameter_rebuilds_name_what_to_do_instead():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2,
                                     n_positions=16)
    opts = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 20000}
    model, _ = patrickstar.initialize(lambda: transformers.GPT2LMHeadModel(config), config=opts)
    with pytest.raises(ValueError, match=r"config.vocab_size = n"):
        model.resize_token_embeddings(120)
    with pytest.raises(ValueError, match="call it inside model_func"):
        model.post_init()
    # The module's own methods that change nothing still pass through.
    assert model.get_input_embeddings() is model.module.transformer.wte


@pytest.mark.parametrize("module,name,instead", [
    ("patrickstar.checkpoint", "checkpoint", "torch.utils.checkpoint.checkpoint"),
    ("patrickstar.checkpoint", "checkpoint_sequential", "torch.utils.checkpoint"),
    ("patrickstar.profiler", "torch_profiler", "torch.profiler"),
    ("patrickstar.utils.model_size_calculator", "estimate_bert_MAC", "get_ps_model_size")])
def test_upstream_names_in_packages_named_alike_say_what_to_use(module, name, instead):
    """Upstream's patrickstar.checkpoint was activation checkpointing (a copy of
    torch.utils.checkpoint), here it is checkpoint files: `from patrickstar.checkpoint import
    checkpoint` failed with a bare "cannot import name"; so did upstream's torch_profiler and
    estimate_bert_MAC."""
    with pytest.raises(ImportError, match=f"'{module}.{name}' is upstream") as error:
        exec(f"from {module} import {name}")
    assert instead in str(error.value)
    assert not hasattr(__import__(module, fromlist=["x"]), "no_such_name")
    with pytest.raises(ModuleNotFoundError, match="torch.utils.checkpoint"):
        import patrickstar.checkpoint.torch_checkpoint  # noqa: F401


def test_upstream_profiler_started_is_a_method(tmp_path):
    """Upstream's `profiler.started()` (what its hooks and engine ask before recording) is a
    method; here it was a bool attribute, so `profiler.started()` raised "'bool' object is not
    callable"."""
    from patrickstar.profiler import profiler
    assert profiler.started() is False
    profiler.start()
    model, optimizer = patrickstar.initialize(lambda: torch.nn.Linear(4, 4),
                                              config={"default_chunk_size": 1024})
    assert profiler.started() is True
    model.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    profiler.end()
    assert profiler.started() is False
    profiler.save(str(tmp_path / "p.pkl"))
    model.destroy()


def test_upstream_profiler_submodule_path_is_the_same_recorder():
    """Upstream's patrickstar/profiler/ was a package: `from patrickstar.profiler.profiler import
    profiler` failed here with "'patrickstar.profiler' is not a package". Either path gives the
    one recorder, in either order (a submodule import must not rebind the package's name)."""
    import sys
    from patrickstar.profiler.profiler import profiler as by_submodule
    import patrickstar.profiler.profiler  # noqa: F401
    from patrickstar.profiler import profiler
    assert by_submodule is profiler
    assert sys.modules["patrickstar.profiler.profiler"].profiler is profiler
    assert patrickstar.profiler.profiler is profiler and hasattr(profiler, "started")


def test_partial_state_dict_load_says_strict_false_loads_the_rest():
    """Upstream's engine.load_state_dict defaulted to strict=False (missing keys only logged);
    here torch's strict=True refuses, and the error says how to load the keys given, which then
    load as torch's load_state_dict(strict=False) loads them."""
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(lambda: torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), config={"default_chunk_size": 1024})
    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    partial = {k: v for k, v in reference.state_dict().items() if k.startswith("0.")}
    before = model.state_dict()
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.weight", '
                                           r'"1.bias"') as error:
        model.load_state_dict(partial)
    assert "strict=False" in " ".join(error.value.__notes__)  # shown under the traceback
    result = model.load_state_dict(partial, strict=False)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    expected.load_state_dict(before)
    assert result == expected.load_state_dict(partial, strict=False)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model.destroy()


def test_initialize_engine_without_lr_names_upstreams_default():
    """Upstream's engine filled a missing optimizer lr with 0.01; here it is torch's and
    DeepSpeed's 1e-3, so an upstream script relying on the default trained 10x slower without
    a word. initialize_engine (upstream's entry point) now says so."""
    from patrickstar.runtime import initialize_engine
    for config in (None, {"default_chunk_size": 1024},
                   {"optimizer": {"type": "Adam", "params": {"eps": 1e-6}}}):
        with pytest.warns(UserWarning, match=r"optimizer.params.lr.*1e-3.*0\.01"):
            model, optimizer = initialize_engine(lambda: torch.nn.Linear(4, 4), 0, config)
        assert optimizer.param_groups[0]["lr"] == 1e-3
        model.destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = initialize_engine(lambda: torch.nn.Linear(4, 4), 0,
                                     {"optimizer": {"params": {"LR": 0.5}}})
    model.destroy()


def test_upstream_torch_scope_says_what_to_do():
    """Upstream's MoE example wraps its experts in `with torch_scope(do_allreduce=False):`
    (parameters kept out of chunks); the message named only PatrickStarClient."""
    with pytest.raises(ModuleNotFoundError, match="torch_scope.*every parameter"):
        exec("from patrickstar.core import torch_scope")


def test_see_memory_usage_takes_upstreams_scale_name(caplog):
    """Upstream's see_memory_usage(message, force=False, scale_name="MB"): the keyword raised
    TypeError here."""
    from patrickstar.utils import see_memory_usage
    with caplog.at_level(logging.INFO, logger="patrickstar"):
        see_memory_usage("in MB", force=True, scale_name="MB")
        see_memory_usage("in bytes", force=True, scale_name="B")
        see_memory_usage("not forced", scale_name="MB")
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("in MB | RSS ") and line.endswith(" MB") for line in lines)
    assert any(line.startswith("in bytes | RSS ") and line.endswith(" B") for line in lines)
    assert not any("not forced" in line for line in lines)
    with pytest.raises(ValueError, match="scale_name.*'GiB'.*'MB'"):
        see_memory_usage("x", force=True, scale_name="GiB")


def test_estimate_bert_mac_is_upstreams_two_estimates():
    """Upstream's examples/pretrain_bert_demo.py imports estimate_bert_mac from
    patrickstar.utils.model_size_calculator next to get_ps_model_size: the import failed, so
    the script stopped before training. It returns (numel * B * S * 8, Megatron-LM's
    96 * B * S * L * H**2 * (1 + S / 6H + V / 16LH))."""
    transformers = pytest.importorskip("transformers")
    from patrickstar.utils.model_size_calculator import estimate_bert_mac, get_ps_model_size
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, vocab_size=100,
                                     max_position_embeddings=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(
            lambda: transformers.BertForSequenceClassification(config),
            config={"default_chunk_size": 20000,
                    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    numel = sum(p.numel() for p in transformers.BertForSequenceClassification(config).parameters())
    assert get_ps_model_size(model)[0] == numel
    from_size, from_shapes = estimate_bert_mac(config, 4, 16, get_ps_model_size(model)[0])
    assert from_size == numel * 4 * 16 * 8
    assert from_shapes == pytest.approx(96 * 4 * 16 * 2 * 32 ** 2 * (1 + 16 / 192 + 100 / 1024))
    model.destroy()


def _accumulating_model():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(
            lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
            config={"default_chunk_size": 1024, "gradient_accumulation_steps": 2,
                    # eps 1: Adam's step follows the gradient's scale, so a division shows.
                    "optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1.0}}})


def test_backward_takes_upstreams_and_deepspeeds_arguments():
    """Upstream's engine.backward(loss, allreduce_gradients=True, release_loss=False) and
    DeepSpeed's (..., retain_graph=False, scale_wrt_gas=True): `model.backward(loss,
    allreduce_gradients=True)` raised TypeError, and a positional `model.backward(loss, True)`
    meant retain_graph. scale_wrt_gas=False leaves the division by gradient_accumulation_steps
    to the script, as DeepSpeed's."""
    batches = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(2)]
    undivided, undivided_opt = _accumulating_model()
    divided, divided_opt = _accumulating_model()
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(undivided(x), y)
        undivided.backward(loss, True, False, scale_wrt_gas=False)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            torch.autograd.backward(loss)  # the positional True was not retain_graph
        divided.backward(torch.nn.functional.mse_loss(divided(x), y), allreduce_gradients=True,
                         release_loss=True)
    # The same step as torch's Adam over the summed (undivided), not the averaged, losses.
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    reference.load_state_dict(divided.state_dict())
    plain = torch.optim.Adam(reference.parameters(), lr=0.1, eps=1.0)
    sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in batches).backward()
    plain.step()
    undivided_opt.step()
    for (name, a), b in zip(undivided.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    divided_opt.step()
    assert not torch.equal(divided.state_dict()["1.weight"], reference.state_dict()["1.weight"])
    with pytest.warns(UserWarning, match="allreduce_gradients=False\\) is ignored"):
        divided.backward(torch.nn.functional.mse_loss(divided(batches[0][0]), batches[0][1]),
                         allreduce_gradients=False)
    undivided.destroy()
    divided.destroy()
