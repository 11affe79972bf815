"""Soak (issue 10): 2,000 steps of the small GPT under tight budgets with NVMe; memory flat."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import patrickstar
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches

STEPS = 2000
WARMUP = 200
CHUNK = 4096  # elements: 16 KiB fp32 chunks; the model needs 32 chunks of all kinds
ACTIVATIONS = 192 << 10  # bytes


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _snapshot(model) -> dict:
    stats = model.memory_stats()
    # Which chunks sit where changes (a checkpoint moves them); how much memory each tier holds
    # at most, and all chunk bytes together, must not.
    return {"tiers": {s["name"]: (s["peak_chunk_bytes"], s["reserved_bytes"],
                                  s["non_model_bytes"]) for s in stats},
            "resident": sum(s["chunk_bytes"] for s in stats),
            "traffic": {s["name"]: s["chunks_in"] for s in stats},
            "files": {t.name: t.file_bytes for t in model.tiers if hasattr(t, "file_bytes")}}


@pytest.mark.slow
def test_two_thousand_steps_under_tight_budgets_keep_memory_flat(tmp_path, nvme_dir):
    cfg = GPTConfig(vocab_size=128, max_seq_len=16, hidden=32, layers=2, heads=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(lambda: GPT(cfg), config={
            "default_chunk_size": CHUNK,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            # Device 4 and host 9 of the 32 chunks: the rest lives on NVMe, and every step
            # moves chunks through all three tiers (about 45 NVMe reads per step). The host
            # budget also holds the activations (non-model data on a CPU build: about 140 KiB).
            "memory": {"device_budget": 4 * CHUNK * 4,
                       "host_budget": 9 * CHUNK * 4 + ACTIVATIONS,
                       "nvme": {"path": nvme_dir}}})
    data = list(synthetic_batches(cfg, batch=4, steps=50))
    snapshots, losses, rss = {}, [], {}
    for index in range(STEPS):
        x, y = data[index % len(data)]
        loss = model(x, y)
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        done = index + 1
        if done % 500 == 0:
            model.save_checkpoint(tmp_path, tag="soak")  # overwritten in place each time
        if done >= WARMUP and done % 200 == 0:
            snapshots[done] = _snapshot(model)
            rss[done] = _rss()
    first = snapshots[WARMUP]
    for done, snap in snapshots.items():
        assert snap["tiers"] == first["tiers"], done  # peak and reserved bytes: flat
        assert snap["resident"] == first["resident"], done
        assert snap["files"] == first["files"], done  # the swap file does not grow
    # Chunks keep moving through every tier in every window (NVMe included).
    windows = sorted(snapshots)
    for a, b in zip(windows, windows[1:]):
        for tier in ("device", "host", "nvme"):
            assert snapshots[b]["traffic"][tier] > snapshots[a]["traffic"][tier], (tier, b)
    # Process memory: the first window after warm-up may still settle allocator pools; beyond
    # it growth would be a leak (a chunk-sized one per step would be 25 MiB by the end). The
    # allocators still step up once in a while: run alone, this test saw RSS flat but for one
    # 3.7 MiB step after the third checkpoint save (and failed the old 4 MiB bound; after the
    # rest of the suite it did not step); 8000 steps of the same loop in a script, a save every
    # 500, stayed within 1.5 MiB of the first figure. So the bound is 8 MiB.
    growth = rss[STEPS] - rss[WARMUP + 200]
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
    assert sum(losses[-50:]) < 0.8 * sum(losses[:50])  # and it still learns
    path, _ = model.load_checkpoint(tmp_path)
    assert path.endswith(os.path.join("soak", "meta.json"))
