// The strict emulated device (Note [Strict device] in runtime/strict_device.h): CUDA's stream,
// event and memory rules, checked through runtime/gpu.h exactly as the CUDA code calls it.
#include <stdlib.h>

#include <cstring>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "runtime/copy_engine.h"
#include "runtime/device_tier.h"
#include "runtime/gpu.h"
#include "runtime/host_tier.h"
#include "runtime/strict_device.h"

namespace ps {
namespace {

// This binary always runs on the strict device, whatever the environment says.
const bool kStrict = [] { return setenv("PATRICKSTAR_STRICT_DEVICE", "1", 1) == 0; }();

constexpr int64_t kBytes = 1 << 16;

class StrictDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kStrict);
    ASSERT_TRUE(gpu::StrictDevice());
    gpu::strict::SetKernelDelay(absl::Milliseconds(30));
  }
  void TearDown() override { gpu::strict::SetKernelDelay(absl::Microseconds(200)); }
};

// Fills `bytes` of device memory with `value` as a kernel on `stream` (late, by the delay).
void LaunchFill(gpu::Stream stream, void* device, int value, int64_t bytes) {
  ASSERT_TRUE(gpu::strict::LaunchWork(stream, {{device, bytes}}, [device, value, bytes] {
                std::memset(gpu::WorkPointer(device), value, bytes);
              }).ok());
}

TEST_F(StrictDeviceTest, DeviceMemoryIsReachedOnlyThroughItsWorkPointer) {
  EXPECT_GT(gpu::DeviceCount(), 1);
  void* device = *gpu::DeviceMalloc(0, kBytes);
  gpu::Stream stream = *gpu::CreateStream(0);
  ASSERT_TRUE(gpu::MemsetAsync(device, 7, kBytes, stream).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(stream).ok());
  const auto* alias = static_cast<const unsigned char*>(gpu::WorkPointer(device));
  EXPECT_NE(static_cast<const void*>(alias), device);
  EXPECT_EQ(alias[0], 7);
  EXPECT_EQ(alias[kBytes - 1], 7);
  int host_value = 0;
  EXPECT_EQ(gpu::WorkPointer(&host_value), &host_value);  // host memory is its own
  gpu::DestroyStream(stream);
  gpu::DeviceFree(0, device);
}

TEST_F(StrictDeviceTest, HostTouchOfDeviceMemoryFaultsAndNamesTheAllocation) {
  void* device = *gpu::DeviceMalloc(0, kBytes);
  EXPECT_DEATH(std::memset(device, 0, kBytes),
               "the host touched device memory at 0x[0-9a-f]+ \\(offset 0 of cudaMalloc #");
  EXPECT_DEATH((void)*static_cast<volatile char*>(device), "on device 0");
  gpu::DeviceFree(0, device);
}

TEST_F(StrictDeviceTest, CopyAfterAKernelWithoutAWaitReadsStaleBytes) {
  void* device = *gpu::DeviceMalloc(0, kBytes);
  gpu::Stream compute = *gpu::CreateStream(0);
  gpu::Stream copy = *gpu::CreateStream(0);
  ASSERT_TRUE(gpu::MemsetAsync(device, 0, kBytes, copy).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(copy).ok());
  std::vector<unsigned char> host(kBytes, 9);

  LaunchFill(compute, device, 1, kBytes);
  ASSERT_TRUE(gpu::CopyAsync(host.data(), device, kBytes, copy).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(copy).ok());
  EXPECT_EQ(host[0], 0) << "the copy did not wait for the kernel, so it must read stale bytes";

  gpu::Event done = *gpu::CreateEvent(0);
  LaunchFill(compute, device, 2, kBytes);
  ASSERT_TRUE(gpu::RecordEvent(done, compute).ok());
  ASSERT_TRUE(gpu::StreamWaitEvent(copy, done).ok());
  ASSERT_TRUE(gpu::CopyAsync(host.data(), device, kBytes, copy).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(copy).ok());
  EXPECT_EQ(host[0], 2);
  EXPECT_EQ(host[kBytes - 1], 2);

  gpu::DestroyEvent(done);
  gpu::DestroyStream(compute);
  gpu::DestroyStream(copy);
  gpu::DeviceFree(0, device);
}

TEST_F(StrictDeviceTest, AnEventReRecordedWhileAWaitIsPendingKeepsThatWait) {
  void* device = *gpu::DeviceMalloc(0, kBytes);
  gpu::Stream slow = *gpu::CreateStream(0);
  gpu::Stream idle = *gpu::CreateStream(0);
  gpu::Stream copy = *gpu::CreateStream(0);
  gpu::Event event = *gpu::CreateEvent(0);
  std::vector<unsigned char> host(kBytes, 0);

  EXPECT_TRUE(*gpu::QueryEvent(event));  // never recorded: complete, as in CUDA
  LaunchFill(slow, device, 5, kBytes);
  ASSERT_TRUE(gpu::RecordEvent(event, slow).ok());
  ASSERT_TRUE(gpu::StreamWaitEvent(copy, event).ok());
  // Reused at once (the copy engine's event pool does this): the wait above still follows the
  // kernel, and queries now see the new, already complete record.
  ASSERT_TRUE(gpu::RecordEvent(event, idle).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(idle).ok());
  EXPECT_TRUE(*gpu::QueryEvent(event));
  ASSERT_TRUE(gpu::CopyAsync(host.data(), device, kBytes, copy).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(copy).ok());
  EXPECT_EQ(host[0], 5);

  gpu::DestroyEvent(event);
  for (gpu::Stream s : {slow, idle, copy}) gpu::DestroyStream(s);
  gpu::DeviceFree(0, device);
}

TEST_F(StrictDeviceTest, FreeingABlockThatQueuedWorkUsesIsRefused) {
  std::unique_ptr<Tier> tier = *CreateDeviceTier(DeviceTierOptions{0, {"cuda:0", 0, kBytes}});
  const Block block = *tier->Allocate(kBytes);
  gpu::Stream compute = *gpu::CreateStream(0);
  LaunchFill(compute, block.data(), 3, kBytes);
  const absl::Status refused = tier->Free(block);
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_NE(refused.message().find("still uses them"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("cuda:0"), std::string::npos) << refused;
  ASSERT_TRUE(gpu::SynchronizeStream(compute).ok());
  EXPECT_TRUE(tier->Free(block).ok());
  gpu::DestroyStream(compute);
}

TEST_F(StrictDeviceTest, AKernelTouchingAnotherDevicesMemoryIsAnIllegalAddress) {
  void* on_one = *gpu::DeviceMalloc(1, kBytes);
  gpu::Stream on_zero = *gpu::CreateStream(0);
  const absl::Status launched = gpu::strict::LaunchWork(on_zero, {{on_one, kBytes}}, [] {});
  EXPECT_TRUE(absl::IsFailedPrecondition(launched)) << launched;
  EXPECT_NE(launched.message().find("memory of device 1"), std::string::npos) << launched;
  const gpu::Event on_one_event = *gpu::CreateEvent(1);
  EXPECT_FALSE(gpu::RecordEvent(on_one_event, on_zero).ok());
  gpu::DestroyEvent(on_one_event);
  EXPECT_TRUE(absl::IsInvalidArgument(gpu::CreateStream(gpu::DeviceCount()).status()));
  gpu::DestroyStream(on_zero);
  gpu::DeviceFree(1, on_one);
}

TEST_F(StrictDeviceTest, DeviceCapacityAndCopyBoundsAreEnforced) {
  const absl::StatusOr<void*> too_big = gpu::DeviceMalloc(0, int64_t{1} << 40);
  EXPECT_TRUE(absl::IsResourceExhausted(too_big.status())) << too_big.status();
  void* device = *gpu::DeviceMalloc(0, kBytes);
  gpu::Stream stream = *gpu::CreateStream(0);
  std::vector<char> host(2 * kBytes);
  const absl::Status past_end = gpu::CopyAsync(host.data(), device, 2 * kBytes, stream);
  EXPECT_TRUE(absl::IsInvalidArgument(past_end)) << past_end;
  gpu::DestroyStream(stream);
  gpu::DeviceFree(0, device);
}

// The copy engine's device routes and Fill, on DeviceTier and a pinned HostTier: the tiers and
// routes a GPU run uses.
TEST_F(StrictDeviceTest, CopyEngineMovesBlocksThroughTheDeviceRoutes) {
  std::unique_ptr<Tier> device = *CreateDeviceTier(DeviceTierOptions{1, {"", 0, kBytes}});
  EXPECT_EQ(device->name(), "cuda:1");
  HostTierOptions host_options;
  host_options.tier = Tier::Options{"host", 0, kBytes};
  host_options.pinned = true;
  HostTier host(host_options);
  EXPECT_TRUE(host.pinned());
  CopyEngine engine(CopyEngine::Options{2, 1, nullptr});

  const Block source = *host.Allocate(kBytes);
  const Block on_device = *device->Allocate(kBytes);
  const Block back = *host.Allocate(kBytes);
  for (int64_t i = 0; i < kBytes; ++i) static_cast<unsigned char*>(source.data())[i] = i % 251;
  ASSERT_TRUE(engine.CopyAndWait(source, on_device).ok());
  ASSERT_TRUE(engine.CopyAndWait(on_device, back).ok());
  EXPECT_EQ(std::memcmp(source.data(), back.data(), kBytes), 0);

  ASSERT_TRUE(engine.Fill(on_device, 0).ok());
  ASSERT_TRUE(engine.CopyAndWait(on_device, back).ok());
  EXPECT_EQ(static_cast<unsigned char*>(back.data())[kBytes / 2], 0);

  // OrderAfter: a download issued after it waits for the compute stream's pending kernel.
  gpu::Stream compute = *gpu::CreateStream(1);
  LaunchFill(compute, on_device.data(), 4, kBytes);
  ASSERT_TRUE(engine.OrderAfter(compute).ok());
  ASSERT_TRUE(engine.CopyAndWait(on_device, back).ok());
  EXPECT_EQ(static_cast<unsigned char*>(back.data())[0], 4);
  gpu::DestroyStream(compute);

  for (const Block& block : {source, back}) EXPECT_TRUE(host.Free(block).ok());
  EXPECT_TRUE(device->Free(on_device).ok());
}

}  // namespace
}  // namespace ps
