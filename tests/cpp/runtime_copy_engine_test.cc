// The copy engine: every route between host, emulated device and NVMe, concurrency, pins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "runtime/copy_engine.h"
#include "runtime/device_tier.h"
#include "runtime/gpu.h"
#include "runtime/host_tier.h"
#include "runtime/nvme_tier.h"
#include "test_util.h"

namespace ps {
namespace {

using ::ps::testing::TempDir;
using ::testing::HasSubstr;

class CopyEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    NvmeTierOptions nvme;
    nvme.tier = Tier::Options{"nvme", 256 << 20, 4 << 20};
    nvme.directory = dir_.path();
    nvme.io_block_bytes = 256 << 10;
    PS_ASSERT_OK_AND_ASSIGN(nvme_, NvmeTier::Create(nvme));
  }

  TempDir dir_;
  HostTier host_{HostTierOptions{Tier::Options{"host", 256 << 20, 4 << 20}}};
  EmulatedDeviceTier device_{EmulatedDeviceTierOptions{Tier::Options{"dev", 256 << 20, 4 << 20}}};
  std::unique_ptr<NvmeTier> nvme_;
  CopyEngine engine_{CopyEngine::Options{2, 0}};
};

TEST_F(CopyEngineTest, RandomBytesRoundTripHostDeviceNvmeHost) {
  constexpr int64_t kBytes = (1 << 20) + 12345;
  PS_ASSERT_OK_AND_ASSIGN(Block source, host_.Allocate(kBytes));
  PS_ASSERT_OK_AND_ASSIGN(Block on_device, device_.Allocate(kBytes));
  PS_ASSERT_OK_AND_ASSIGN(Block on_nvme, nvme_->Allocate(kBytes));
  PS_ASSERT_OK_AND_ASSIGN(Block back, host_.Allocate(kBytes));
  testing::FillRandom(source.data(), source.bytes, 7);
  PS_ASSERT_OK(engine_.CopyAndWait(source, on_device));
  PS_ASSERT_OK(engine_.CopyAndWait(on_device, on_nvme));
  EXPECT_TRUE(*nvme_->IsValid(on_nvme));
  std::memset(on_device.data(), 0, on_device.bytes);  // the NVMe copy must not alias it
  PS_ASSERT_OK(engine_.CopyAndWait(on_nvme, back));
  EXPECT_TRUE(testing::SameBytes(source.data(), back.data(), source.bytes));
  for (const Block& b : {source, back}) PS_ASSERT_OK(host_.Free(b));
  PS_ASSERT_OK(device_.Free(on_device));
  PS_ASSERT_OK(nvme_->Free(on_nvme));
}

TEST_F(CopyEngineTest, NvmeToNvmeIsStagedThroughHost) {
  PS_ASSERT_OK_AND_ASSIGN(Block source, host_.Allocate(64 << 10));
  PS_ASSERT_OK_AND_ASSIGN(Block a, nvme_->Allocate(64 << 10));
  PS_ASSERT_OK_AND_ASSIGN(Block b, nvme_->Allocate(64 << 10));
  PS_ASSERT_OK_AND_ASSIGN(Block back, host_.Allocate(64 << 10));
  testing::FillRandom(source.data(), source.bytes, 3);
  PS_ASSERT_OK(engine_.CopyAndWait(source, a));
  PS_ASSERT_OK(engine_.CopyAndWait(a, b));
  PS_ASSERT_OK(engine_.CopyAndWait(b, back));
  EXPECT_TRUE(testing::SameBytes(source.data(), back.data(), source.bytes));
}

TEST_F(CopyEngineTest, ConcurrentCopiesAllLandIntact) {
  constexpr int kCopies = 32;
  std::vector<Block> sources, nvme_blocks, results;
  std::vector<CopyHandle> handles;
  for (int i = 0; i < kCopies; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block s, device_.Allocate(256 << 10));
    PS_ASSERT_OK_AND_ASSIGN(Block n, nvme_->Allocate(256 << 10));
    testing::FillRandom(s.data(), s.bytes, 100 + i);
    sources.push_back(s);
    nvme_blocks.push_back(n);
    PS_ASSERT_OK_AND_ASSIGN(CopyHandle handle, engine_.Copy(s, n));
    handles.push_back(handle);
  }
  for (const CopyHandle& handle : handles) PS_ASSERT_OK(handle.Wait());
  handles.clear();
  for (int i = 0; i < kCopies; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block r, host_.Allocate(256 << 10));
    results.push_back(r);
    PS_ASSERT_OK_AND_ASSIGN(CopyHandle handle, engine_.Copy(nvme_blocks[i], r));
    handles.push_back(handle);
  }
  engine_.WaitAll();
  for (int i = 0; i < kCopies; ++i) {
    EXPECT_TRUE(handles[i].Done());
    EXPECT_TRUE(testing::SameBytes(sources[i].data(), results[i].data(), sources[i].bytes))
        << "copy " << i;
  }
  EXPECT_EQ(host_.stats().blocks.current, kCopies);
}

TEST_F(CopyEngineTest, BlocksWithCopiesInFlightCannotBeFreed) {
  absl::Notification gate;
  NvmeTierOptions options;
  options.tier = Tier::Options{"gated", 16 << 20, 1 << 20};
  options.directory = dir_.path();
  options.use_io_uring = false;  // the injector then runs on the IO worker, where it can block
  options.fault_injector = [&gate](IoOp op, int64_t, int64_t) {
    if (op == IoOp::kRead) gate.WaitForNotification();
    return IoFault{};
  };
  PS_ASSERT_OK_AND_ASSIGN(auto gated, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block source, host_.Allocate(4096));
  PS_ASSERT_OK_AND_ASSIGN(Block slot, gated->Allocate(4096));
  PS_ASSERT_OK_AND_ASSIGN(Block target, host_.Allocate(4096));
  testing::FillRandom(source.data(), 4096, 11);
  PS_ASSERT_OK(engine_.CopyAndWait(source, slot));
  PS_ASSERT_OK_AND_ASSIGN(CopyHandle handle, engine_.Copy(slot, target));
  EXPECT_FALSE(handle.Done());
  absl::Status free_source = gated->Free(slot);
  EXPECT_EQ(free_source.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(free_source.message(), HasSubstr("copies in flight"));
  EXPECT_EQ(host_.Free(target).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(*host_.IsValid(target));  // destination is not data until the copy lands
  gate.Notify();
  PS_ASSERT_OK(handle.Wait());
  EXPECT_TRUE(*host_.IsValid(target));
  EXPECT_TRUE(testing::SameBytes(source.data(), target.data(), 4096));
  PS_EXPECT_OK(gated->Free(slot));
  PS_EXPECT_OK(host_.Free(target));
}

TEST_F(CopyEngineTest, FailedCopyLeavesDestinationInvalidAndReportsTheBlocks) {
  NvmeTierOptions options;
  options.tier = Tier::Options{"failing", 16 << 20, 1 << 20};
  options.directory = dir_.path();
  options.fault_injector = [](IoOp op, int64_t, int64_t) {
    return op == IoOp::kWrite ? IoFault{ENOSPC, -1} : IoFault{};
  };
  PS_ASSERT_OK_AND_ASSIGN(auto failing, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block source, host_.Allocate(8192));
  PS_ASSERT_OK_AND_ASSIGN(Block slot, failing->Allocate(8192));
  absl::Status status = engine_.CopyAndWait(source, slot);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("to block"));
  EXPECT_THAT(status.message(), HasSubstr("tier 'failing'"));
  EXPECT_THAT(status.message(), HasSubstr(failing->path()));
  EXPECT_FALSE(*failing->IsValid(slot));
  // An invalid slot is refused as a copy source.
  PS_ASSERT_OK_AND_ASSIGN(Block target, host_.Allocate(8192));
  absl::StatusOr<CopyHandle> from_torn = engine_.Copy(slot, target);
  EXPECT_EQ(from_torn.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(*host_.IsValid(target));  // untouched: the copy never started
  EXPECT_EQ(*host_.PinCount(source), 0);
}

TEST_F(CopyEngineTest, SizeMismatchAndSelfCopyAreInvalidArgument) {
  PS_ASSERT_OK_AND_ASSIGN(Block big, host_.Allocate(8192));
  PS_ASSERT_OK_AND_ASSIGN(Block small, host_.Allocate(4096));
  absl::StatusOr<CopyHandle> too_big = engine_.Copy(big, small);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr("8192 bytes"));
  EXPECT_EQ(engine_.Copy(big, big).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_.Copy(Block{}, big).status().code(), absl::StatusCode::kInvalidArgument);
  PS_EXPECT_OK(engine_.CopyAndWait(small, big));  // smaller into larger is fine
}

TEST(DeviceTierTest, CudaDeviceTierRoundTrip) {
  if (gpu::DeviceCount() == 0) {
    absl::StatusOr<std::unique_ptr<Tier>> tier = CreateDeviceTier({});
    EXPECT_EQ(tier.status().code(), absl::StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "no GPU: " << gpu::UnavailableReason();
  }
  DeviceTierOptions options;
  options.tier.budget_bytes = 64 << 20;
  PS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Tier> device, CreateDeviceTier(options));
  EXPECT_EQ(device->kind(), TierKind::kDevice);
  HostTierOptions host_options;
  host_options.pinned = true;
  HostTier host(host_options);
  EXPECT_TRUE(host.pinned());
  TempDir dir;
  NvmeTierOptions nvme_options;
  nvme_options.directory = dir.path();
  nvme_options.tier.budget_bytes = 64 << 20;
  PS_ASSERT_OK_AND_ASSIGN(auto nvme, NvmeTier::Create(nvme_options));
  CopyEngine engine;
  PS_ASSERT_OK_AND_ASSIGN(Block source, host.Allocate(3 << 20));
  PS_ASSERT_OK_AND_ASSIGN(Block on_gpu, device->Allocate(3 << 20));
  PS_ASSERT_OK_AND_ASSIGN(Block on_gpu2, device->Allocate(3 << 20));
  PS_ASSERT_OK_AND_ASSIGN(Block on_nvme, nvme->Allocate(3 << 20));
  PS_ASSERT_OK_AND_ASSIGN(Block back, host.Allocate(3 << 20));
  testing::FillRandom(source.data(), source.bytes, 5);
  PS_ASSERT_OK(engine.CopyAndWait(source, on_gpu));    // H2D
  PS_ASSERT_OK(engine.CopyAndWait(on_gpu, on_gpu2));   // D2D
  PS_ASSERT_OK(engine.CopyAndWait(on_gpu2, on_nvme));  // D -> file, staged
  PS_ASSERT_OK(engine.CopyAndWait(on_nvme, on_gpu));   // file -> D, staged
  PS_ASSERT_OK(engine.CopyAndWait(on_gpu, back));      // D2H
  EXPECT_TRUE(testing::SameBytes(source.data(), back.data(), source.bytes));
  EXPECT_EQ(device->Allocate(128 << 20).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(GpuTest, StreamsAndEventsOrderWork) {
  if (gpu::DeviceCount() == 0) GTEST_SKIP() << "no GPU: " << gpu::UnavailableReason();
  PS_ASSERT_OK_AND_ASSIGN(gpu::Stream first, gpu::CreateStream(0));
  PS_ASSERT_OK_AND_ASSIGN(gpu::Stream second, gpu::CreateStream(0));
  PS_ASSERT_OK_AND_ASSIGN(gpu::Event event, gpu::CreateEvent(0));
  PS_ASSERT_OK_AND_ASSIGN(void* device, gpu::DeviceMalloc(0, 1 << 20));
  PS_ASSERT_OK_AND_ASSIGN(void* pinned, gpu::HostAllocPinned(1 << 20));
  PS_ASSERT_OK(gpu::MemsetAsync(device, 0x5a, 1 << 20, first));
  PS_ASSERT_OK(gpu::RecordEvent(event, first));
  PS_ASSERT_OK(gpu::StreamWaitEvent(second, event));  // the copy must see the memset
  PS_ASSERT_OK(gpu::CopyAsync(pinned, device, 1 << 20, second));
  PS_ASSERT_OK(gpu::SynchronizeStream(second));
  PS_ASSERT_OK_AND_ASSIGN(bool done, gpu::QueryEvent(event));
  EXPECT_TRUE(done);
  EXPECT_EQ(static_cast<unsigned char*>(pinned)[12345], 0x5a);
  gpu::HostFreePinned(pinned);
  gpu::DeviceFree(0, device);
  gpu::DestroyEvent(event);
  gpu::DestroyStream(first);
  gpu::DestroyStream(second);
}

}  // namespace
}  // namespace ps
