"""Training loops whose iterations differ from the warm-up one, against the same loops on the
plain module with torch.optim.AdamW: an evaluation before the first step, a model that runs
fewer modules after the warm-up, under a tight host budget with NVMe (Note [The trace
forecasts, the report bounds] in chunk/chunk_manager_placement.cc)."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar import _C

KiB = 1024
CHUNK = 4096  # elements: 16 KiB fp32 chunks
WIDTH, BATCH = 64, 256
# What autograd saves for the 8 tanh layers and the head at BATCH (the engine's CPU measure of
# non-model data): 9 tensors of BATCH x WIDTH fp32.
ACTIVATIONS = 9 * BATCH * WIDTH * 4


class Deep(nn.Module):
    """Linear + tanh layers of which a forward runs the first `depth` (an early exit)."""

    def __init__(self, layers: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x, y, depth: int = 8):
        for layer in self.layers[:depth]:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator))


def run(model, optimizer, schedule, engine: bool) -> list[float]:
    """`schedule`: (depth, "train" or "eval") per call; an optimizer step after each train."""
    losses = []
    for seed, (depth, kind) in enumerate(schedule):
        x, y = batch(seed)
        if kind == "eval":
            model.eval()
            with torch.no_grad():
                losses.append(model(x, y, depth).item())
            model.train()
            continue
        loss = model(x, y, depth)
        if engine:
            model.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


SCHEDULES = {
    # nanoGPT's and the Trainer's (eval_on_start) evaluation before training: its forward's
    # moments are in the warm-up trace, so every later step ran at the moment the trace had at
    # the training forward's activation peak.
    "evaluation first": [(8, "eval")] + [(8, "train")] * 3,
    # Fewer modules after the warm-up: the step of a depth-4 iteration ran at the moment of the
    # depth-8 warm-up's activation peak.
    "shorter later": [(8, "train"), (4, "train"), (4, "train")],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_iterations_unlike_the_warmup_train_in_the_budget_training_needs(schedule, tmp_path):
    # Room for the activations' peak and two chunks: every step of a loop that repeats the
    # warm-up fits; the ones above raised "cannot take 16384 bytes: budget 622976 bytes,
    # non-model data 589824 bytes" at the optimizer step, with no activation left.
    config = {"default_chunk_size": CHUNK,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "memory": {"device_budget": 4 * CHUNK * 4,
                         "host_budget": ACTIVATIONS + 2 * CHUNK * 4 + 512,
                         "nvme": {"path": str(tmp_path)}}}
    torch.manual_seed(0)
    module = Deep()
    reference = copy.deepcopy(module)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = run(reference, torch_optimizer, SCHEDULES[schedule], engine=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config=config)
    got = run(model, optimizer, SCHEDULES[schedule], engine=True)
    assert got == pytest.approx(expected, rel=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6, msg=name)
    host = next(t for t in model.memory_stats() if t["name"] == "host")
    assert host["peak_chunk_bytes"] <= config["memory"]["host_budget"]
    model.destroy()


def test_the_trace_keeps_room_but_only_the_report_refuses_an_access():
    device = _C.EmulatedDeviceTier(budget=3 * 16 * KiB, slab_bytes=16 * KiB)
    host = _C.HostTier(slab_bytes=16 * KiB)
    manager = _C.ChunkManager([device, host], _C.CopyEngine())
    ids = [manager.register_tensor(f"t{i}", [64, 64], _C.ChunkKind.COMPUTE_PARAM, "fp32")
           for i in range(3)]
    manager.build_chunk_lists(4096)
    # Warm-up: two chunks of activations at moment 1, beside one chunk in use.
    manager.tick()
    manager.report_non_model_data("device", 2 * 16 * KiB)
    manager.access(ids[0], "device")
    manager.release(ids[0], _C.TensorState.HOLD)
    manager.report_non_model_data("device", 0)
    manager.end_iteration()
    # A later iteration's moment 1 is another point of the model: no activations, three chunks
    # in use at once. The forecast cannot be kept (nothing to evict), the budget can.
    manager.tick()
    manager.report_non_model_data("device", 0)
    for t in ids:
        manager.access(t, "device")
    assert json.loads(manager.dump_json())["tiers"][0]["chunk_bytes"] == 3 * 16 * KiB
    # Activations that really are there still bound the tier, and the error names them.
    with pytest.raises(patrickstar.ChunkOutOfMemoryError,
                       match="minus non-model data 16384 bytes leaves 32768 bytes"):
        manager.report_non_model_data("device", 16 * KiB)
