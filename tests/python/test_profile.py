"""Memory profiles (profiling/): a short training run under a tight device budget
writes trace.json / memory.csv / summary.json / report.html; the trace follows the Chrome trace
event format; the CSV and summary agree with the manager's own tier statistics; profiling does
not change training; the CLI prints, regenerates and compares; report.html renders in headless
Chromium without console errors."""
from __future__ import annotations

import csv
import gc
import html
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata

import pytest
import torch

import patrickstar
from patrickstar import report
from patrickstar.report import ProfileError
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
from patrickstar.profiler import active_profiler, now_ns
from patrickstar.profiling.analysis import mib as report_mib
from patrickstar.profiling.outputs import write_text

GPT_CONFIG = GPTConfig(vocab_size=256, max_seq_len=16, hidden=64, layers=2, heads=2)
CHUNK = 1 << 13
OUTPUTS = ("trace.json", "memory.csv", "summary.json", "report.html")


def _config(**extra):
    params = GPT_CONFIG.parameter_count()
    # Half of the compute params and grads: chunks must move during forward and backward.
    config = {"default_chunk_size": CHUNK, "memory": {"device_budget": params * 4}}
    config.update(extra)
    return config


def _train(model, optimizer, steps, batch=2):
    losses = []
    for ids, targets in synthetic_batches(GPT_CONFIG, batch, steps):
        loss = model(ids, targets)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _model(config=None):
    torch.manual_seed(0)
    return patrickstar.initialize(lambda: GPT(GPT_CONFIG), config=config or _config())


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profiled run shared by the read-only checks: (directory, stats before, stats after,
    losses)."""
    directory = tmp_path_factory.mktemp("profile")
    model, optimizer = _model()
    _train(model, optimizer, 1)  # warm-up outside the profile: it starts mid-run
    before = model.memory_stats()
    with patrickstar.profile(model, directory) as profiler:
        assert active_profiler() is profiler
        losses = _train(model, optimizer, 3)
    after = model.memory_stats()
    assert active_profiler() is None and model.profiler is None
    return directory, before, after, losses


def test_profile_writes_all_outputs(profiled):
    directory = profiled[0]
    for name in OUTPUTS + (report.RAW_FILE,):
        path = directory / name
        assert path.is_file() and path.stat().st_size > 0, name


def test_trace_follows_the_trace_event_format(profiled):
    trace = json.loads((profiled[0] / "trace.json").read_text())
    events = trace["traceEvents"]
    assert events
    named_threads = {}
    last_ts = {}
    for event in events:
        for field in ("ph", "ts", "pid", "tid", "name"):
            assert field in event, (field, event)
        assert event["ph"] in {"X", "i", "C", "M"}, event
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
        if event["ph"] == "M":
            if event["name"] == "thread_name":
                named_threads[(event["pid"], event["tid"])] = event["args"]["name"]
            continue
        track = (event["pid"], event["tid"])
        assert event["ts"] >= last_ts.get(track, 0), f"ts goes back on track {track}"
        last_ts[track] = event["ts"]
    # Every track used has a name; compute, waits, copies, evictions and memory are separate.
    assert set(last_ts) <= set(named_threads)
    names = set(named_threads.values())
    assert "compute" in names and "evictions" in names and "memory" in names
    device = profiled[2][0]["name"]  # "device", or "cuda:0" with a GPU or the strict device
    assert any(name.startswith(f"copy host->{device}") for name in names)
    assert any(name.startswith(f"copy {device}->host") for name in names)
    # Slices on one track nest or follow each other, never overlap partially (Perfetto).
    by_track = {}
    for event in events:
        if event["ph"] == "X":
            by_track.setdefault((event["pid"], event["tid"]), []).append(
                (event["ts"], event["ts"] + event["dur"]))
    for track, slices in by_track.items():
        stack = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, f"overlapping slices on {track}"
            stack.append(end)
    iterations = [e for e in events if e["ph"] == "X" and e["name"].startswith("iteration")]
    assert len(iterations) == 3


def _csv(directory):
    with open(directory / "memory.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_memory_csv_totals_equal_tier_statistics(profiled):
    directory, before, after, _ = profiled
    rows = _csv(directory)
    # One row per closed moment: ticks plus one per end of iteration, 3 iterations.
    assert sum(int(r["end_of_iteration"]) for r in rows) == 3
    assert len({(r["iteration"], r["moment"]) for r in rows}) == len(rows)
    last = rows[-1]
    for stats_before, stats_after in zip(before, after):
        kind = stats_after["kind"]
        assert int(last[f"{kind}_model_bytes"]) == stats_after["chunk_bytes"]
        assert int(last[f"{kind}_bytes_in_total"]) == (stats_after["bytes_in"]
                                                       - stats_before["bytes_in"])
        assert int(last[f"{kind}_bytes_out_total"]) == (stats_after["bytes_out"]
                                                        - stats_before["bytes_out"])
        peak = max(int(r[f"{kind}_model_bytes"]) for r in rows)
        assert peak <= stats_after["peak_chunk_bytes"]
    budget = after[0]["budget_bytes"]
    assert all(int(r["device_model_bytes"]) <= budget for r in rows)
    assert all(int(r["device_budget_bytes"]) == budget for r in rows)
    # Activations are non-model data of the memory holding them: the device's with CUDA, the
    # host's where torch runs on the CPU (Note [Where measured non-model data lives]).
    on_gpu = patrickstar._C.cuda_available() and not patrickstar._C.strict_device()
    holder, other = ("device", "host") if on_gpu else ("host", "device")
    assert max(int(r[f"{holder}_non_model_bytes"]) for r in rows) > 0
    if not on_gpu:
        assert max(int(r[f"{other}_non_model_bytes"]) for r in rows) == 0


def test_summary_agrees_with_statistics(profiled):
    directory, before, after, _ = profiled
    device = after[0]["name"]  # "device", or "cuda:0" with a GPU or the strict device
    summary = json.loads((directory / "summary.json").read_text())
    moved_in = sum(a["bytes_in"] - b["bytes_in"] for a, b in zip(after, before))
    assert summary["moves"]["bytes"] == moved_in > 0
    assert summary["moves"]["by_direction"][f"host->{device}"] == (after[0]["bytes_in"]
                                                                   - before[0]["bytes_in"])
    # A CPU build updates every chunk where it is (Note [Optimizer sweep] in optimizer.py): no copy
    # has the optimizer cause; with CUDA the optimizer pulls device chunks to the host. The
    # strict device keeps the CPU build's placement (torch runs on the CPU there).
    if patrickstar._C.cuda_available() and not patrickstar._C.strict_device():
        assert summary["moves"]["by_cause"]["optimizer"] > 0
    else:
        assert summary["moves"]["by_cause"].get("optimizer", 0) == 0
    assert summary["moves"]["by_cause"]["access"] > 0
    evictions = after[0]["evictions"] - before[0]["evictions"]
    assert summary["evictions"]["count"] == summary["tiers"][device]["evictions"] == evictions
    assert sum(c["count"] for c in summary["evictions"]["top_causes"]) == evictions
    # Prefetch is off in the engine: every post-warm-up copy was a miss.
    misses = sum(a["prefetch_misses"] - b["prefetch_misses"] for a, b in zip(after, before))
    issued = sum(a["prefetch_issued"] - b["prefetch_issued"] for a, b in zip(after, before))
    hits = sum(a["prefetch_hits"] - b["prefetch_hits"] for a, b in zip(after, before))
    assert issued > 0 and hits > 0  # the engine prefetches from the warm-up trace
    assert summary["prefetch"] == {"issued": issued, "hits": hits, "misses": misses,
                                   "hit_rate": pytest.approx(hits / (hits + misses))}
    assert summary["chunks"]["chunk_elements"] == CHUNK
    assert summary["chunks"]["wasted_bytes"] >= 0
    assert summary["tiers"][device]["peak_model_bytes"] <= after[0]["budget_bytes"]
    assert summary["largest_non_model_moment"]["bytes"] > 0
    assert summary["run"]["iterations"] == 3
    for it in summary["time"]["iterations"]:
        parts = it["compute_s"] + it["move_wait_s"] + it["collective_s"] + it["optimizer_s"]
        assert parts == pytest.approx(it["total_s"], rel=1e-6)
        assert it["move_wait_s"] > 0 and it["optimizer_s"] > 0
    assert summary["findings"]
    assert any(device in finding for finding in summary["findings"])


def test_non_model_data_is_on_the_tier_the_engine_plans_it_on(tmp_path):
    """Activations are counted once, on the tier whose memory holds them and whose budget the
    manager plans them against (host memory on a CPU build): they were put on the (emulated)
    device tier as well, so a CPU profile showed them on two tiers, the device's peak total
    above its budget, and a finding that the manager had planned with 0 MiB on the device."""
    model, optimizer = _model()
    with patrickstar.profile(model, tmp_path):
        _train(model, optimizer, 2, batch=8)
    where = model.non_model_tier
    kinds = {stats["name"]: stats["kind"] for stats in model.memory_stats()}
    model.destroy()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name, tier in summary["tiers"].items():
        if kinds[name] == where:
            assert tier["peak_non_model_bytes"] > 0, name
        else:
            assert tier["peak_non_model_bytes"] == 0, (name, tier)
            assert tier["peak_total_bytes"] == tier["peak_model_bytes"], (name, tier)
    assert summary["largest_non_model_moment"]["tier"] in [n for n, k in kinds.items()
                                                          if k == where]
    assert not any("planned with 0.0 MiB" in finding for finding in summary["findings"])


def test_eviction_causes_are_told_apart(tmp_path, nvme_dir):
    """Each row of the top eviction causes is one (phase, trigger, kind the room was for,
    victim kind, direction): the optimizer's explicit moves for variance and for gradient
    chunks read the same ("optimizer: an explicit move moved gradient chunks host->nvme"
    twice in report.html)."""
    gpt = GPTConfig(vocab_size=512, max_seq_len=32, hidden=128, layers=2, heads=4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={
        "default_chunk_size": 1 << 15, "memory": {"device_budget": "1MiB", "host_budget": "3MiB",
                                                  "nvme": {"path": nvme_dir}}})
    with patrickstar.profile(model, tmp_path):
        for ids, targets in synthetic_batches(gpt, 2, 4):
            model.backward(model(ids, targets))
            optimizer.step()
            optimizer.zero_grad()
    model.destroy()
    causes = json.loads((tmp_path / "summary.json").read_text())["evictions"]["top_causes"]
    assert any(c["trigger"] == "explicit" for c in causes)
    descriptions = [c["description"] for c in causes]
    assert len(set(descriptions)) == len(descriptions), descriptions
    # The NVMe panel of report.html is scaled to the chunks it held, not to its default budget
    # (the disk's free space), which drew them as a flat line at 0.
    summary = json.loads((tmp_path / "summary.json").read_text())
    nvme = summary["tiers"]["nvme"]
    assert 0 < nvme["peak_total_bytes"] and nvme["budget_bytes"] > 4 * nvme["peak_total_bytes"]
    panel = (tmp_path / "report.html").read_text().split('<svg class="chart"')[3]
    assert "nvme (nvme)" in panel and "(above the chart)" in panel
    top_label = panel.split('class="small axis">')[3].split(" MiB<")[0]
    assert float(top_label) * MiB <= 1.01 * nvme["peak_total_bytes"]


def test_peaks_include_chunks_between_samples(tmp_path):
    """Moments are sampled when they close, so gradient chunks written after the last tick of
    a backward and dropped by the optimizer were never sampled: summary.json reported a device
    peak below the manager's own (Note [Peaks between moments] in profiling/analysis.py). A
    backward now ends with a moment of its own (Note [A moment after the backward] in
    engine.py), so those chunks are sampled too (before: sampled < peak), and summary.json
    still gives the manager's peak. The device tier is empty until the first forward, so its
    peak_chunk_bytes is the profile's."""
    model, optimizer = _model(_config(memory={}))  # no budget: nothing is evicted
    with patrickstar.profile(model, tmp_path):
        _train(model, optimizer, 2)
    device = model.memory_stats()[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = _csv(tmp_path)
    sampled = max(int(r["device_model_bytes"]) for r in rows)
    peak = max(int(r["device_peak_model_bytes"]) for r in rows)
    assert sampled == peak == device["peak_chunk_bytes"]
    assert summary["tiers"][device["name"]]["peak_model_bytes"] == device["peak_chunk_bytes"]
    assert all(int(r["device_peak_model_bytes"]) >= int(r["device_model_bytes"]) for r in rows)


_PLACEMENT_KEYS = ("bytes_in", "bytes_out", "chunks_in", "chunks_out", "evictions", "zero_fills",
                   "prefetch_issued", "prefetch_hits", "prefetch_misses")


@pytest.mark.parametrize("precision", ["int8 state", "bf16 without master"])
def test_model_data_by_kind_names_the_state_dtypes_and_agrees_with_the_estimate(tmp_path,
                                                                                 precision):
    """summary.json gave the model data only as one total and report.html's run table only the
    precision ('fp32' for int8 Adam state): whether the moments were int8, and what the scales
    or the Kahan compensation cost, could not be read off the report nor set against
    estimate_memory()'s kinds. chunks.by_kind gives each kind's chunks, element type and
    bytes; the CLI and report.html list them."""
    if precision == "int8 state":
        extra = {"optimizer": {"type": "Adam", "params": {"state_dtype": "int8"}}}
        mode, expected = "fp32", {"compute_param": ("float32", 4), "gradient": ("float32", 4),
                                  "momentum": ("uint8", 1), "variance": ("uint8", 1)}
        folded = {"momentum": ("momentum", "momentum_scale"),
                  "variance": ("variance", "variance_scale"), "master": ()}
    else:
        extra = {"bf16": {"enabled": True, "master_weights": False}}
        mode, expected = "bf16, no master", {"compute_param": ("bfloat16", 2),
                                             "gradient": ("bfloat16", 2),
                                             "param_compensation": ("bfloat16", 2),
                                             "momentum": ("float32", 4),
                                             "variance": ("float32", 4)}
        folded = {"momentum": ("momentum",), "variance": ("variance",),
                  "master": ("param_compensation",)}
    config = _config(**extra)
    estimate = patrickstar.estimate_memory(lambda: GPT(GPT_CONFIG), config, verbose=False)
    model, optimizer = _model(config)
    with patrickstar.profile(model, tmp_path):
        _train(model, optimizer, 1)
    chunks = json.loads((tmp_path / "summary.json").read_text())["chunks"]
    by_kind = chunks["by_kind"]
    layout = json.loads((tmp_path / "profile.json").read_text())["layout"]["chunks"]
    for kind, (dtype, itemsize) in expected.items():
        elements = sum(c["capacity_elements"] for c in layout if c["kind"] == kind)
        assert by_kind[kind]["dtype"] == dtype, kind
        assert by_kind[kind]["bytes"] == elements * itemsize, kind
        assert by_kind[kind]["chunks"] == sum(1 for c in layout if c["kind"] == kind)
    if precision == "int8 state":  # one float32 scale per block of the uint8 moments
        for kind in ("momentum_scale", "variance_scale"):
            assert by_kind[kind]["dtype"] == "float32"
            assert 0 < by_kind[kind]["bytes"] < by_kind["momentum"]["bytes"]
    assert set(by_kind) == set(expected) | {k for kinds in folded.values() for k in kinds}
    assert sum(k["bytes"] for k in by_kind.values()) == chunks["model_data_bytes"]
    predicted = estimate["modes"][mode]
    assert chunks["model_data_bytes"] == predicted["total"]
    # The estimate's table names which chunks its folded columns hold ("bf16, no master" read
    # as having a master).
    from patrickstar.estimator import format_estimate
    table = format_estimate(estimate)
    for estimated_kind, kinds in folded.items():
        for kind in kinds:
            if kind != estimated_kind:
                assert kind in table, (kind, table)
    for estimated_kind, kinds in folded.items():
        assert predicted["by_kind"][estimated_kind] == sum(by_kind[k]["bytes"] for k in kinds)
    page = (tmp_path / "report.html").read_text()
    assert f"momentum {expected['momentum'][0]}" in page
    out = io.StringIO()
    assert report.main([str(tmp_path)], out=out) == 0
    assert re.search(rf"\n  momentum +[0-9.]+ [KM]iB {expected['momentum'][0]}\n", out.getvalue())


def test_profiling_does_not_change_placement(profiled):
    """The same run unprofiled makes the same chunk moves (placement never depends on the
    profiler), and trains to nearly the same losses. Not bit-identical ones: the engine itself
    is not run-to-run deterministic under device evictions yet (reported to the lead)."""
    _, before_profiled, after_profiled, profiled_losses = profiled
    model, optimizer = _model()
    _train(model, optimizer, 1)
    before = model.memory_stats()
    losses = _train(model, optimizer, 3)
    after = model.memory_stats()
    for tiers in zip(before, after, before_profiled, after_profiled):
        for key in _PLACEMENT_KEYS:
            assert tiers[1][key] - tiers[0][key] == tiers[3][key] - tiers[2][key], key
    assert losses == pytest.approx(profiled_losses, rel=0.05)
    # Off by default: nothing is recorded.
    assert model.profiler is None
    events = model.chunks.manager.drain_events()
    assert events["type"] == [] and model.chunks.manager.events_dropped == 0


def test_config_enables_profiling(tmp_path):
    model, optimizer = _model(_config(profile={"enabled": True, "output_dir": str(tmp_path)}))
    assert model.profiler is not None and model.profiler.running
    _train(model, optimizer, 2)
    with pytest.raises(RuntimeError, match="already being profiled"):
        with patrickstar.profile(model, tmp_path / "other"):
            pass
    assert model.profiler.stop() == str(tmp_path)
    for name in OUTPUTS:
        assert (tmp_path / name).is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["iterations"] == 2


def test_a_config_profile_left_on_in_a_long_run_says_so_once(tmp_path, capsys, monkeypatch):
    """Note [A profile left running]: every iteration's events stay in memory until the profile
    is written (about 58 KiB an iteration for a small MLP with NVMe), so a config profile left
    on in a week-long run grew without a word until host memory ran out."""
    from patrickstar.profiling import recorder
    monkeypatch.setattr(recorder, "LONG_PROFILE_ITERATIONS", 3)
    model, optimizer = _model(_config(profile={"enabled": True, "output_dir": str(tmp_path)}))
    capsys.readouterr()
    _train(model, optimizer, 2)
    assert "keeps every later one" not in capsys.readouterr().err
    _train(model, optimizer, 3)
    err = capsys.readouterr().err
    assert err.count("keeps every later one in this process's memory") == 1, err
    assert f"'{tmp_path}' has recorded 3 iterations" in err and "profiler.stop()" in err, err
    model.profiler.stop()
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["iterations"] == 5


def test_a_second_engines_config_profile_names_the_engine_still_profiling(tmp_path):
    """One profiler runs at a time. An engine kept alive past its loop (here by a caught
    exception's traceback) still profiles, and the next engine's config profile said only
    "a profiler is already running ...; stop it first"."""
    def failing_step():
        model, _ = _model(_config(profile={"enabled": True, "output_dir": str(tmp_path / "a")}))
        model(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))

    try:
        failing_step()
    except Exception as error:  # noqa: BLE001
        kept = error  # its traceback holds the first engine
    with pytest.raises(RuntimeError, match="config key 'profile.enabled': a profiler is already "
                                           "running .* of another engine that is still alive"):
        _model(_config(profile={"enabled": True, "output_dir": str(tmp_path / "b")}))
    del kept
    gc.collect()  # the first engine goes and writes its profile
    assert (tmp_path / "a" / "summary.json").is_file()
    model, _ = _model(_config(profile={"enabled": True, "output_dir": str(tmp_path / "b")}))
    assert model.profiler.running


def test_collectives_are_recorded(tmp_path):
    model, optimizer = _model()
    with patrickstar.profile(model, tmp_path) as profiler:
        for ids, targets in synthetic_batches(GPT_CONFIG, 2, 2):
            start = now_ns()
            loss = model(ids, targets)
            model.backward(loss)
            profiler.record_collective("reduce_scatter", 4096, start, now_ns(), group=0)
            with profiler.collective("allgather", 1024):
                time.sleep(0.002)
            optimizer.step()
            optimizer.zero_grad()
        with pytest.raises(ValueError, match="record_collective 'bad'"):
            profiler.record_collective("bad", 1, 10, 5)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["collectives"]["count"] == 4
    assert summary["collectives"]["bytes"] == 2 * (4096 + 1024)
    for it in summary["time"]["iterations"]:
        assert it["collective_s"] >= 0.002
    trace = json.loads((tmp_path / "trace.json").read_text())
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    collectives = [e for e in trace["traceEvents"]
                   if e["ph"] == "X" and threads[e["tid"]].startswith("collectives")]
    assert sorted(e["name"] for e in collectives) == ["allgather"] * 2 + ["reduce_scatter"] * 2
    assert all(e["args"]["bytes"] in (1024, 4096) for e in collectives)


_RANK_SCRIPT = """
import sys, torch, patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
gpt = GPTConfig(vocab_size=64, max_seq_len=8, hidden=32, layers=1, heads=2)
torch.manual_seed(0)
model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={
    "default_chunk_size": 4096, "profile": {"enabled": True, "output_dir": sys.argv[1]}})
for ids, targets in synthetic_batches(gpt, 2, 2):
    model.backward(model(ids, targets))
    optimizer.step()
    optimizer.zero_grad()
model.destroy()
"""


def test_data_parallel_ranks_write_their_own_profiles(tmp_path):
    """Every rank runs the same config, so every rank profiles into the same output_dir: each
    writes into its own rank<k>/ below it instead of racing for the same files (rank 0 used to
    fail in destroy() renaming a temporary file rank 1 had renamed, and lost its profile)."""
    from test_data_parallel import finish, free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(tmp_path)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    codes = finish(procs)
    assert codes == [0, 0], [proc.stderr.read()[-2000:] for proc in procs]
    owned = []
    for rank in range(2):
        directory = tmp_path / f"rank{rank}"
        for name in OUTPUTS:
            assert (directory / name).is_file(), directory / name
        summary = json.loads((directory / "summary.json").read_text())
        assert summary["run"]["rank"] == rank and summary["run"]["world_size"] == 2
        assert summary["run"]["iterations"] == 2
        # The layout lists the whole model's chunks on every rank; each rank keeps its own
        # (Note [Model data of a data-parallel rank]): the model data read the whole model's.
        chunks = summary["chunks"]
        owned.append(chunks["owned_bytes"])
        total = chunks["model_data_bytes"]
        assert 0 < chunks["owned_bytes"] < total
        assert sum(k["owned_bytes"] for k in chunks["by_kind"].values()) == chunks["owned_bytes"]
        out = io.StringIO()
        assert report.main([str(directory)], out=out) == 0
        assert f"this rank owns {report_mib(chunks['owned_bytes'])}" in out.getvalue()
    assert sum(owned) == total  # every chunk is owned by one of the two ranks
    assert not [p.name for p in tmp_path.iterdir() if p.is_file()]


_DP_PROFILE_SCRIPT = """
import json, os, sys, torch, patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
gpt = GPTConfig(vocab_size=64, max_seq_len=8, hidden=32, layers=2, heads=2)
torch.manual_seed(0)
model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={"default_chunk_size": 4096})
def counters():
    return model.dp.collectives_issued, model.dp.bytes_communicated
with patrickstar.profile(model, sys.argv[1]):
    issued, sent = counters()
    for ids, targets in synthetic_batches(gpt, 2, 3):
        model.backward(model(ids, targets))
        optimizer.step()
        optimizer.zero_grad()
    optimizer.state_dict()
    after = counters()
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[1], f"counters{rank}.json"), "w") as f:
    json.dump({"issued": after[0] - issued, "bytes": after[1] - sent}, f)
model.destroy()
"""


def test_data_parallel_profile_records_collectives(tmp_path):
    """Under two ranks the profile holds every collective a rank issued: each chunk group's
    allgather and reduce-scatter with the group's bytes as the layout has them (world x chunk
    bytes: Note [Recording collectives] in recorded_collectives.py), in the pass that issued
    it, inside the profile, and summary.json, trace.json and report.html show them."""
    from test_data_parallel import finish, free_port
    world, chunk_elements = 2, 4096
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", _DP_PROFILE_SCRIPT, str(tmp_path)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    codes = finish(procs)
    assert codes == [0, 0], [proc.stderr.read()[-2000:] for proc in procs]
    for rank in range(world):
        directory = tmp_path / f"rank{rank}"
        raw = json.loads((directory / "profile.json").read_text())
        records = raw["collectives"]
        assert records
        # What each group collective must move, from the layout alone.
        chunks = raw["layout"]["chunks"]
        group_bytes: dict[str, int] = {}
        for c in chunks:
            label = f"{c['kind']} group {c['group']}"
            group_bytes[label] = group_bytes.get(label, 0) + c["bytes"]
        compute = sorted(g for g in group_bytes if g.startswith("compute_param"))
        gradient = sorted(g for g in group_bytes if g.startswith("gradient"))
        assert len(compute) > 1 and len(gradient) > 1
        element = 2 if raw["run"]["precision"] in ("fp16", "bf16") else 4
        for label in compute + gradient:  # no oversize tensor in this model
            assert group_bytes[label] == world * chunk_elements * element, label
        parameters = {t["id"] for c in chunks if c["kind"] == "compute_param"
                      for t in c["tensors"]}
        for c in records:
            assert raw["start_ns"] <= c["start_ns"] <= c["wait_start_ns"] <= c["end_ns"] \
                <= raw["stop_ns"], c
            if c["name"] in ("allgather", "reduce_scatter"):
                assert c["bytes"] == group_bytes[c["args"]["group"]], c
                assert c["args"]["collectives"] == 1
            elif c["args"]["label"] == "call count and kind":
                assert c["bytes"] == 2 * world * 4
            elif c["args"]["label"] == "has-gradient flags":
                assert c["bytes"] == 4 * len(parameters)
        # Per iteration: every compute group gathered in forward, every gradient group
        # reduce-scattered once in backward, one call agreement in each of forward, backward
        # and the step (Note [Calls between a read and its serving] in data_parallel.py), and
        # one at the forward's end (Note [A forward's end agrees]).
        ends = [m["time_ns"] for m in raw["marks"] if m["kind"] == "end"]
        assert len(ends) == 3
        begin = raw["start_ns"]
        for end in ends:
            inside = [c for c in records if begin < c["start_ns"] <= end]
            def issued(name, phase):
                return sorted(c["args"]["group"] for c in inside
                              if c["name"] == name and c["phase"] == phase)
            assert set(issued("allgather", "forward")) == set(compute)
            assert issued("reduce_scatter", "backward") == gradient
            assert not [c for c in inside if c["name"] == "reduce_scatter"
                        and c["phase"] != "backward"]
            assert [c["phase"] for c in inside
                    if c["args"].get("label") == "call count and kind"] == [
                        "forward", "forward", "backward", "optimizer"]
            begin = end
        # After the last step: optimizer.state_dict()'s agreement and gather of the state.
        last = [c for c in records if c["start_ns"] > ends[-1]]
        assert [(c["name"], c["args"]["label"], c["phase"]) for c in last] == [
            ("all_reduce", "call count and kind", "other"),
            ("all_gather_object", "optimizer state", "other")]
        # The group collectives are what the C++ counters say this rank issued.
        counted = json.loads((tmp_path / f"counters{rank}.json").read_text())
        groups = [c for c in records if c["name"] in ("allgather", "reduce_scatter")]
        assert len(groups) == counted["issued"]
        assert sum(c["bytes"] for c in groups) == counted["bytes"]
        # The outputs.
        summary = json.loads((directory / "summary.json").read_text())
        assert summary["collectives"]["count"] == len(records)
        assert summary["collectives"]["bytes"] == sum(c["bytes"] for c in records)
        by_name = summary["collectives"]["by_name"]
        assert by_name["allgather"]["count"] == len([c for c in groups
                                                     if c["name"] == "allgather"])
        assert by_name["reduce_scatter"]["bytes"] == 3 * sum(group_bytes[g] for g in gradient)
        assert summary["collectives"]["wait_s"] <= summary["collectives"]["time_s"]
        for it in summary["time"]["iterations"]:
            assert 0 < it["collective_s"] <= it["total_s"]
        trace = json.loads((directory / "trace.json").read_text())
        threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                   if e["ph"] == "M" and e["name"] == "thread_name"}
        slices = [e for e in trace["traceEvents"]
                  if e["ph"] == "X" and threads[e["tid"]].startswith("collectives")]
        assert len(slices) == len(records)
        assert all(threads[e["tid"]].startswith(f"collectives {e['name']} #") for e in slices)
        assert {e["args"]["group"] for e in slices if e["name"] == "allgather"} == set(compute)
        page = (directory / "report.html").read_text()
        assert "<h2>Collectives</h2>" in page and "<td>reduce_scatter</td>" in page


def test_profile_rejects_bad_arguments():
    with pytest.raises(TypeError, match="patrickstar.initialize"):
        with patrickstar.profile(torch.nn.Linear(2, 2), "unused"):
            pass


# ---- The command line ---------------------------------------------------------------------------

def test_cli_prints_summary_and_regenerates_report(profiled, capsys, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(profiled[0], directory)
    (directory / "report.html").unlink()
    assert report.main([str(directory)]) == 0
    printed = capsys.readouterr().out
    assert f"{profiled[2][0]['name']}: evictions" in printed and "findings:" in printed
    assert (directory / "report.html").is_file()
    assert report.main(["--compare", str(profiled[0]), str(directory)]) == 0
    printed = capsys.readouterr().out
    assert str(profiled[0]) in printed and str(directory) in printed
    assert "findings B:" in printed


def test_cli_names_missing_and_incomplete_directories(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert report.main([str(missing)]) == 2
    assert f"'{missing}' does not exist" in capsys.readouterr().err
    assert report.main([str(tmp_path)]) == 2
    assert f"'{tmp_path / 'profile.json'}' is missing" in capsys.readouterr().err
    (tmp_path / "profile.json").write_text('{"version": 1, "events": {}}')
    assert report.main(["--compare", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is incomplete" in err and "samples" in err and str(tmp_path) in err
    (tmp_path / "profile.json").write_text('{"version": ')
    assert report.main([str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_on_a_data_parallel_profile_directory_names_the_rank_directories(profiled, tmp_path,
                                                                             capsys):
    """`patrickstar-report prof/` (README) of a data-parallel run, whose ranks write prof/rank<k>/
    (Note [One profile directory per rank]), said prof/ 'is not a complete profile'; it now
    names the rank directories to give. An empty directory says when a profile is written."""
    for rank in (0, 1, 10):
        shutil.copytree(profiled[0], tmp_path / "prof" / f"rank{rank}")
    assert report.main([str(tmp_path / "prof")]) == 2
    assert (f"'{tmp_path / 'prof'}' holds the profiles of 3 data-parallel ranks (rank0/, "
            f"rank1/, rank10/), one directory each: give one of them, e.g. "
            f"'{tmp_path / 'prof' / 'rank0'}'") in capsys.readouterr().err
    assert report.main([str(tmp_path / "prof" / "rank1")]) == 0
    capsys.readouterr()
    (tmp_path / "running").mkdir()
    assert report.main([str(tmp_path / "running")]) == 2
    assert "written with the other outputs when profiling stops" in capsys.readouterr().err


def test_cli_piped_into_head_regenerates_the_page_without_a_traceback(profiled, tmp_path):
    """`patrickstar-report DIR | head -3` ended in a BrokenPipeError traceback, before
    report.html was regenerated."""
    directory = tmp_path / "prof"
    shutil.copytree(profiled[0], directory)
    (directory / "report.html").unlink()
    for argv in ([str(directory)], ["--compare", str(directory), str(directory)]):
        process = subprocess.Popen([sys.executable, "-m", "patrickstar.report", *argv],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout.readline()  # one line, as head -1, and the reader leaves
        process.stdout.close()
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0 and "Traceback" not in err, err
    assert (directory / "report.html").is_file()


def test_cli_names_fields_of_the_wrong_type(profiled, tmp_path, capsys):
    # A profile.json that parses but is not what the recorder writes (edited by hand, cut by
    # another tool) is named key by key with exit code 2, never a TypeError traceback.
    raw = json.loads((profiled[0] / "profile.json").read_text())
    cases = [({**raw, "samples": None}, "samples is null (expected an object)"),
             ({**raw, "events": "x"}, "events is a string (expected an object)"),
             ({**raw, "run": [], "tiers": {}}, "run is a list (expected an object); tiers is "
                                               "an object (expected a list)"),
             (5, "holds a number, not a profile record")]
    for record, message in cases:
        (tmp_path / "profile.json").write_text(json.dumps(record))
        assert report.main([str(tmp_path)]) == 2, message
        err = capsys.readouterr().err
        assert message in err and str(tmp_path / "profile.json") in err, err
    assert not (tmp_path / "report.html").exists()


def test_cli_entry_point_is_installed(profiled):
    scripts = metadata.entry_points(group="console_scripts", name="patrickstar-report")
    assert [entry.value for entry in scripts] == ["patrickstar.report:main"]
    script = os.path.join(os.path.dirname(sys.executable), "patrickstar-report")
    if not os.path.exists(script):
        pytest.skip(f"{script} is not installed (the package was not pip-installed here)")
    result = subprocess.run([script, str(profiled[0])], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "findings:" in result.stdout
    result = subprocess.run([script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "give one profile directory" in result.stderr


def test_cli_runs_as_a_module(profiled):
    """`python -m patrickstar.report DIR`, the spelling for an environment without the console
    script on PATH, printed nothing and exited 0."""
    result = subprocess.run([sys.executable, "-m", "patrickstar.report", str(profiled[0])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "findings:" in result.stdout
    result = subprocess.run([sys.executable, "-m", "patrickstar.report"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "give one profile directory" in result.stderr


# ---- report.html in headless Chromium ----------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="the chromium binary is not installed (Debian package 'chromium', "
                             "listed in tools/setup.sh)")


def _render(page, out_dir):
    """Screenshot of `page` and the console problems Chromium logged while rendering it."""
    shot = out_dir / "shot.png"
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--no-first-run", f"--user-data-dir={out_dir / 'profile'}"]
    result = subprocess.run(
        common + ["--window-size=1200,2400", "--enable-logging=stderr", "--v=1",
                  f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    problems = [line for line in result.stderr.splitlines()
                if "Uncaught" in line or ("CONSOLE" in line and ":ERROR:" in line)
                or ("CONSOLE" in line and "error" in line.lower())]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120)
    return shot, problems, dom.stdout


@needs_chromium
def test_report_renders_in_chromium_without_console_errors(profiled, tmp_path):
    import matplotlib.image
    shot, problems, dom = _render(profiled[0] / "report.html", tmp_path)
    assert problems == []
    # The page's script ran to its end and saw every chart.
    assert 'id="report-ready"' in dom and 'data-charts="4"' in dom
    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1100
    assert pixels.std() > 0.05, "blank screenshot"
    # Every tier color of the charts is somewhere on the page (device red, host blue).
    rgb = (pixels[..., :3] * 255).round().astype(int)
    for color in ((0xd6, 0x27, 0x28), (0x1f, 0x77, 0xb4)):
        assert ((abs(rgb - color).sum(axis=-1)) < 12).any(), color


@needs_chromium
def test_console_check_catches_a_broken_page(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><p>x</p><script>undefinedFunction();</script></body></html>")
    _, problems, _ = _render(page, tmp_path)
    assert any("undefinedFunction" in line for line in problems)


_CLIPPED_TEXT_CHECK = """<script>
var clipped=[];
document.querySelectorAll('svg.chart text').forEach(function(t){
  var box=t.getBBox(),width=t.ownerSVGElement.viewBox.baseVal.width;
  if(box.x<0||box.x+box.width>width+0.5){clipped.push(t.textContent);}});
document.body.setAttribute('data-clipped',JSON.stringify(clipped));
</script></body>"""


@needs_chromium
def test_report_text_fits_its_charts_and_axis_labels_differ(tmp_path):
    """The chunk heat map's labels were cut at the chart's left edge for the longer kinds of
    int8 state ('hunk 32 momentum_scale'), and a panel whose peak is below a few MiB labelled
    its axis '0 MiB', '0 MiB', '0 MiB'."""
    model, optimizer = _model(_config(optimizer={"type": "Adam",
                                                 "params": {"state_dtype": "int8"}}))
    with patrickstar.profile(model, tmp_path / "prof"):
        _train(model, optimizer, 1)
    page = (tmp_path / "prof" / "report.html").read_text()
    assert "momentum_scale" in page
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", _CLIPPED_TEXT_CHECK))
    _, problems, dom = _render(checked, tmp_path)
    assert problems == []
    clipped = json.loads(html.unescape(dom.split('data-clipped="')[1].split('"')[0]))
    assert clipped == []
    # Each panel's three axis labels (0, half and all of its peak) are three numbers.
    panels = page.split('<svg class="chart"')[1:3]
    for panel in panels:
        values = [label.split("<")[0] for label in panel.split('class="small axis">')[1:]]
        assert len(values) == 3 and len(set(values)) == 3, values


def test_demo_writes_a_profile(tmp_path):
    """tools/demo_train.py --profile DIR: the demo's run produces all four outputs."""
    demo = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "demo_train.py")
    result = subprocess.run(
        [sys.executable, demo, "--steps", "3", "--layers", "1", "--hidden", "64",
         "--profile", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-2000:]  # 1: loss did not fall in 3 steps
    assert f"memory profile written to {tmp_path}" in result.stdout
    for name in OUTPUTS:
        assert (tmp_path / name).is_file(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["iterations"] == 3 and summary["moves"]["count"] > 0
    # The demo's "device model data" is its report's compute_param and gradient chunks (it
    # counted the parameters' bytes, which leave out the chunks' unused capacity).
    by_kind = summary["chunks"]["by_kind"]
    device_chunks = by_kind["compute_param"]["bytes"] + by_kind["gradient"]["bytes"]
    assert f"device model data {device_chunks / MiB:.1f} MiB" in result.stdout, result.stdout


def test_config_profile_section_is_validated(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"'profile.output_dir': '{blocker}' exists and is not"):
        patrickstar.load_config({"profile": {"enabled": True, "output_dir": str(blocker)}})
    with pytest.raises(ValueError, match="profile.enabled"):
        patrickstar.load_config({"profile": {"enabled": "yes"}})
    with pytest.raises(ValueError, match="unknown config key 'profile.dir'"):
        patrickstar.load_config({"profile": {"dir": "x"}})
    config = patrickstar.load_config({"profile": {"enabled": True, "output_dir": tmp_path}})
    assert config.profile.enabled and config.profile.output_dir == str(tmp_path)


def test_a_profile_directory_that_cannot_be_made_fails_before_the_run(tmp_path):
    """A profile directory under a file (or without permission) failed only when the profile
    was written, at the end of the run or in the engine's destructor: the run was done and its
    profile lost. Profiling now starts by making the directory."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ProfileError, match=f"'profile.output_dir': cannot create profile "
                                           f"directory '{blocker / 'sub'}'"):
        _model(_config(profile={"enabled": True, "output_dir": str(blocker / "sub")}))
    built = torch.nn.Linear(4, 4)  # a module passed in built keeps its weights
    weights = {key: value.clone() for key, value in built.state_dict().items()}
    with pytest.raises(ProfileError, match="'profile.output_dir'"):
        patrickstar.initialize(built, config=_config(
            profile={"enabled": True, "output_dir": str(blocker / "sub")}))
    assert all(torch.equal(built.state_dict()[key], value) for key, value in weights.items())
    model, optimizer = _model()  # the failed initialize() left nothing behind
    with pytest.raises(ProfileError, match=f"cannot create profile directory '{blocker / 'p'}'"):
        with patrickstar.profile(model, blocker / "p"):
            pass
    assert model.profiler is None
    with patrickstar.profile(model, tmp_path / "ok"):
        _train(model, optimizer, 1)
    assert (tmp_path / "ok" / "summary.json").is_file()


def _unwritable_directory(tmp_path):
    """An existing directory no file can be made in: read-only by mode, or, for root (whom
    modes do not stop), /proc/self."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o500)
    if not os.access(directory, os.W_OK):
        return directory
    if os.path.isdir("/proc/self"):
        return pathlib.Path("/proc/self")
    pytest.skip("no directory this user cannot write into")


def test_an_existing_directory_that_cannot_be_written_fails_before_the_run(tmp_path):
    """A directory that exists passed makedirs at start(); the run was profiled to its end and
    its profile lost to a bare PermissionError at stop(). start() now makes a file there."""
    directory = _unwritable_directory(tmp_path)
    model, optimizer = _model()
    with pytest.raises(ProfileError, match=f"cannot write into profile directory "
                                           f"'{directory}'"):
        with patrickstar.profile(model, directory):
            pytest.fail("the block ran")
    assert model.profiler is None and active_profiler() is None
    with pytest.raises(ProfileError, match="'profile.output_dir': cannot write into profile "
                                           "directory"):
        _model(_config(profile={"enabled": True, "output_dir": str(directory)}))
    # Writing an output into it (the CLI's report.html) names the file.
    with pytest.raises(ProfileError, match=f"cannot write profile output "
                                           f"'{directory / 'report.html'}'"):
        write_text(str(directory / "report.html"), "x")


def test_the_report_of_a_failed_run_says_it_failed(tmp_path, capsys):
    """A profile() block left by an exception wrote a report that read like a finished run's
    (Note [Profiles of failed runs]); the record now keeps the failure and the first finding
    says the figures stop there."""
    model, optimizer = _model()
    with pytest.raises(RuntimeError, match="data loader broke"):
        with patrickstar.profile(model, tmp_path / "failed"):
            _train(model, optimizer, 1)
            ids, targets = next(synthetic_batches(GPT_CONFIG, 2, 1))
            model(ids, targets)  # the next iteration's forward, then the failure
            raise RuntimeError("data loader broke\nsecond line")
    # The trace shows the iteration that failed and its forward, where it showed nothing after
    # the last complete iteration.
    trace = json.loads((tmp_path / "failed" / "trace.json").read_text())["traceEvents"]
    slices = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("iteration", "phase")]
    complete = next(e for e in slices if e["name"] == "iteration 0")
    incomplete = next(e for e in slices if e["name"] == "iteration 1 (incomplete)")
    assert incomplete["ts"] >= complete["ts"] + complete["dur"] - 1e-3
    assert any(e["name"] == "forward" and e["ts"] >= incomplete["ts"] and e["dur"] > 0
               for e in slices)
    summary = json.loads((tmp_path / "failed" / "summary.json").read_text())
    assert summary["run"]["failure"] == "RuntimeError: data loader broke\nsecond line"
    assert summary["findings"][0] == ("the profiled run failed: RuntimeError: data loader "
                                      "broke (these figures stop at the failure).")
    assert summary["run"]["iterations"] == 1  # what ran before the failure is kept
    assert report.main([str(tmp_path / "failed")]) == 0
    assert "the profiled run failed: RuntimeError: data loader broke" in capsys.readouterr().out
    assert "the profiled run failed" in (tmp_path / "failed" / "report.html").read_text()
    with patrickstar.profile(model, tmp_path / "ok"):  # a run that ends normally
        _train(model, optimizer, 1)
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["run"]["failure"] is None
    assert not any("failed" in finding for finding in summary["findings"])
    # A profile() context entered and dropped without being left is closed with GeneratorExit
    # when collected: not a failure of the run.
    context = patrickstar.profile(model, tmp_path / "dropped")
    context.__enter__()
    _train(model, optimizer, 1)
    del context
    gc.collect()
    summary = json.loads((tmp_path / "dropped" / "summary.json").read_text())
    assert summary["run"]["failure"] is None and summary["run"]["iterations"] == 1


def test_a_failed_run_whose_profile_cannot_be_written_raises_the_runs_error(tmp_path,
                                                                            monkeypatch):
    """A profile() block left by the run's error, whose profile then could not be written,
    raised the writing error in its place."""
    from patrickstar.profiling import outputs

    def disk_full(*args, **kwargs):
        raise ProfileError("cannot write profile output 'x': [Errno 28] No space left on device")
    model, optimizer = _model()
    with pytest.raises(RuntimeError, match="data loader broke") as caught:
        with patrickstar.profile(model, tmp_path):
            monkeypatch.setattr(outputs, "write_outputs", disk_full)
            raise RuntimeError("data loader broke")
    assert any("its profile could not be written into" in note and "No space left" in note
               for note in caught.value.__notes__)
    assert active_profiler() is None and model.profiler is None


_DIES_WITH_A_CONFIG_PROFILE = """
import sys, torch, patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
gpt = GPTConfig(vocab_size=64, max_seq_len=8, hidden=32, layers=1, heads=2)
manual = sys.argv[3] == "Profiler"
model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={
    "default_chunk_size": 4096, "profile": {"enabled": not manual, "output_dir": sys.argv[1]}})
if manual:  # tools/demo_train.py's way, never stopped here
    patrickstar.Profiler(model, sys.argv[1]).start()
for ids, targets in synthetic_batches(gpt, 2, 2):
    model.backward(model(ids, targets))
    optimizer.step()
    optimizer.zero_grad()
if sys.argv[2] == "fail":
    raise ValueError("bad batch")
"""


@pytest.mark.parametrize("end", ["fail", "ok"])
@pytest.mark.parametrize("how", ["config", "Profiler"])
def test_a_config_profile_written_at_exit_says_whether_the_script_failed(tmp_path, end, how):
    """A config profile (or a Profiler never stopped) is written at exit, after the traceback
    of the exception that ended the script: its report says so (sys.last_value; Note
    [Profiles of failed runs])."""
    script = tmp_path / "train.py"
    script.write_text(_DIES_WITH_A_CONFIG_PROFILE)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "prof"), end, how],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == (1 if end == "fail" else 0), result.stderr[-2000:]
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    assert summary["run"]["iterations"] == 2
    if end == "fail":
        assert summary["run"]["failure"] == "ValueError: bad batch"
        assert summary["findings"][0].startswith("the profiled run failed: ValueError: bad batch")
    else:
        assert summary["run"]["failure"] is None


def test_upstream_profiler_with_a_config_profile_says_why_nothing_was_recorded(tmp_path):
    """Upstream's `profiler.start()` before initialize() of a config with profile.enabled: the
    config's profiler records the engine, and save() said "nothing was recorded; call
    profiler.start() before patrickstar.initialize()", which the script had done. It now
    names the profiler that ran instead and where its profile is."""
    from patrickstar.profiling.upstream import UpstreamProfiler
    fresh = UpstreamProfiler()
    fresh.start()
    model, optimizer = _model(_config(profile={"enabled": True,
                                               "output_dir": str(tmp_path / "config")}))
    fresh.engine_built(model)  # (what patrickstar.initialize() tells the global profiler)
    _train(model, optimizer, 1)
    fresh.end()
    with pytest.raises(RuntimeError, match=f"profiler.save\\(\\): nothing was recorded: another "
                                           f"profiler was running .*'{tmp_path / 'config'}'.*"
                                           f"remove the config's 'profile' section"):
        fresh.save(str(tmp_path / "x.pkl"))
    assert model.profiler.stop() == str(tmp_path / "config")
    fresh.start()  # with the config's profiler stopped, a new recording takes the engine
    fresh.end()
    fresh.save(str(tmp_path / "y.pkl"))
    assert (tmp_path / "y.pkl").is_file()
    model.destroy()


def test_dropped_events_finding_says_how_to_raise_the_capacity(tmp_path):
    """The finding said "raise the profiler's capacity" without saying where it is set or
    what it was."""
    model, optimizer = _model()
    with patrickstar.profile(model, tmp_path, capacity=16):
        _train(model, optimizer, 1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dropped_events"] > 0
    assert any(f.endswith("raise the profiler's capacity (now 16 events), the events it holds "
                          "between two ends of iteration: "
                          "patrickstar.profile(model, dir, capacity=N).")
               for f in summary["findings"]), summary["findings"]
    for capacity in (0, -1, 2.5, "big", True):
        with pytest.raises(ValueError, match=f"profiler capacity: expected a positive whole "
                                             f"number of events .*got {capacity!r}"):
            with patrickstar.profile(model, tmp_path / "bad", capacity=capacity):
                pytest.fail("the block ran")
    assert not (tmp_path / "bad").exists() and active_profiler() is None


def test_profiling_a_destroyed_engine_says_so(tmp_path):
    """It failed with AttributeError: 'NoneType' object has no attribute 'manager'."""
    model, _ = _model()
    model.destroy()
    with pytest.raises(RuntimeError, match="cannot profile into .*: this PatrickStar engine was "
                                           "deleted or destroyed"):
        with patrickstar.profile(model, tmp_path):
            pytest.fail("the block ran")
    assert active_profiler() is None


def test_the_record_of_a_stopped_profiler_ends_at_its_stop(tmp_path):
    """A stopped profiler's raw() read the engine's statistics live: after more training its
    tier totals counted copies made after stop() that no event recorded (bytes moved in per
    tier above the bytes of the recorded copies), and after the engine was destroyed it raised
    naming memory_stats() (Note [Statistics at stop] in profiling/recorder.py)."""
    model, optimizer = _model()
    profiler = patrickstar.Profiler(model, tmp_path).start()
    _train(model, optimizer, 2)
    profiler.stop(write=False)
    at_stop = profiler.raw()
    _train(model, optimizer, 1)  # after the profile: chunks move again
    summary = report.write_outputs(tmp_path, profiler.raw())
    assert summary["moves"]["bytes"] > 0
    for direction, nbytes in summary["moves"]["by_direction"].items():
        assert summary["tiers"][direction.split("->")[1]]["bytes_in"] >= nbytes
    assert sum(t["bytes_in"] for t in summary["tiers"].values()) == summary["moves"]["bytes"]
    assert sum(t["bytes_out"] for t in summary["tiers"].values()) == summary["moves"]["bytes"]
    model.destroy()
    assert profiler.raw() == at_stop
    with pytest.raises(RuntimeError, match="cannot profile into .*: this PatrickStar engine was "
                                           "deleted or destroyed"):
        profiler.start()

def test_empty_profile_still_writes_every_output(tmp_path):
    model, _ = _model()
    with patrickstar.profile(model, tmp_path):
        pass
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["iterations"] == 0 and summary["moves"]["count"] == 0
    assert any("no complete iteration" in finding for finding in summary["findings"])
    for name in OUTPUTS:
        assert (tmp_path / name).is_file()
    # No iteration, no step time: the CLI and the page said 0.00 ms.
    out = io.StringIO()
    assert report.main([str(tmp_path)], out=out) == 0
    assert re.search(r"\nstep time \(ms, after warm-up\) +n/a\n", out.getvalue())
    assert re.search(r"\n  optimizer \(ms\) +n/a\n", out.getvalue())
    assert ("<td>mean step time after warm-up</td><td>n/a (no complete iteration was "
            "recorded)</td>") in (tmp_path / "report.html").read_text()



def test_a_profile_with_no_moment_gives_the_chunks_the_tiers_hold(tmp_path):
    """A profile stopped before the first forward has no moment: its per-tier peaks read
    0.0 MiB, while the host held every parameter (Note [Peaks between moments])."""
    model, _ = _model()
    held = {t["name"]: t["chunk_bytes"] for t in model.memory_stats()}
    with patrickstar.profile(model, tmp_path):
        pass
    assert held["host"] >= GPT_CONFIG.parameter_count() * 4  # the fp32 parameters, in chunks
    tiers = json.loads((tmp_path / "summary.json").read_text())["tiers"]
    for name, nbytes in held.items():
        assert tiers[name]["peak_model_bytes"] == nbytes, name
        assert tiers[name]["peak_total_bytes"] >= nbytes, name
    out = io.StringIO()
    assert report.main([str(tmp_path)], out=out) == 0
    assert re.search(rf"\nhost: peak model / non-model +{re.escape(report_mib(held['host']))} /",
                     out.getvalue())

# ---- Findings from a hand-made record ----------------------------------------------------------

MS = 1_000_000
MiB = 1 << 20


def _stats(bytes_in, evictions):
    keys = ("bytes_in", "bytes_out", "evictions", "copy_wait_ns", "prefetch_issued",
            "prefetch_hits", "prefetch_misses")
    return [dict(dict.fromkeys(keys, 0), name="device", kind="device", bytes_in=bytes_in,
                 evictions=evictions),
            dict(dict.fromkeys(keys, 0), name="host", kind="host")]


def _columns(rows):
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def _event(**fields):
    event = {"type": "copy", "cause": "access", "phase": "other", "trigger": "none", "ok": True,
             "from_tier": -1, "to_tier": -1, "chunk": -1, "bytes": MiB, "iteration": 1,
             "moment": 1, "start_ns": 0, "end_ns": 0, "wait_ns": 0, "next_use_distance": -1,
             "for_chunk": -1}
    event.update(fields)
    return event


def _hand_made_record():
    """Two 1 MiB chunks, a 1 MiB device budget. Iteration 0 (warm-up) copies nothing; iteration
    1 (100 ms) evicts chunk 0 (5 ms wait) to bring chunk 1 to the device (45 ms wait) and spends
    15 ms in the optimizer."""
    def sample(time, iteration, moment, end, device):
        return {"time_ns": time * MS, "iteration": iteration, "moment": moment,
                "end_of_iteration": end, "chunk_bytes": [device, 2 * MiB - device],
                "non_model_bytes": [0, 0], "budget_bytes": [MiB, 0]}
    samples = [sample(10, 0, 0, False, MiB), sample(100, 0, 1, True, MiB),
               sample(110, 1, 0, False, MiB), sample(150, 1, 1, False, MiB),
               sample(200, 1, 2, True, MiB)]
    marks = [{"kind": "end" if s["end_of_iteration"] else "tick",
              "event": "end_iteration" if s["end_of_iteration"] else "pre_forward",
              "time_ns": s["time_ns"], "measured_non_model": 0} for s in samples]
    events = [_event(type="eviction", cause="eviction", trigger="access", chunk=0, for_chunk=1,
                     from_tier=0, to_tier=1, start_ns=120 * MS, end_ns=120 * MS,
                     next_use_distance=3),
              _event(cause="eviction", chunk=0, from_tier=0, to_tier=1, start_ns=120 * MS,
                     end_ns=125 * MS, wait_ns=5 * MS),
              _event(chunk=1, from_tier=1, to_tier=0, start_ns=125 * MS, end_ns=170 * MS,
                     wait_ns=45 * MS)]
    chunk = {"kind": "compute_param", "bytes": MiB}
    return {
        "version": 1, "start_ns": 0, "stop_ns": 210 * MS,
        "run": {"precision": "fp32", "device": "cpu", "world_size": 1, "rank": 0,
                "prefetch_moments": 0, "eviction_policy": "opt"},
        "tiers": [{"name": "device", "kind": "device", "budget_bytes": MiB},
                  {"name": "host", "kind": "host", "budget_bytes": 0}],
        "device_tier": 0, "non_model_measure": "none",
        "stats_start": _stats(0, 0), "stats_end": _stats(MiB, 1),
        "layout": {"chunk_elements": MiB // 4, "wasted_bytes": 0, "oversize_tensors": [],
                   "chunks": [dict(chunk, id=0, tier="device"), dict(chunk, id=1, tier="host")]},
        "events": _columns(events), "samples": _columns(samples), "marks": marks,
        "phases": [{"name": "optimizer", "start_ns": 180 * MS, "end_ns": 195 * MS}],
        "collectives": [], "dropped": 0}


def test_findings_are_computed_from_the_record(tmp_path):
    raw = _hand_made_record()
    summary = report.write_outputs(tmp_path, raw)
    first, second = summary["time"]["iterations"]
    assert second == pytest.approx({"iteration": 1, "total_s": 0.1, "compute_s": 0.035,
                                    "move_wait_s": 0.05, "collective_s": 0.0,
                                    "optimizer_s": 0.015, "move_bytes": 2 * MiB})
    assert first["move_wait_s"] == 0
    findings = summary["findings"]
    # Both copies are charged to the device (it had no room); holding both chunks needs 2 MiB.
    assert findings[0] == ("device budget is the bottleneck: 50% of step time waits for "
                           "host->device copies; raising memory.device_budget by 1.0 MiB (to "
                           "2.0 MiB) removes them.")
    assert any(f.startswith("1 evictions moved 1.0 MiB; most often other: accessing "
                            "compute_param chunks moved compute_param chunks device->host")
               for f in findings)
    assert summary["evictions"]["top_causes"][0]["mean_next_use_distance"] == 3
    header, rows = report.memory_rows(raw)
    assert [row[header.index("device_bytes_in_total")] for row in rows] == [0, 0, 0, 0, MiB]
    # The eviction copy settled at 125 ms, before the 150 ms moment closed.
    assert [row[header.index("host_bytes_in_total")] for row in rows] == [0, 0, 0, MiB, MiB]


def _holds(budget, block_sizes):
    """Whether a real emulated device tier of `budget` holds blocks of `block_sizes` at once,
    allocated smallest first (each size takes its slab before the next size comes)."""
    from patrickstar import _C
    tier = _C.EmulatedDeviceTier(budget=budget)
    blocks = []
    try:
        for size in sorted(block_sizes):
            blocks.append(tier.allocate(size))
        return True
    except MemoryError:
        return False
    finally:
        for block in blocks:
            tier.free(block)


def test_the_budget_a_finding_asks_for_holds_the_slabs_of_the_chunks(tmp_path):
    """A budget bounds the bytes a tier's slab pool reserves, and a block size's slabs grow by
    doubling (three 4 KiB blocks take slabs of 1, 1 and 2): the finding counted only chunk
    bytes, and a tier given the budget it named could not hold the chunks (Note [Budgets bound
    the slab pool] in slab_budget.py; a 2-layer Llama with int8 state still spilled its host to
    NVMe every iteration at the host budget its report asked for). Two 1 MiB chunks and three
    4 KiB scale chunks on the device, checked against the runtime's own tier."""
    raw = _hand_made_record()
    scales = [{"kind": "momentum_scale", "bytes": 4096, "id": 2 + i, "tier": "device"}
              for i in range(3)]
    raw["layout"]["chunks"] += scales
    blocks = [MiB, MiB] + [4096] * len(scales)
    finding = report.build_summary(raw)["findings"][0]
    match = re.fullmatch(r"device budget is the bottleneck: 50% of step time waits for "
                         r"host->device copies; raising memory.device_budget by [0-9.]+ MiB "
                         r"\(to ([0-9.]+) MiB\) removes them.", finding)
    assert match, finding
    assert not _holds(sum(blocks), blocks)  # the chunk bytes alone do not fit
    assert _holds(int(float(match.group(1)) * MiB), blocks)


def test_compare_lists_a_tier_only_one_run_has_with_the_other_tiers(tmp_path, capsys):
    """`patrickstar-report --compare` appended the lines of B that A lacks at the end: the NVMe
    tier of a run with NVMe offload, set against one without, came after A's model data per
    chunk kind, where it read as one more kind."""
    without, with_nvme = tmp_path / "a", tmp_path / "b"
    report.write_outputs(without, _hand_made_record())
    raw = _hand_made_record()
    raw["tiers"].append({"name": "nvme", "kind": "nvme", "budget_bytes": 64 * MiB})
    for stats in (raw["stats_start"], raw["stats_end"]):
        stats.append(dict(stats[1], name="nvme", kind="nvme"))
    for key in ("chunk_bytes", "non_model_bytes", "budget_bytes"):
        raw["samples"][key] = [values + [0] for values in raw["samples"][key]]
    report.write_outputs(with_nvme, raw)
    for first, second in ((without, with_nvme), (with_nvme, without)):
        assert report.main(["--compare", str(first), str(second)]) == 0
        keys = [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()]
        host, nvme = keys.index("host: evictions"), keys.index("nvme: budget")
        assert nvme == host + 1, keys
        assert keys.index("nvme: evictions") < keys.index("bytes moved"), keys


def test_the_eviction_table_says_what_its_next_use_distance_counts(tmp_path):
    """report.html's eviction table gave a bare "mean next-use distance": in moments, seconds,
    iterations? It counts the chunk accesses of the warm-up trace until the victim is used
    again (chunk/event_log.h)."""
    report.write_outputs(tmp_path, _hand_made_record())
    table = (tmp_path / "report.html").read_text().split('id="evictions"')[1].split("</table>")[0]
    headers = re.findall(r"<th>(.*?)</th>", table)
    column = headers.index("mean next-use distance (chunk accesses)")
    first_row = re.findall(r"<td>(.*?)</td>", table.split("<tbody>")[1].split("</tr>")[0])
    assert first_row[column] == "3.0"  # the hand-made eviction's distance


def test_the_report_gives_what_each_tiers_slab_pool_reserved(tmp_path, nvme_dir):
    """A budget bounds the bytes a tier's slab pool reserves (Note [Budgets bound the slab
    pool] in profiling/summary.py), which the report did not give: a host that evicted to NVMe
    read as holding less than its budget. The NVMe tier's pool is its swap file, whose size on
    disk is measured here apart from the runtime; int8 Adam state puts blocks of five sizes on
    the host."""
    gpt = GPTConfig(vocab_size=512, max_seq_len=32, hidden=128, layers=2, heads=4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={
        "default_chunk_size": 1 << 15,
        "optimizer": {"type": "Adam", "params": {"state_dtype": "int8"}},
        "memory": {"device_budget": "1MiB", "host_budget": "3MiB", "nvme": {"path": nvme_dir}}})
    with patrickstar.profile(model, tmp_path):
        for ids, targets in synthetic_batches(gpt, 2, 2):
            model.backward(model(ids, targets))
            optimizer.step()
            optimizer.zero_grad()
    files = sum(path.stat().st_size for path in pathlib.Path(nvme_dir).rglob("*")
                if path.is_file())
    stats = {t["name"]: t for t in model.memory_stats()}
    model.destroy()
    tiers = json.loads((tmp_path / "summary.json").read_text())["tiers"]
    assert files > 0 and tiers["nvme"]["reserved_bytes"] == files
    for name, tier in tiers.items():
        assert tier["reserved_bytes"] == stats[name]["reserved_bytes"], name
    host = tiers["host"]
    assert host["evictions"] > 0 and host["reserved_bytes"] <= host["budget_bytes"]
    page = (tmp_path / "report.html").read_text()
    assert "<th>slab pool reserved at stop</th>" in page
    assert f"<td>{report_mib(files)}</td>" in page.split('id="tiers"')[1].split("</table>")[0]
    out = io.StringIO()
    assert report.main([str(tmp_path)], out=out) == 0
    assert re.search(rf"\nnvme: slab pool reserved at stop +{re.escape(report_mib(files))}\n",
                     out.getvalue())


def test_model_data_less_wasted_bytes_is_what_the_tensors_hold(tmp_path):
    """int8 Adam state's scale chunks (one float32 per 2048 elements: 16 bytes at 8192 elements
    per chunk) take 4 KiB blocks; summary.json's wasted_bytes left that padding out, so model
    data less wasted bytes was more than the parameters, gradients, moments and scales hold
    (Note [Wasted bytes of small chunks] in profiling/summary.py). Counted here from the
    model's parameters."""
    config = _config(optimizer={"type": "Adam", "params": {"state_dtype": "int8"}})
    model, optimizer = _model(config)
    with patrickstar.profile(model, tmp_path):
        _train(model, optimizer, 1)
    model.destroy()
    chunks = json.loads((tmp_path / "summary.json").read_text())["chunks"]
    sizes = [p.numel() for p in dict.fromkeys(GPT(GPT_CONFIG).parameters())]  # tied: once
    # fp32 parameters and gradients, uint8 momentum and variance, a float32 scale of each per
    # 2048 elements
    held = sum(n * (4 + 4 + 1 + 1) + 2 * 4 * -(-n // 2048) for n in sizes)
    assert chunks["by_kind"]["momentum_scale"]["bytes"] % 4096 == 0
    assert chunks["model_data_bytes"] - chunks["wasted_bytes"] == held


def test_sizes_of_a_gib_and_more_print_in_gib(tmp_path):
    """An NVMe tier's budget (the free space of its disk when none is set) printed as
    "74399.0 MiB" in report.html and `patrickstar-report`: sizes from 1 GiB up print in GiB,
    smaller ones stay in MiB (and KiB)."""
    assert report_mib(74399 * MiB) == "72.66 GiB"
    assert report_mib(1023 * MiB) == "1023.0 MiB" and report_mib(4096) == "4.0 KiB"
    raw = _hand_made_record()
    raw["tiers"].append({"name": "nvme", "kind": "nvme", "budget_bytes": 74399 * MiB})
    for stats in (raw["stats_start"], raw["stats_end"]):
        stats.append(dict(stats[1], name="nvme", kind="nvme", budget_bytes=74399 * MiB))
    for key in ("chunk_bytes", "non_model_bytes"):
        raw["samples"][key] = [values + [0] for values in raw["samples"][key]]
    raw["samples"]["budget_bytes"] = [values + [74399 * MiB]
                                      for values in raw["samples"]["budget_bytes"]]
    report.write_outputs(tmp_path, raw)
    page = (tmp_path / "report.html").read_text()
    out = io.StringIO()
    assert report.main([str(tmp_path)], out=out) == 0
    assert re.search(r"\nnvme: budget +72\.66 GiB\n", out.getvalue()), out.getvalue()
    assert "<td>72.66 GiB</td>" in page.split('id="tiers"')[1].split("</table>")[0]
    for text in (page, out.getvalue()):
        assert "74399.0 MiB" not in text


@pytest.mark.parametrize("chunk, width", [(1 << 12, 32), (1 << 20, 256)])
def test_the_waste_finding_offers_auto_only_where_it_would_pick_smaller_chunks(tmp_path, chunk,
                                                                               width):
    """Before: a 1,089-parameter model in 4096-element chunks was told that "auto" searches
    for a tighter size, but on one process "auto" keeps chunks of 65536 elements at least. The
    66,049-parameter model runs in chunks of 131072 elements (Note [Chunks no larger than the
    model]), above that floor."""
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(
        lambda: torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1)),
        config={"default_chunk_size": chunk})
    assert model.config.default_chunk_size == (chunk if width == 32 else 1 << 17)
    with patrickstar.profile(model, tmp_path / "p"):
        model(torch.randn(4, width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    waste = [f for f in json.loads((tmp_path / "p" / "summary.json").read_text())["findings"]
             if f.startswith("chunks waste")]
    assert len(waste) == 1
    if chunk > 1 << 16:
        assert waste[0].endswith('default_chunk_size "auto" searches for a tighter size.')
    else:
        assert waste[0].endswith('a smaller default_chunk_size wastes less ("auto" keeps at '
                                 'least 65536 elements per chunk here).')
    model.destroy()
