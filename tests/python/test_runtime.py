"""The runtime layer through patrickstar._C: tiers, statistics, copies and error mapping."""
import errno
import os
import subprocess
import sys

import pytest
import torch

import patrickstar
from patrickstar import _C


def test_import_from_any_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import patrickstar; print(patrickstar.__version__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == patrickstar.__version__


def test_build_info_reports_cuda_and_torch():
    info = _C.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["with_cuda"], bool)
    assert (info["device_count"] > 0) == _C.cuda_available()
    if not _C.cuda_available():
        assert info["cuda_unavailable_reason"]


def test_tier_statistics_track_bytes_and_blocks():
    tier = _C.HostTier(budget=1 << 20, name="stats-host", slab_bytes=1 << 20)
    a = tier.allocate(5000)
    b = tier.allocate(4096)
    stats = tier.stats()
    assert a.nbytes == 8192 and b.nbytes == 4096
    assert stats["bytes"] == {"current": 12288, "peak": 12288, "allocated": 12288, "freed": 0}
    assert stats["blocks"]["current"] == 2
    assert stats["budget_bytes"] == 1 << 20
    assert stats["reserved_bytes"] >= 12288
    tier.free(a)
    stats = tier.stats()
    assert stats["bytes"]["current"] == 4096
    assert stats["bytes"]["peak"] == 12288
    assert stats["bytes"]["freed"] == 8192
    assert stats["blocks"]["freed"] == 1
    tier.free(b)


def test_budget_exceeded_raises_chunk_out_of_memory_error_with_numbers():
    tier = _C.EmulatedDeviceTier(budget=2 * 65536, name="tiny-device", slab_bytes=65536)
    blocks = [tier.allocate(65536), tier.allocate(65536)]
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        tier.allocate(65536)
    assert isinstance(info.value, MemoryError)
    message = str(info.value)
    assert "tiny-device" in message and "budget 131072 bytes" in message
    assert "in use 131072 bytes in 2 blocks" in message
    for block in blocks:
        tier.free(block)


def test_bad_arguments_raise_value_error():
    tier = _C.HostTier()
    with pytest.raises(ValueError, match="must be positive"):
        tier.allocate(0)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        tier.budget = -5
    other = _C.HostTier(name="other")
    block = other.allocate(4096)
    with pytest.raises(ValueError, match="belongs to tier 'other'"):
        tier.free(block)
    other.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        other.free(block)


def test_tensor_view_pins_its_block_until_released():
    tier = _C.HostTier()
    block = tier.allocate(4096)
    view = tier.tensor(block, torch.float32)
    assert view.shape == (1024,) and view.dtype == torch.float32
    view.copy_(torch.arange(1024, dtype=torch.float32))
    assert tier.pin_count(block) == 1
    with pytest.raises(RuntimeError, match="pin"):
        tier.free(block)
    again = tier.tensor(block, torch.float32, 1024)
    torch.testing.assert_close(again, torch.arange(1024, dtype=torch.float32))
    del view, again
    assert tier.pin_count(block) == 0
    tier.free(block)
    with pytest.raises(ValueError, match="do not fit"):
        tier.tensor(tier.allocate(4096), torch.float32, 2000)


@pytest.mark.parametrize("use_io_uring", [True, False])
def test_round_trip_host_device_nvme_host_matches_torch(nvme_dir, use_io_uring):
    host = _C.HostTier(budget=64 << 20)
    device = _C.EmulatedDeviceTier(budget=64 << 20)
    nvme = _C.NvmeTier(nvme_dir, budget=64 << 20, use_io_uring=use_io_uring, block_size=1 << 16)
    assert nvme.uses_io_uring == use_io_uring
    assert os.path.dirname(nvme.path) == nvme_dir
    engine = _C.CopyEngine(host_threads=2)
    numel = 300_001
    expected = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    src = host.allocate(numel * 4)
    on_device = device.allocate(numel * 4)
    on_nvme = nvme.allocate(numel * 4)
    dst = host.allocate(numel * 4)
    host.tensor(src, torch.float32, numel).copy_(expected)
    engine.copy_and_wait(src, on_device)
    handle = engine.copy(on_device, on_nvme)
    handle.wait()
    assert handle.done() and nvme.is_valid(on_nvme)
    engine.copy(on_nvme, dst).wait()
    torch.testing.assert_close(host.tensor(dst, torch.float32, numel), expected, rtol=0, atol=0)
    assert nvme.stats()["blocks"]["current"] == 1


def test_nvme_errors_are_os_errors_naming_the_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError) as info:
        _C.NvmeTier(str(missing))
    assert info.value.errno == errno.ENOENT
    assert str(missing) in str(info.value)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OSError) as info:
        _C.NvmeTier(str(a_file))
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(ValueError, match="queue_depth"):
        _C.NvmeTier(str(tmp_path), queue_depth=0)


def test_nvme_file_removed_when_tier_is_dropped(nvme_dir):
    nvme = _C.NvmeTier(nvme_dir)
    path = nvme.path
    nvme.allocate(4096)
    assert os.path.exists(path)
    del nvme
    assert not os.path.exists(path)


def test_nvme_blocks_are_not_tensor_addressable(nvme_dir):
    nvme = _C.NvmeTier(nvme_dir)
    block = nvme.allocate(4096)
    with pytest.raises(ValueError, match="not addressable"):
        nvme.tensor(block, torch.float32)
    assert not nvme.is_valid(block)
    host = _C.HostTier()
    with pytest.raises(RuntimeError, match="holds no complete data"):
        _C.CopyEngine().copy(block, host.allocate(4096))


def test_device_tier_needs_a_gpu():
    if _C.cuda_available():
        tier = _C.DeviceTier(0, budget=1 << 20)
        assert tier.kind == "device"
        block = tier.allocate(4096)
        view = tier.tensor(block, torch.float32)
        # The strict device hands torch (the CPU build) its device-side alias instead.
        assert view.is_cuda != _C.strict_device()
        assert (view.data_ptr() == block.address) != _C.strict_device()
        del view
        tier.free(block)
    else:
        with pytest.raises(RuntimeError, match="device tier"):
            _C.DeviceTier(0)


def test_cast_kernel_matches_torch():
    values = torch.cat([torch.randn(10_000) * 1000, torch.tensor(
        [0.0, -0.0, 65504.0, 65520.0, 1e-8, 6e-8, float("inf"), float("-inf"), 3.0e38])])
    for dtype in (torch.float16, torch.bfloat16):
        out = torch.empty(values.numel(), dtype=dtype)
        _C.kernels.cast_(values, out)
        torch.testing.assert_close(out, values.to(dtype), rtol=0, atol=0)
        back = torch.empty(values.numel(), dtype=torch.float32)
        _C.kernels.cast_(out, back)
        torch.testing.assert_close(back, out.float(), rtol=0, atol=0)
    nan_out = torch.empty(1, dtype=torch.float16)
    _C.kernels.cast_(torch.tensor([float("nan")]), nan_out)
    assert torch.isnan(nan_out).all()
    with pytest.raises(ValueError, match="elements"):
        _C.kernels.cast_(values, torch.empty(3, dtype=torch.float16))


def test_copy_kernel_matches_torch_and_names_mismatches():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in (0, 1, 17, 1_000_003):
            src = torch.randn(numel).to(dtype)
            dst = torch.full((numel,), 7.0, dtype=dtype)
            _C.kernels.copy_(src, dst)
            assert torch.equal(dst, src)
    src = torch.randn(64)
    with pytest.raises(ValueError, match="Float on cpu with 64 elements.*BFloat16"):
        _C.kernels.copy_(src, torch.empty(64, dtype=torch.bfloat16))
    short = torch.full((63,), 5.0)
    with pytest.raises(ValueError, match="63 elements"):
        _C.kernels.copy_(src, short)
    assert (short == 5.0).all()  # a refused copy writes nothing
    with pytest.raises(ValueError, match="dst must be a contiguous CPU tensor"):
        _C.kernels.copy_(src, torch.empty(64, 2)[:, 0])


def test_reading_properties_does_not_keep_the_tier_alive(nvme_dir):
    nvme = _C.NvmeTier(nvme_dir, name="props")
    path = nvme.path
    assert nvme.name == "props" and nvme.fallback_note == "" and nvme.kind == "nvme"
    del nvme
    assert not os.path.exists(path)
