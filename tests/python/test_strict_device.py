"""The engine's CUDA path on the strict emulated device (Note [Strict device] in
runtime/strict_device.h): these run when PATRICKSTAR_STRICT_DEVICE=1, as tools/test.sh does, and
check the stream orderings a GPU needs and the CPU build cannot show."""

import json
import os
import subprocess
import sys

import pytest
import torch

import patrickstar
from patrickstar import _C

pytestmark = pytest.mark.skipif(
    not _C.strict_device(), reason="needs PATRICKSTAR_STRICT_DEVICE=1 (tools/test.sh sets it)")

KiB = 1024
S = _C.TensorState
CHUNK = 1024  # elements: each (32, 32) tensor fills a chunk of its own


@pytest.fixture
def slow_kernels():
    """Every kernel waits 50 ms on its stream, so a copy that does not wait for one reads the
    chunk's bytes from before it."""
    _C.strict_device_set_kernel_delay(50_000)
    yield
    _C.strict_device_set_kernel_delay(200)


def make_slots(device_budget, count=2, device=0):
    tier = _C.DeviceTier(device, budget=device_budget, slab_bytes=4 * KiB)
    host = _C.HostTier(slab_bytes=4 * KiB, pinned=True)
    manager = _C.ChunkManager([tier, host], _C.CopyEngine(device=device))
    compute = [manager.register_tensor(f"p{i}", [32, 32], _C.ChunkKind.COMPUTE_PARAM, "fp32")
               for i in range(count)]
    grads = [manager.register_tensor(f"p{i}#grad", [32, 32], _C.ChunkKind.GRADIENT, "fp32")
             for i in range(count)]
    manager.build_chunk_lists(CHUNK)
    params = [torch.nn.Parameter(torch.empty(0)) for _ in range(count)]
    slots = _C.ParameterSlots(manager, params, compute, grads, "device", torch.empty(0))
    return manager, slots, grads


def test_device_tier_is_the_cuda_tier_and_views_are_its_device_side_alias():
    assert _C.cuda_available() and _C.build_info()["strict_device"]
    manager, slots, grads = make_slots(device_budget=0)
    slots.store_grad(0, torch.full((32, 32), 2.0), False)
    view = manager.access_tensor(grads[0], "device")
    assert manager.view(grads[0])["device_memory"]
    assert view.data_ptr() != manager.view(grads[0])["address"]  # the alias, not the pointer
    assert torch.equal(view, torch.full((32, 32), 2.0))
    manager.release_tensors([grads[0]], S.HOLD)


# Note [Gradient stores on the compute stream]: the store is queued on the compute stream and
# the chunk released at once; the eviction that follows copies it device -> host on the copy
# engine's stream. Without the wait (CopyEngine::OrderAfter) the copy runs first: zeros.
def test_gradient_store_is_ordered_before_the_copy_that_evicts_its_chunk(slow_kernels):
    manager, slots, grads = make_slots(device_budget=4 * KiB)  # one chunk on the device
    first, second = torch.randn(32, 32), torch.randn(32, 32)
    slots.store_grad(0, first, False)
    slots.store_grad(1, second, False)  # evicts gradient 0's chunk to the host
    assert manager.chunk_tiers([manager.tensor_info(grads[0])["chunk"]]) == ["host"]
    torch.testing.assert_close(manager.access_tensor(grads[0], "host"), first, rtol=0, atol=0)
    manager.release_tensors([grads[0]], S.HOLD)
    torch.testing.assert_close(manager.access_tensor(grads[1], "host"), second, rtol=0, atol=0)
    manager.release_tensors([grads[1]], S.HOLD)


def test_accumulated_gradient_stores_stay_in_stream_order(slow_kernels):
    manager, slots, grads = make_slots(device_budget=0, count=1)
    parts = [torch.randn(32, 32) for _ in range(3)]
    slots.store_grad(0, parts[0], False)
    slots.store_grad(0, parts[1], True)
    slots.store_grad(0, parts[2], True)
    torch.testing.assert_close(manager.access_tensor(grads[0], "host"),
                               parts[0] + parts[1] + parts[2], rtol=0, atol=0)
    manager.release_tensors([grads[0]], S.HOLD)


def test_a_second_local_rank_uses_its_own_device_end_to_end(slow_kernels):
    # local_rank 1 on a node: its tier, copy streams and compute stream are device 1's; a
    # stream of device 0 touching them would be an illegal address on the strict device.
    manager, slots, grads = make_slots(device_budget=4 * KiB, device=1)
    first, second = torch.randn(32, 32), torch.randn(32, 32)
    slots.store_grad(0, first, False)
    slots.store_grad(1, second, False)
    torch.testing.assert_close(manager.access_tensor(grads[0], "host"), first, rtol=0, atol=0)
    manager.release_tensors([grads[0]], S.HOLD)


def test_engine_training_matches_pytorch_under_a_device_budget():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 32))

    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(build, config={
        "default_chunk_size": CHUNK, "optimizer": {"params": {"lr": 1e-2}},
        "memory": {"device_budget": 16 * KiB}})  # four of the six chunks backward touches
    assert model.tiers[0].name == "cuda:0"
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 32)
        loss = model(x).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(x).square().mean()
        expected.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        torch.testing.assert_close(loss.detach(), expected.detach())
    assert sum(tier["chunks_out"] for tier in model.memory_stats()) > 0  # it evicted
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, msg=name)
    model.destroy()


def _lowp_losses() -> tuple[list[float], set[str]]:
    """Trains a small MLP with bf16 params without master and 8-bit state under a device budget
    that evicts; the losses of each step and the tiers the optimizer updated tensors on."""
    def build():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 32))

    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(build, config={
        "default_chunk_size": 4 * CHUNK, "bf16": {"enabled": True, "master_weights": False},
        "optimizer": {"params": {"lr": 1e-2, "state_dtype": "int8"}},
        "memory": {"device_budget": 64 * KiB}})
    tiers = set()
    where = optimizer._update_tiers  # records where each update runs (device or host kernel)
    optimizer._update_tiers = lambda ids: tiers.update(where(ids)) or where(ids)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for x in [torch.randn(8, 32, generator=generator) for _ in range(3)] * 4:
        loss = model(x.bfloat16()).float().square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = optimizer.state_dict()["state"]
    assert all(entry["exp_avg"].dtype == torch.uint8 for entry in state.values())
    model.destroy()
    return losses, tiers


def test_8bit_state_and_bf16_without_master_train_on_the_device_path_as_on_the_host():
    # Issue 21's kernels through the engine's CUDA path: moments, scales and compensation
    # chunks in device memory the host must not touch, updated by the device kernel where all
    # of a parameter's chunks are on the device. Its kernels give the CPU kernels' bits, so the
    # run matches the CPU build's step for step (run in a process without the strict device).
    on_device, tiers = _lowp_losses()
    assert "device" in tiers  # the device kernel ran
    script = ("import json, test_strict_device as t; "
              "print(json.dumps(t._lowp_losses()[0]))")
    env = dict(os.environ, PATRICKSTAR_STRICT_DEVICE="0")
    out = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    on_host = json.loads(out.stdout.strip().splitlines()[-1])
    assert on_device == on_host
    assert on_device[-1] < on_device[0]


def test_memory_estimate_follows_the_update_placement_the_engine_runs():
    # torch computes on the host here, so the engine keeps the CPU build's update placement
    # (Note [Optimizer sweep]): the optimizer step holds only the optimizer state on the host.
    # estimate_memory() asked _C.cuda_available() and predicted all model data there (twice the
    # measured host peak of this fp32 model).
    def build():
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 32))

    config = {"default_chunk_size": CHUNK}
    model, optimizer = patrickstar.initialize(build, config=config)
    model.backward(model(torch.randn(4, 32)).square().mean())
    optimizer.step()
    device, host = model.memory_stats()
    figures = patrickstar.estimate_memory(build, config, verbose=False)["modes"]["fp32"]
    assert figures["device_no_moves"] == device["peak_chunk_bytes"]
    assert figures["host_optimizer"] == host["peak_chunk_bytes"], figures
    model.destroy()
