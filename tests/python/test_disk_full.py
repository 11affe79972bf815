"""A full disk during a long run (found probing a week-long run's failure paths): a checkpoint
save into a full filesystem fails naming the file, the bytes and the free space, keeps the
previous checkpoint loadable and leaves no temporary file; training goes on, and a save after
space is freed works. The NVMe tier on a filesystem smaller than its budget fails naming the
full disk and the swap file. The filesystems are small tmpfs mounts (root only; skipped
otherwise)."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import warnings

import pytest
import torch

import patrickstar
from patrickstar.checkpoint import atomic_files

from test_checkpoint import batches, full_state, make, train, assert_identical

CONFIG = {"default_chunk_size": 4096,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


@contextlib.contextmanager
def _tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory):
    """Fills the filesystem of `directory`; returns the filler file."""
    filler = os.path.join(directory, "filler")
    with open(filler, "wb") as handle:
        with contextlib.suppress(OSError):
            while True:
                handle.write(bytes(1 << 16))
                handle.flush()
    return filler


def test_save_into_a_full_filesystem_names_the_file_and_keeps_the_last_checkpoint(tmp_path):
    with _tmpfs(tmp_path / "small", "4M") as directory:
        model, opt = make(CONFIG)
        train(model, opt, batches(2))
        model.save_checkpoint(directory, tag="good")
        saved = full_state(model, opt)
        filler = _fill(directory)
        train(model, opt, batches(1))
        with pytest.raises(OSError) as info:
            model.save_checkpoint(directory, tag="next")
        message = str(info.value)
        # Before: "[Errno 28] No space left on device", naming neither file nor size.
        assert info.value.errno == errno.ENOSPC
        assert "rank_00000.shard" in message and str(directory) in message, message
        assert "bytes free on its filesystem" in message and " of " in message, message
        assert sorted(os.listdir(directory)) == ["filler", "good", "latest"]
        assert (directory / "latest").read_text().strip() == "good"
        train(model, opt, batches(1))  # training goes on
        os.unlink(filler)
        model.save_checkpoint(directory, tag="next")
        fresh, fresh_opt = make(CONFIG)
        fresh.load_checkpoint(directory, tag="good")
        assert_identical(full_state(fresh, fresh_opt), saved)
        for engine in (model, fresh):
            engine.destroy()


def test_a_failed_write_of_latest_names_it_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    """`latest` is written through `latest.tmp-*`: a full disk there used to leave the temporary
    file in the checkpoint directory for good (no later save removes it), and the error was a
    bare "[Errno 28] No space left on device"."""
    model, opt = make(CONFIG)
    train(model, opt, batches(1))
    model.save_checkpoint(tmp_path, tag="good")
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith("latest.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(atomic_files.os, "fsync", fsync)
    with pytest.raises(OSError, match="latest.tmp") as info:
        model.save_checkpoint(tmp_path, tag="next")
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    # The new tag is complete; `latest` still names the old one, and no temporary file is left.
    assert sorted(os.listdir(tmp_path)) == ["good", "latest", "next"]
    assert (tmp_path / "latest").read_text().strip() == "good"
    model.destroy()


def test_nvme_on_a_filesystem_smaller_than_its_budget_names_the_full_disk(tmp_path):
    """memory.nvme.budget above the free space (or the disk filling up under another process):
    the swap file's fallocate fails with ENOSPC. The error was "cannot evict chunk N ... 'nvme'
    is the last tier of the hierarchy", naming neither the disk nor the file."""
    from test_nvme_training import DeepMLP, config as nvme_config
    with _tmpfs(tmp_path / "small", "1M") as directory:
        cfg = nvme_config(host_budget="512KiB", nvme={"path": str(directory), "budget": "64MiB"})
        cfg["default_chunk_size"] = 16384  # 64 KiB chunks; fp32 masters and Adam state: 3 MiB
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = patrickstar.initialize(lambda: DeepMLP(width=128, depth=16), config=cfg)
        with pytest.raises(MemoryError) as info:
            train(model, opt, [(torch.randn(16, 128), torch.randint(0, 10, (16,)))
                               for _ in range(2)])
        message = str(info.value)
        assert "No space left on device" in message and str(directory) in message, message
        assert "nvme" in message and "last tier" in message, message
        with pytest.raises(RuntimeError, match="failed partway"):
            train(model, opt, [(torch.randn(16, 128), torch.randint(0, 10, (16,)))])
        model.destroy()
        assert os.listdir(directory) == []


def test_budgets_beyond_the_machine_are_warned_about_at_start(tmp_path):
    """A host budget past the machine's memory ends days later in the OOM killer's SIGKILL, with
    no error; an NVMe budget past the free disk space in ENOSPC: initialize() says so."""
    from patrickstar.config import load_config
    from patrickstar.chunk_runtime import warn_budgets_beyond_the_machine
    with pytest.warns(UserWarning, match="memory.host_budget.*OOM killer"):
        warn_budgets_beyond_the_machine(load_config({"memory": {"host_budget": "100TiB"}}).memory)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    memory = load_config({"memory": {"nvme": {"path": str(tmp_path),
                                              "budget": free + (1 << 30)}}}).memory
    with pytest.warns(UserWarning, match=f"memory.nvme.budget.*{tmp_path}"):
        warn_budgets_beyond_the_machine(memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_budgets_beyond_the_machine(load_config({"memory": {
            "host_budget": "1GiB", "nvme": {"path": str(tmp_path), "budget": "1MiB"}}}).memory)
    with pytest.warns(UserWarning, match="memory.host_budget"):
        model, opt = patrickstar.initialize(
            lambda: torch.nn.Linear(4, 4), config={"memory": {"host_budget": "100TiB"}})
    model.destroy()
