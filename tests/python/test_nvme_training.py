"""NVMe as a third tier in training (issue 7): optimizer state streamed from disk through the
optimizer sweep (Note [Optimizer sweep] in optimizer.py), bit for bit the same training as in
memory, host use under a budget smaller than the optimizer state, and IO faults during the sweep
ending in clear errors with nothing lost."""
from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from torch import nn

import patrickstar

from test_checkpoint import train as checkpoint_train

CHUNK = 4096  # elements: 16 KiB fp32 chunks


class DeepMLP(nn.Module):
    def __init__(self, width=64, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x, y):
        x = x.to(self.head.weight.dtype)  # bf16 runs compute in bf16
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x).float(), y)


def batches(steps, width=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, width, generator=generator),
             torch.randint(0, 10, (16,), generator=generator)) for _ in range(steps)]


def make(config, model_func=DeepMLP):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(model_func, config=config)


def train(model, opt, data):
    """Per-step losses as tensors (compared bit for bit)."""
    return [torch.tensor(loss) for loss in checkpoint_train(model, opt, data)]


def config(precision="fp32", **memory):
    result = {"default_chunk_size": CHUNK,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    if precision == "bf16":
        result["bf16"] = {"enabled": True}
    if memory:
        result["memory"] = memory
    return result


def nvme_stats(model) -> dict:
    return next(tier for tier in model.memory_stats() if tier["kind"] == "nvme")


def tier_stats(model, kind) -> dict:
    return next(tier for tier in model.memory_stats() if tier["kind"] == kind)


def params(model) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _state_bytes(model) -> int:
    """Bytes of the chunks of optimizer state (fp32 masters, momentum, variance)."""
    layout = json.loads(model.chunks.layout_json())
    return sum(chunk["bytes"] for chunk in layout["chunks"]
               if chunk["kind"] in ("momentum", "variance", "master_param"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_on_nvme_trains_bit_for_bit_like_memory(nvme_dir, precision):
    data = batches(10)
    reference, reference_opt = make(config(precision))
    expected_losses = train(reference, reference_opt, data)
    expected = params(reference)
    expected_opt = reference_opt.state_dict()["state"]
    reference.destroy()

    # The host holds 4 chunks (and the activations); the 14 chunks of Adam state (and master
    # copies in bf16) live on NVMe and stream through the host every step.
    model, opt = make(config(precision, host_budget=4 * 4 * CHUNK, nvme={"path": nvme_dir}))
    losses = train(model, opt, data)
    nvme = nvme_stats(model)
    assert nvme["chunk_bytes"] >= _state_bytes(model) - 4 * 4 * CHUNK
    assert nvme["chunks_out"] >= 10 * 10  # read back every step
    assert tier_stats(model, "host")["peak_chunk_bytes"] <= 4 * 4 * CHUNK
    for got, want in zip(losses, expected_losses):
        assert torch.equal(got, want)
    for name, value in params(model).items():
        assert torch.equal(value, expected[name]), name
    state = opt.state_dict()["state"]
    for index, entry in expected_opt.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key], entry[key]), (index, key)
    model.destroy()


def test_sweep_overlaps_reads_and_write_backs(nvme_dir):
    """Reads are started ahead (prefetch counted on the host) and write-backs settle without
    evicting: the ring keeps about three rows of NVMe state on the host."""
    # Room for three rows of state (momentum + variance) next to the activations.
    model, opt = make(config(host_budget=7 * 4 * CHUNK, nvme={"path": nvme_dir}))
    train(model, opt, batches(4))
    host = tier_stats(model, "host")
    assert host["prefetch_issued"] > 0 and host["prefetch_hits"] > 0
    first = dict(host)
    train(model, opt, batches(2, seed=1))
    host = tier_stats(model, "host")
    # Every NVMe chunk of a step is read ahead: no synchronous miss on the host in steady state.
    assert host["prefetch_misses"] == first["prefetch_misses"]
    model.destroy()


class WideMLP(DeepMLP):
    def __init__(self):
        super().__init__(width=512, depth=8)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_budget_smaller_than_optimizer_state(nvme_dir):
    """bf16: 2.1M parameters carry 25 MiB of fp32 master + Adam state; device and host budgets
    together hold well under that. Training proceeds; tier statistics and the process RSS stay
    within the budgets (plus a bound for torch's own temporaries)."""
    chunk = 1 << 18  # 512 KiB bf16 compute chunks, 1 MiB fp32 state chunks
    device_budget, host_budget = 12 << 20, 4 << 20
    cfg = config("bf16", device_budget=device_budget, host_budget=host_budget,
                 nvme={"path": nvme_dir})
    cfg["default_chunk_size"] = chunk
    cfg["optimizer"]["params"]["lr"] = 1e-3
    gc.collect()
    baseline = _rss_bytes()
    model, opt = make(cfg, WideMLP)
    state_bytes = _state_bytes(model)
    assert state_bytes > 2 * (device_budget + host_budget) - (8 << 20)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        losses = train(model, opt, batches(1, width=512) * 4)  # one batch: loss must fall
    finally:
        stop.set()
        sampler.join()
    assert all(torch.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    for tier, budget in (("device", device_budget), ("host", host_budget)):
        assert tier_stats(model, tier)["peak_chunk_bytes"] <= budget, tier
    assert nvme_stats(model)["chunk_bytes"] >= state_bytes - device_budget - host_budget
    # Torch's temporaries: activations of a 16 x 512 batch and one layer's gradient at a time,
    # well under 8 MiB; the optimizer state alone would add 25 MiB.
    # (Not under ASan, tools/test_python_asan.sh: its shadow memory and the quarantine of freed
    # blocks, 256 MiB by default, are in the RSS too.)
    growth = peak[0] - baseline
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        assert growth < device_budget + host_budget + (8 << 20), growth / 2**20
    model.destroy()


# ---- Faults in the sweep (Note [Optimizer sweep]) ----------------------------------------------

def _nvme_reads_and_writes(model) -> tuple[int, int]:
    nvme = nvme_stats(model)
    return nvme["chunks_out"], nvme["chunks_in"]


@pytest.mark.parametrize("site, spec, error", [
    ("write", "nvme_write:after={n}:errno=28", errno.ENOSPC),
    ("write", "nvme_write:after={n}", errno.EIO),
    ("write", "nvme_write:after={n}:errno=13", errno.EACCES),
    ("write", "nvme_write:after={n}:short=1", None),
    ("read", "nvme_read:after={n}", errno.EIO),
    ("read", "nvme_read:after={n}:short=1", None),
])
def test_io_fault_in_the_sweep_is_clear_and_loses_nothing(tmp_path, nvme_dir, monkeypatch, site,
                                                          spec, error):
    data = batches(4)
    budgets = {"host_budget": 3 * 4 * CHUNK, "nvme": {"path": nvme_dir}}
    model, opt = make(config(**budgets))
    train(model, opt, data[:1])
    model.save_checkpoint(tmp_path, tag="good")
    expected = params(model)
    model.destroy()
    del model, opt
    gc.collect()

    # IO pieces per chunk: the fault lands inside the second step's optimizer sweep.
    monkeypatch.setenv("PATRICKSTAR_FAULT_INJECT", "nvme:p=0")  # counts nothing, fails nothing
    model, opt = make(config(**budgets))
    model.load_checkpoint(tmp_path, tag="good")
    loss = model(*data[1])
    model.backward(loss)
    reads, writes = _nvme_reads_and_writes(model)
    model.destroy()
    del model, opt
    gc.collect()

    n = (reads if site == "read" else writes) + 2
    monkeypatch.setenv("PATRICKSTAR_FAULT_INJECT", spec.format(n=n))
    model, opt = make(config(**budgets))
    model.load_checkpoint(tmp_path, tag="good")
    loss = model(*data[1])
    model.backward(loss)
    # An errno from the disk is an OSError with that errno; a short transfer is data loss.
    with pytest.raises(OSError if error is not None else patrickstar.ChunkRuntimeError) as info:
        opt.step()
    message = str(info.value)
    assert nvme_dir in message and "offset" in message and "bytes" in message, message
    if error is not None:
        assert info.value.errno == error
    else:
        assert "short" in message
    # Half a step was applied: training refuses to go on until a checkpoint is loaded.
    with pytest.raises(RuntimeError, match="failed partway"):
        model(*data[1])
    with pytest.raises(RuntimeError, match="failed partway"):
        opt.step()
    monkeypatch.delenv("PATRICKSTAR_FAULT_INJECT")
    model.load_checkpoint(tmp_path, tag="good")
    for name, value in params(model).items():
        assert torch.equal(value, expected[name]), name
    train(model, opt, data[1:2])  # and it trains again
    model.destroy()


@pytest.mark.parametrize("verify", [True, False])
def test_swap_bytes_changed_on_disk_are_caught_before_training_on_them(tmp_path, nvme_dir,
                                                                         verify):
    # Note [NVMe checksums]: the optimizer state read back from a swap file whose bytes changed
    # (the disk, the filesystem, another process) failed nothing and trained on them silently.
    data = batches(3)
    budgets = {"host_budget": 3 * 4 * CHUNK, "nvme": {"path": nvme_dir, "verify": verify}}
    model, opt = make(config(**budgets))
    train(model, opt, data[:1])
    model.save_checkpoint(tmp_path, tag="good")
    expected = params(model)
    (swap,) = [os.path.join(nvme_dir, name) for name in os.listdir(nvme_dir)
               if name.endswith(".swap")]
    with open(swap, "r+b") as handle:  # every byte of the file changed
        contents = bytearray(handle.read())
        handle.seek(0)
        handle.write(bytes(byte ^ 0x5A for byte in contents))
    if not verify:
        train(model, opt, data[1:2])  # the changed bytes were taken as weights and state
        model.destroy()
        return
    with pytest.raises(patrickstar.ChunkRuntimeError) as info:  # the forward's or the step's
        train(model, opt, data[1:2])
    message = str(info.value)
    assert "checksum mismatch" in message and swap in message and "offset" in message, message
    # The swap file's data is gone; a new engine (a new swap file) resumes from the checkpoint.
    model.destroy()
    model, opt = make(config(**budgets))
    model.load_checkpoint(tmp_path, tag="good")
    for name, value in params(model).items():
        assert torch.equal(value, expected[name]), name
    train(model, opt, data[1:])
    model.destroy()


def test_stale_swap_file_of_a_dead_run_is_removed_with_a_message(nvme_dir, capfd):
    stale = os.path.join(nvme_dir, "patrickstar-999999999-0.swap")
    with open(stale, "wb") as handle:
        handle.write(b"\0" * 4096)
    model, opt = make(config(host_budget=3 * 4 * CHUNK, nvme={"path": nvme_dir}))
    assert not os.path.exists(stale)
    assert "stale" in capfd.readouterr().err
    model.destroy()


def test_restart_with_a_stale_swap_file_of_its_own_pid_starts(nvme_dir):
    """A restarted container gets the same small pid as the run that left its swap file: the
    new process must start (Note [Swap file ownership] in runtime/nvme_tier.h)."""
    script = textwrap.dedent(f"""
        import os, warnings, torch, patrickstar
        stale = os.path.join({nvme_dir!r}, f"patrickstar-{{os.getpid()}}-0.swap")
        with open(stale, "wb") as handle:
            handle.write(b"x" * 4096)
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(lambda: torch.nn.Linear(64, 64), config={{
            "default_chunk_size": 4096, "memory": {{"nvme": {{"path": {nvme_dir!r}}}}}}})
        assert not os.path.exists(stale), "the stale file of this pid was not removed"
        model.destroy()
        print("started")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "started" in result.stdout
    assert os.listdir(nvme_dir) == []


def test_swap_file_locked_by_a_process_of_another_pid_namespace_is_kept(nvme_dir):
    """Its pid (not running here) says nothing; the lock its live owner holds does."""
    other = os.path.join(nvme_dir, "patrickstar-999999999-0.swap")
    with open(other, "wb") as handle:
        handle.write(b"x" * 4096)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        model, opt = make(config(host_budget=3 * 4 * CHUNK, nvme={"path": nvme_dir}))
        assert os.path.exists(other)
        model.destroy()
    os.unlink(other)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pytorch_accumulation_without_the_key_streams_gradients_through_nvme(nvme_dir,
                                                                           precision):
    # Note [PyTorch's accumulation without the key] in guards.py: three loss.backward() calls
    # per step add into gradient chunks that may have gone to NVMe between them; the result is
    # the in-memory run's, bit for bit.
    data = batches(9)

    def accumulate(model, opt):
        for step in range(3):
            for x, y in data[3 * step:3 * step + 3]:
                (model(x, y) / 3).backward()
            opt.step(), opt.zero_grad()
        return params(model)

    expected = accumulate(*make(config(precision)))
    got = accumulate(*make(config(precision, host_budget=4 * 4 * CHUNK,
                                  nvme={"path": nvme_dir})))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    if precision == "bf16":  # summed in bf16 chunks: near the fp32 accumulators' result
        keyed = accumulate(*make({**config(precision), "gradient_accumulation_steps": 3}))
        for name, value in keyed.items():
            torch.testing.assert_close(got[name].float(), value.float(), rtol=0.05, atol=0.02,
                                       msg=name)
