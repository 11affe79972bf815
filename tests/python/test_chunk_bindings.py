"""The chunk manager through patrickstar._C: register, build, access/release, views, moments,
eviction under a budget, errors as the documented exceptions, and the JSON dump."""

import json

import pytest
import torch

import patrickstar
from patrickstar import _C

KiB = 1024


def make_manager(device_budget=0, **kwargs):
    device = _C.EmulatedDeviceTier(budget=device_budget, slab_bytes=16 * KiB)
    host = _C.HostTier(slab_bytes=16 * KiB)
    manager = _C.ChunkManager([device, host], _C.CopyEngine(), **kwargs)
    return manager, device, host


def register_layers(manager, layers):
    ids = []
    for i in range(layers):
        ids.append(manager.register_tensor(f"layer{i}.weight", [64, 64], _C.ChunkKind.COMPUTE_PARAM, "fp32"))
    return ids


def test_access_gives_a_writable_view_that_survives_eviction():
    manager, _, _ = make_manager(device_budget=2 * 16 * KiB)
    ids = register_layers(manager, 4)
    report = manager.build_chunk_lists(4096)
    assert report["num_chunks"] == 4
    assert report["oversize_tensors"] == []
    assert report["layout_hash"] == manager.layout_hash

    for i, t in enumerate(ids):
        info = manager.access(t, "device")
        assert info["tier_kind"] == "device" and info["numel"] == 4096 and info["shape"] == [64, 64]
        view = manager.torch_view(t)
        assert view.shape == (64, 64) and view.dtype == torch.float32
        assert torch.count_nonzero(view) == 0  # never written: zero-filled
        view.fill_(float(i + 1))
        manager.release(t, _C.TensorState.HOLD)
        manager.tick()

    # Only two chunks fit the device: the first two were evicted to the host and come back intact.
    for i, t in enumerate(ids):
        manager.access(t, "device")
        assert torch.all(manager.torch_view(t) == float(i + 1))
        manager.release(t, _C.TensorState.HOLD_AFTER_FWD)
    stats = json.loads(manager.dump_json())
    device_stats = stats["tiers"][0]
    assert device_stats["evictions"] >= 2
    assert device_stats["peak_chunk_bytes"] <= 2 * 16 * KiB
    assert stats["layout"]["chunks"][0]["tensors"][0]["name"] == "layer0.weight"
    assert manager.tensor_info(ids[0])["state"] == _C.TensorState.HOLD_AFTER_FWD


def test_errors_map_to_documented_exceptions():
    manager, _, _ = make_manager(device_budget=16 * KiB)
    ids = register_layers(manager, 2)
    manager.build_chunk_lists(4096)
    with pytest.raises(RuntimeError, match="illegal state transition FREE -> HOLD"):
        manager.set_tensor_state(ids[0], _C.TensorState.HOLD)
    manager.access(ids[0], "device")
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="budget 16384 bytes"):
        manager.access(ids[1], "device")
    with pytest.raises(ValueError, match="unknown tier"):
        manager.access(ids[1], "gpu")
    with pytest.raises(FileNotFoundError):
        manager.find_tensor("missing")
    with pytest.raises(RuntimeError, match="COMPUTE"):
        manager.view(ids[1])


def test_moments_non_model_data_and_chunk_size_search():
    manager, _, _ = make_manager(device_budget=4 * 16 * KiB)
    for i in range(4):
        manager.register_tensor(f"t{i}", [30], _C.ChunkKind.MOMENTUM, "float32")
    report = manager.search_chunk_lists(40, 100, 10)
    assert report["chunk_elements"] == 60 and report["wasted_bytes"] == 0 and report["candidates"] == 7

    assert manager.warming_up
    manager.tick()
    manager.report_non_model_data("device", 12345)
    manager.access(0, "device")
    manager.release(0, _C.TensorState.HOLD)
    manager.end_iteration()
    assert not manager.warming_up
    trace = json.loads(manager.dump_json())["tracer"]
    assert trace["moments"][1]["non_model_bytes"][0] == 12345
    assert trace["accesses"] == [{"chunk": 0, "moment": 1, "tier": 0}]


def test_release_and_gather_a_remote_group():
    # Rank 1 of 2: chunk 0 of the list is remote (owned by rank 0), chunk 1 is local.
    manager, _, _ = make_manager(world_size=2, rank=1)
    ids = register_layers(manager, 2)
    manager.build_chunk_lists(4096)
    for i, t in enumerate(ids):
        manager.access(t, "host")
        manager.torch_view(t).fill_(float(10 + i))
        manager.release(t, _C.TensorState.HOLD)
    remote_chunk = manager.tensor_info(ids[0])["chunk"]
    assert not manager.is_local(remote_chunk)
    manager.release_group(remote_chunk)
    assert manager.tensor_info(ids[0])["state"] == _C.TensorState.RELEASED
    plan = manager.plan_gather(ids[0])
    assert plan["needs_gather"] and plan["to_receive"] == [remote_chunk]
    with pytest.raises(RuntimeError, match="gather"):
        manager.access(ids[0], "host")

    def failing_fill(buffer):
        raise KeyError("collective failed")

    with pytest.raises(KeyError, match="collective failed"):
        manager.materialize_gathered(remote_chunk, "host", failing_fill)
    owner_bytes = torch.full((4096,), 10.0).view(torch.uint8)

    def fill(buffer):
        assert buffer.dtype == torch.uint8 and buffer.numel() == 16 * KiB
        buffer.copy_(owner_bytes)

    manager.materialize_gathered(remote_chunk, "host", fill)
    manager.complete_gather(remote_chunk)
    assert not manager.plan_gather(ids[0])["needs_gather"]
    manager.access(ids[0], "host")
    assert torch.all(manager.torch_view(ids[0]) == 10.0)
