"""patrickstar._C.ParameterSlots (bindings/parameter_slots.cc) and the batched chunk-manager calls
the engine's hot path uses: access counts, .data swaps, saved-view lookup, gradient stores, and
that errors leave nothing half done."""

import json

import pytest
import torch

import patrickstar
from patrickstar import _C

KiB = 1024
S = _C.TensorState


def make_slots(device_budget=0, shapes=((8, 4), (4,))):
    device = _C.EmulatedDeviceTier(budget=device_budget, slab_bytes=16 * KiB)
    host = _C.HostTier(slab_bytes=16 * KiB)
    manager = _C.ChunkManager([device, host], _C.CopyEngine())
    compute = [manager.register_tensor(f"p{i}", list(shape), _C.ChunkKind.COMPUTE_PARAM, "fp32")
               for i, shape in enumerate(shapes)]
    grads = [manager.register_tensor(f"p{i}#grad", list(shape), _C.ChunkKind.GRADIENT, "fp32")
             for i, shape in enumerate(shapes)]
    manager.build_chunk_lists(1024)
    placeholder = torch.empty(0)
    params = [torch.nn.Parameter(torch.empty(0)) for _ in shapes]
    slots = _C.ParameterSlots(manager, params, compute, grads, "device", placeholder)
    return manager, slots, params, compute, grads


def test_access_counts_swap_data_and_release_on_last_use():
    manager, slots, params, compute, _ = make_slots()
    slots.access([0, 0, 1])
    assert [slots.access_count(0), slots.access_count(1)] == [2, 1]
    assert params[0].shape == (8, 4) and params[1].shape == (4,)
    params[0].data.fill_(3.0)
    assert params[0].data_ptr() == manager.view(compute[0])["address"]

    slots.release([0], S.HOLD_AFTER_FWD)  # one use of two: still accessed
    assert slots.access_count(0) == 1 and params[0].shape == (8, 4)
    assert manager.tensor_info(compute[0])["state"] == S.COMPUTE
    slots.release([0, 1], S.HOLD_AFTER_FWD)
    assert params[0].numel() == 0 and params[1].numel() == 0
    assert manager.tensor_info(compute[0])["state"] == S.HOLD_AFTER_FWD

    slots.access([0])  # the chunk kept what was written through the parameter
    assert torch.equal(params[0].data, torch.full((8, 4), 3.0))
    slots.release_all(S.HOLD)
    assert slots.access_count(0) == 0 and manager.tensor_info(compute[0])["state"] == S.HOLD
    slots.release([0], S.HOLD)  # nothing accessed: no-op


def test_saved_index_finds_views_of_accessed_parameters_only():
    _, slots, params, _, _ = make_slots()
    slots.access([0, 1])
    assert slots.saved_index(params[0].data.t()) == 0
    assert slots.saved_index(params[1].data[1:]) == 1
    assert slots.saved_index(torch.ones(8, 4)) == -1
    view = params[0].data
    slots.release([0], S.HOLD)
    assert slots.saved_index(view) == -1
    assert slots.saved_index(params[1].data) == 1


def test_store_grad_writes_then_accumulates_like_torch():
    manager, slots, _, _, grads = make_slots()
    first, second = torch.randn(8, 4), torch.randn(8, 4)
    slots.store_grad(0, first, False)
    slots.store_grad(0, second, True)
    slots.store_grad(1, torch.arange(8.0)[::2], False)  # non-contiguous: torch's copy_
    view = manager.access_tensor(grads[0], "host")
    torch.testing.assert_close(view, first + second, rtol=0, atol=0)
    assert torch.equal(manager.access_tensor(grads[1], "host"), torch.arange(8.0)[::2])
    manager.release_tensors([grads[0], grads[1]], S.HOLD)


def test_store_grad_with_a_wrong_shape_names_it_and_leaves_the_chunk_usable():
    manager, slots, _, _, grads = make_slots()
    slots.store_grad(0, torch.ones(8, 4), False)
    with pytest.raises(ValueError, match=r"shape \[4, 8\].*\[8, 4\]"):
        slots.store_grad(0, torch.zeros(4, 8), True)
    assert manager.tensor_info(grads[0])["state"] == S.HOLD
    assert torch.equal(manager.access_tensor(grads[0], "host"), torch.ones(8, 4))
    manager.release(grads[0], S.HOLD)
    with pytest.raises(IndexError, match="parameter index 5 out of range"):
        slots.access([5])


def test_failed_access_leaves_no_count_and_before_access_sees_every_first_access():
    # Two 4 KiB chunks of parameters, a device budget of one 16 KiB slab... too small for both
    # with the first pinned in COMPUTE.
    manager, slots, params, compute, _ = make_slots(
        device_budget=16 * KiB, shapes=((32, 32), (32, 32), (32, 32), (32, 32), (32, 32)))
    seen = []
    slots.set_before_access(seen.append)
    slots.access([0])
    with pytest.raises(patrickstar.ChunkOutOfMemoryError):
        slots.access([1, 2, 3, 4])
    counts = [slots.access_count(i) for i in range(5)]
    assert counts[0] == 1 and 0 in counts[1:]
    failed = counts.index(0)
    assert params[failed].numel() == 0
    assert seen[:2] == [compute[0], compute[1]]
    slots.release_all(S.HOLD)
    assert [slots.access_count(i) for i in range(5)] == [0] * 5
    assert all(manager.tensor_info(t)["state"] != S.COMPUTE for t in compute)


def test_access_tensors_is_all_or_nothing_and_tick_reports_non_model_data():
    manager, _, _, compute, grads = make_slots(device_budget=16 * KiB, shapes=((32, 32),) * 5)
    with pytest.raises(patrickstar.ChunkOutOfMemoryError):
        manager.access_tensors(compute, ["device"] * 5)
    assert all(manager.tensor_info(t)["state"] != S.COMPUTE for t in compute)
    with pytest.raises(ValueError, match="2 tensors but 1 tiers"):
        manager.access_tensors(compute[:2], ["host"])
    views = manager.access_tensors(compute[:2], ["device", "host"])
    assert [v.shape for v in views] == [(32, 32), (32, 32)]
    chunks = [manager.tensor_info(t)["chunk"] for t in compute[:2]]
    assert manager.chunk_tiers(chunks) == ["device", "host"]
    manager.release_tensors(compute[:2], S.HOLD)
    with pytest.raises(RuntimeError, match="tensor .p0.: illegal state transition HOLD -> HOLD"):
        manager.release_tensors(compute[:2], S.HOLD)

    manager.tick("device", 4321)
    trace = json.loads(manager.dump_json())["tracer"]
    assert trace["moments"][-1]["non_model_bytes"][0] == 4321
    with pytest.raises(ValueError, match="must be >= 0"):
        manager.tick("device", -1)
