"""Bad input and injected faults end in clear errors without changing state (issue 10)."""
from __future__ import annotations

import errno
import gc
import math
import os
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.config import load_config

from test_checkpoint import DropoutMLP, base_config, batches, full_state, assert_identical


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def make(config, model_func=MLP):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(model_func, config=config)


def step(model, opt, x, y):
    loss = model(x, y)
    model.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


# ---- Config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"gradient_acumulation_steps": 2}, "did you mean 'gradient_accumulation_steps'?"),
    ({"optimizer": {"parms": {}}}, "'optimizer.parms'; did you mean 'optimizer.params'"[:16]),
    ({"optimizer": {"params": {"weight_decy": 0.1}}}, "did you mean 'weight_decay'?"),
    ({"memory": {"nvme": {"pth": "/tmp"}}}, "did you mean 'path'?"),
    ({"fp16": {"enable": True}}, "did you mean 'enabled'?"),
    ({"bf61": {}}, "did you mean 'bf16'?"),
])
def test_typos_suggest_the_nearest_key(config, message):
    with pytest.raises(ValueError) as info:
        load_config(config)
    assert message in str(info.value)


def test_unrelated_unknown_key_gets_no_suggestion():
    with pytest.raises(ValueError) as info:
        load_config({"zzzz": 1})
    assert "did you mean" not in str(info.value) and "known keys here" in str(info.value)


@pytest.mark.parametrize("config, message", [
    ({"gradient_clipping": "1.0"}, "'gradient_clipping': expected a number, got str"),
    ({"gradient_accumulation_steps": 2.5}, "'gradient_accumulation_steps': expected an integer"),
    ({"optimizer": []}, "'optimizer': expected an object, got list"),
    ({"bf16": {"enabled": 1}}, "'bf16.enabled': expected true or false, got int"),
    ({"memory": {"nvme": {"path": 5}}}, "'memory.nvme.path': expected a directory path"),
    ({"nonfinite_loss": "ignore"}, "'nonfinite_loss': expected \"raise\" or \"skip\""),
    ({"parallel": {"remake_compute": "yes"}},
     "'parallel.remake_compute': expected true, false or \"auto\", got str"),
])
def test_wrong_types_name_key_and_type(config, message):
    with pytest.raises(ValueError) as info:
        load_config(config)
    assert message in str(info.value)


# ---- Budgets and chunk sizes ---------------------------------------------------------------------

def test_device_budget_below_one_parameters_chunks(tmp_path):
    # 4096-element fp32 chunks (16 KiB): module a needs its compute and a gradient chunk at once.
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 4096, "memory": {"device_budget": 20000}})
    message = str(info.value)
    assert "'memory.device_budget' = 20000 bytes" in message
    assert "32768 bytes" in message and "default_chunk_size=4096" in message
    make({"default_chunk_size": 4096, "memory": {"device_budget": 32768}})  # exactly enough


def test_chunk_size_too_large_for_the_device_budget():
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="memory.device_budget"):
        # (this model's chunks are 64Ki elements, 256 KiB: Note [Chunks no larger than the
        # model])
        make({"default_chunk_size": 1 << 20, "memory": {"device_budget": "128KiB"}})
    with pytest.raises(ValueError, match="'default_chunk_size': must be >= 1"):
        make({"default_chunk_size": 0})


def test_host_budget_below_one_adam_update_and_total_without_nvme(nvme_dir):
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="one Adam update"):
        make({"default_chunk_size": 4096, "memory": {"host_budget": 30000,
                                                     "nvme": {"path": nvme_dir}}})
    # 9 x Linear(16, 16) in 1024-element (4 KiB) chunks: 3 chunks per kind, 36 KiB of
    # parameters and Adam state; device 12 KiB + host 16 KiB pass the per-update checks but
    # cannot hold them all without an NVMe tier.
    def deep():
        return nn.Sequential(*(nn.Linear(16, 16) for _ in range(9)))

    budgets = {"device_budget": 12288, "host_budget": 16384}
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="no NVMe tier"):
        make({"default_chunk_size": 1024, "memory": budgets}, deep)
    make({"default_chunk_size": 1024, "memory": {**budgets, "nvme": {"path": nvme_dir}}}, deep)


def test_host_budget_errors_of_mostly_empty_chunks_name_the_chunk_size(monkeypatch):
    """Note [Budgets a smaller chunk would meet]. Before: a small model in chunks far larger
    than it was refused a host budget for its Adam state with no word of the chunk size, which
    is what made that state large."""
    def deep():  # 9 x Linear(16, 16): 2448 parameters
        return nn.Sequential(*(nn.Linear(16, 16) for _ in range(9)))

    # Such a model now gets 64 Ki-element chunks (Note [Chunks no larger than the model]): its
    # Adam state fits a 600 KiB host budget.
    model, _ = make({"default_chunk_size": 1 << 17, "memory": {"host_budget": 600 << 10}}, deep)
    assert model.config.default_chunk_size == 1 << 16
    model.destroy()
    # Chunks as large as given: one 128 Ki-element (512 KiB) compute chunk fits a 600 KiB host
    # budget; its two moment chunks (1 MiB) do not.
    monkeypatch.setattr(patrickstar.engine, "fitted_chunk_size", lambda size, total: size)
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 1 << 17, "memory": {"host_budget": 600 << 10}}, deep)
    monkeypatch.undo()
    message = str(info.value)
    assert "optimizer state" in message
    assert "2448 parameters fill 1.9% of their 1 chunk(s) of default_chunk_size=131072 " \
        'elements (chunks are allocated whole): a smaller default_chunk_size (or "auto") ' \
        "needs less" in message
    # Chunks already below what "auto" picks (65536 elements on one process): no "auto".
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 1 << 14, "memory": {"host_budget": 80 << 10}}, deep)
    assert "fill 15% of their 1 chunk(s) of default_chunk_size=16384 elements (chunks are " \
        "allocated whole): a smaller default_chunk_size needs less" in str(info.value)
    # Chunks the parameters fill (2448 of 3 x 1024 elements) get no such hint.
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 1024, "memory": {"host_budget": 16384}}, deep)
    assert "optimizer state" in str(info.value) and "fill" not in str(info.value)


def test_host_budget_below_the_optimizer_state_without_nvme_is_refused_at_initialize():
    # 9 x Linear(16, 16) in 1024-element (4 KiB) fp32 chunks: 3 compute chunks (12 KiB, what
    # initialization writes on the host) and 3 + 3 moment chunks (24 KiB) that the first
    # optimizer.step() makes on the host, where they stay without an NVMe tier. A host budget
    # between the two passed initialize() and failed inside the first step ("it is the last
    # tier, with nowhere to evict to"), after the forward and backward had run.
    def deep():
        return nn.Sequential(*(nn.Linear(16, 16) for _ in range(9)))

    def train(memory):
        model, opt = make({"default_chunk_size": 1024, "memory": memory}, deep)
        torch.manual_seed(1)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 16)).square().mean()
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.destroy()
        return losses

    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 1024, "memory": {"host_budget": 20480}}, deep)
    message = str(info.value)
    assert "'memory.host_budget' = 20480 bytes" in message and "24576 bytes" in message
    assert "memory.nvme.path" in message and "state_dtype" in message
    # Room for the state and this model's activations (non-model data on a CPU build) trains
    # as with no budget at all.
    assert train({"host_budget": 24576 + 65536}) == train({})


def test_host_and_nvme_budgets_below_the_optimizer_state_are_refused_at_initialize(nvme_dir):
    # The same 24 KiB of moments (9 x Linear(16, 16), 4 KiB chunks) with an NVMe tier: host
    # 8 KiB + NVMe 8 KiB cannot hold them. It failed inside training, or inside initialize()
    # as "access tensor ...: evicting from 'host' ... tier 'nvme' cannot take ...", naming no
    # config key.
    def deep():
        return nn.Sequential(*(nn.Linear(16, 16) for _ in range(9)))

    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        make({"default_chunk_size": 1024, "memory": {
            "host_budget": 8192, "nvme": {"path": nvme_dir, "budget": 8192}}}, deep)
    message = str(info.value)
    assert "'memory.host_budget' + 'memory.nvme.budget' = 16384 bytes" in message
    assert "24576 bytes" in message


def test_nvme_path_missing_or_not_writable(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        make({"memory": {"nvme": {"path": str(missing)}}})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(a_file)):
        make({"memory": {"nvme": {"path": str(a_file)}}})
    # A read-only filesystem (root ignores directory permissions, not a read-only mount).
    readonly = "/proc/self"
    with pytest.raises(OSError) as info:
        make({"memory": {"nvme": {"path": readonly}}})
    assert info.value.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT)
    assert readonly in str(info.value)


# ---- Call order --------------------------------------------------------------------------------

def test_step_before_backward_changes_nothing():
    # torch's step skips parameters without p.grad (Note [A step without gradients]).
    model, opt = make({"default_chunk_size": 4096})
    before = full_state(model, opt)
    opt.step()
    assert_identical(before, full_state(model, opt))
    x, y = batches(1)[0]
    step(model, opt, x, y)  # the engine still works
    before = full_state(model, opt)
    opt.step()  # again: no backward since the last step
    assert_identical(before, full_state(model, opt))
    assert model.global_steps == 1


def test_backward_twice_needs_gradient_accumulation():
    # With the key given (without it, one rank sums as PyTorch does: test_recipes_classic.py).
    model, opt = make({"default_chunk_size": 4096, "gradient_accumulation_steps": 1})
    (x, y), (x2, y2) = batches(2)
    model.backward(model(x, y))
    # A DDP loop's `with model.no_sync(): loss.backward()` needs the config key: say so.
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps is 1") as error:
        with model.no_sync():
            model.backward(model(x2, y2))
    assert "model.no_sync() changes nothing" in str(error.value)
    opt.step(), opt.zero_grad()

    model, opt = make({"default_chunk_size": 4096, "gradient_accumulation_steps": 2})
    model.backward(model(x, y))
    model.backward(model(x2, y2))
    opt.step(), opt.zero_grad()
    model.backward(model(x, y))
    model.backward(model(x2, y2))
    with pytest.raises(RuntimeError, match="called 3 times"):
        model.backward(model(x, y))


ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


@pytest.mark.parametrize("clip", [None, "config", "torch"])
def test_a_short_last_accumulation_steps_as_in_pytorch(clip):
    # Note [Training call order]: the epoch-end step of a PyTorch / Trainer / accelerate loop
    # after fewer micro-batches than gradient_accumulation_steps applies what was accumulated
    # (each loss divided by the full count), as torch's optimizer.step() does. It raised.
    accumulation, epoch = 3, 5  # steps after micro-batches 3, 5 (short), 8, 10 (short)
    config = {"default_chunk_size": 4096, "optimizer": ADAMW,
              "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 0.05 if clip == "config" else 0.0}
    model, opt = make(config)
    torch.manual_seed(0)
    reference = MLP()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    data = batches(2 * epoch)
    for position, (x, y) in enumerate(data):
        model.backward(model(x, y))
        (reference(x, y) / accumulation).backward()
        in_epoch = position % epoch
        if (in_epoch + 1) % accumulation == 0 or in_epoch + 1 == epoch:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            if clip == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step(), torch_opt.step()
            opt.zero_grad(), torch_opt.zero_grad()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_zero_grad_between_steps_drops_the_backwards_as_in_pytorch(accumulation):
    # Note [Training call order]: zero_grad() without a step starts the next accumulation (it
    # raised "called 2 times since the last optimizer.step()" at the next backward before).
    model, opt = make({"default_chunk_size": 4096, "optimizer": ADAMW,
                       "gradient_accumulation_steps": accumulation})
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    data = batches(2 + 2 * accumulation)
    dropped, kept = data[:2], data[2:]
    for step_batches in (kept[:accumulation], kept[accumulation:]):
        for x, y in dropped[:1 if accumulation == 1 else 2]:  # a whole step, or part of one
            model.backward(model(x, y))
            reference(x, y).backward()
        opt.zero_grad()
        ref_opt.zero_grad()
        for x, y in step_batches:
            model.backward(model(x, y))
            (reference(x, y) / accumulation).backward()
        opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-6)


def test_ddp_no_sync_accumulation_idiom_trains_as_pytorch():
    model, opt = make({"default_chunk_size": 4096, "optimizer": ADAMW,
                       "gradient_accumulation_steps": 2})
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    (x, y), (x2, y2) = batches(2)
    with model.no_sync():
        (model(x, y) / 2).backward()
    (model(x2, y2) / 2).backward()
    opt.step(), opt.zero_grad()
    ((reference(x, y) + reference(x2, y2)) / 2).backward()
    ref_opt.step()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_loss_raises_by_default_and_changes_nothing(precision):
    model, opt = make(base_config(precision), DropoutMLP)
    x, y = batches(1)[0]
    step(model, opt, x, y)
    loss = model(x, y)  # (the forward updates BatchNorm's running statistics)
    before = full_state(model, opt)
    with pytest.raises(FloatingPointError, match="nonfinite_loss"):
        model.backward(loss * float("nan"))
    assert_identical(before, full_state(model, opt))
    opt.step()  # the failed backward does not count: no gradients, nothing changes
    assert_identical(before, full_state(model, opt))
    step(model, opt, x, y)


def _trained(state: dict) -> dict:
    return {k: v for k, v in state.items() if "norm." not in k}  # not BatchNorm's buffers


def test_nonfinite_loss_skip_policy_skips_the_step():
    model, opt = make({**base_config("fp32"), "nonfinite_loss": "skip",
                       "gradient_accumulation_steps": 2}, DropoutMLP)
    x, y = batches(1)[0]
    before = full_state(model, opt)
    model.backward(model(x, y))
    model.backward(model(x, y) * float("inf"))  # one bad micro-step spoils the step
    opt.step(), opt.zero_grad()
    assert opt.skipped_steps == 1
    assert_identical(_trained(before), _trained(full_state(model, opt)))
    model.backward(model(x, y))
    model.backward(model(x, y))
    opt.step(), opt.zero_grad()
    assert opt.skipped_steps == 1
    assert not math.isnan(model.state_dict()["layers.0.weight"].sum().item())


def test_use_after_destroy():
    model, opt = make({"default_chunk_size": 4096})
    x, y = batches(1)[0]
    step(model, opt, x, y)
    saved = opt.state_dict()
    param = opt.param_groups[0]["params"][0]
    model.destroy()
    # The optimizer's reads and loads named a call the script never made ("the chunk manager
    # was closed"), from deep inside the chunk reads.
    for call in (lambda: model(x, y), lambda: opt.step(),
                 lambda: model.backward(torch.tensor(1.0)), lambda: opt.state_dict(),
                 lambda: opt.load_state_dict(saved), lambda: opt.state[param]):
        with pytest.raises(RuntimeError, match="engine was deleted or destroyed"):
            call()


# ---- Faults ------------------------------------------------------------------------------------

FAULT_CONFIG = {"default_chunk_size": 4096,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _tight(nvme_dir):
    # Device 3 and host 4 fp32 chunks of the 8 the model needs (compute, gradient, 2 x Adam
    # state): every step moves chunks across all three tiers.
    return {**FAULT_CONFIG, "memory": {"device_budget": 3 * 16384, "host_budget": 4 * 16384,
                                       "nvme": {"path": nvme_dir}}}


def _copies(model) -> int:
    return sum(tier["chunks_in"] for tier in model.memory_stats())


def _assert_clean_teardown(model, nvme_dir):
    tiers = list(model.tiers)
    model.destroy()
    gc.collect()
    for tier in tiers:
        stats = tier.stats()
        assert stats["bytes"]["current"] == 0 and stats["blocks"]["current"] == 0, tier.name
        tier.trim()
        assert tier.stats()["reserved_bytes"] == 0, tier.name
    assert any(name.endswith(".swap") for name in os.listdir(nvme_dir))
    del tiers, stats, tier
    gc.collect()
    assert os.listdir(nvme_dir) == []  # the swap file went with its tier


@pytest.mark.parametrize("spec, error", [
    ("copy:after={n}", errno.EIO),
    ("nvme_write:after={n}:errno=28", errno.ENOSPC),
    ("nvme_read:after={n}", errno.EIO),
    ("any:p=0.05:seed=3", errno.EIO),
])
def test_injected_faults_end_training_with_a_clear_error(tmp_path, nvme_dir, monkeypatch, spec,
                                                         error):
    data = batches(40)
    model, opt = make(_tight(nvme_dir), DropoutMLP)
    for x, y in data[:2]:
        step(model, opt, x, y)
    model.save_checkpoint(tmp_path, tag="good")
    reference = full_state(model, opt)
    copies = _copies(model)
    assert model.memory_stats()[2]["chunks_in"] > 0  # NVMe is in use
    model.destroy()
    del model, opt
    gc.collect()

    # The faulty run resumes from "good", trains and saves every 3 steps until the fault.
    monkeypatch.setenv("PATRICKSTAR_FAULT_INJECT", spec.format(n=copies))
    model, opt = make(_tight(nvme_dir), DropoutMLP)
    with pytest.raises(OSError) as info:
        model.load_checkpoint(tmp_path, tag="good")
        for index, (x, y) in enumerate(data[2:]):
            step(model, opt, x, y)
            if index % 3 == 2:
                model.save_checkpoint(tmp_path, tag=f"s{index}")
    assert info.value.errno == error
    # A copy fault says so; an NVMe fault reads like the real error: file, offset, bytes.
    assert "injected copy fault" in str(info.value) or nvme_dir in str(info.value)
    _assert_clean_teardown(model, nvme_dir)
    monkeypatch.delenv("PATRICKSTAR_FAULT_INJECT")
    assert not [name for name in os.listdir(tmp_path) if "partial" in name]
    fresh, fresh_opt = make(_tight(nvme_dir), DropoutMLP)
    path, _ = fresh.load_checkpoint(tmp_path)  # whatever `latest` names is complete
    if os.path.basename(os.path.dirname(path)) == "good":
        assert_identical(reference, full_state(fresh, fresh_opt))
    fresh.load_checkpoint(tmp_path, tag="good")
    assert_identical(reference, full_state(fresh, fresh_opt))
    fresh.destroy()


def test_fault_while_saving_keeps_the_previous_checkpoint(tmp_path, nvme_dir, monkeypatch):
    x, y = batches(1)[0]
    model, opt = make(_tight(nvme_dir), DropoutMLP)
    step(model, opt, x, y)
    reads = model.memory_stats()[2]["chunks_out"]
    model.destroy()
    # The same run again, with every NVMe read after the first step's failing.
    monkeypatch.setenv("PATRICKSTAR_FAULT_INJECT", f"nvme_read:after={reads}:count=0")
    model, opt = make(_tight(nvme_dir), DropoutMLP)
    step(model, opt, x, y)
    (tmp_path / "latest").write_text("previous\n")
    with pytest.raises(OSError, match=".swap"):
        model.save_checkpoint(tmp_path, tag="new")  # reading NVMe-resident state fails
    assert (tmp_path / "latest").read_text() == "previous\n"
    assert os.listdir(tmp_path) == ["latest"]  # no partial directory left behind
    _assert_clean_teardown(model, nvme_dir)
