// The chunk manager on the strict emulated device (Note [Strict device] in
// runtime/strict_device.h): the CUDA DeviceTier, a pinned host tier and the copy engine's device
// routes, where the host touching device memory crashes at once.
#include <stdlib.h>

#include <cstdint>
#include <cstring>

#include "absl/time/time.h"
#include "chunk/chunk_manager.h"
#include "gtest/gtest.h"
#include "runtime/gpu.h"
#include "runtime/strict_device.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

const bool kStrict = [] { return setenv("PATRICKSTAR_STRICT_DEVICE", "1", 1) == 0; }();
constexpr int64_t kChunkBytes = 1024 * 4;

// Note [Zero-filled chunks]: a chunk placed with no payload is zeroed by device work, never by a
// host memset of the device block (which faults here, and on a GPU). The block is reused from
// the tier's pool after another chunk dirtied it, so skipping the fill would show too.
TEST(ChunkStrictDeviceTest, ZeroFillOfADeviceChunkIsDeviceWork) {
  ASSERT_TRUE(kStrict && gpu::StrictDevice());
  testing::Hierarchy hierarchy = testing::MakeHierarchy(kChunkBytes, 0, kChunkBytes);
  auto manager = testing::MakeOneTensorPerChunkManager(hierarchy, 2);
  ASSERT_NE(manager, nullptr);
  EXPECT_EQ(hierarchy.device->name(), "device");
  EXPECT_EQ(hierarchy.device->address_space(), AddressSpace::kDeviceMemory);

  auto dirty = manager->Access(0, TierKind::kDevice);
  ASSERT_TRUE(dirty.ok()) << dirty.status();
  std::memset(testing::ComputePointer(*dirty), 0x7f, kChunkBytes);
  ASSERT_TRUE(manager->Release(0, TensorState::kFree).ok());  // drops the payload: block reused

  auto fresh = manager->Access(1, TierKind::kDevice);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->address, dirty->address) << "the test needs the dirtied block back";
  const auto* bytes = static_cast<const unsigned char*>(testing::ComputePointer(*fresh));
  for (int64_t i = 0; i < kChunkBytes; ++i) ASSERT_EQ(bytes[i], 0) << "byte " << i;
  ASSERT_TRUE(manager->Release(1, TensorState::kHold).ok());
  EXPECT_EQ(manager->Stats()[0].zero_fills, 2);
}

// A device chunk written by a kernel still queued on a compute stream: the copy that evicts it
// must not run before that kernel (CopyEngine::OrderAfter, Note [Copy stream ordering]).
TEST(ChunkStrictDeviceTest, EvictionAfterOrderAfterCopiesTheKernelsBytes) {
  ASSERT_TRUE(kStrict && gpu::StrictDevice());
  gpu::strict::SetKernelDelay(absl::Milliseconds(30));
  testing::Hierarchy hierarchy = testing::MakeHierarchy(kChunkBytes, 0, kChunkBytes);
  auto manager = testing::MakeOneTensorPerChunkManager(hierarchy, 2);
  ASSERT_NE(manager, nullptr);
  const gpu::Stream compute = *gpu::strict::ComputeStream(0);

  auto written = manager->Access(0, TierKind::kDevice);
  ASSERT_TRUE(written.ok()) << written.status();
  void* device = reinterpret_cast<void*>(static_cast<uintptr_t>(written->address));
  ASSERT_TRUE(gpu::strict::LaunchWork(compute, {{device, kChunkBytes}}, [device] {
                std::memset(gpu::WorkPointer(device), 0x11, kChunkBytes);
              }).ok());
  ASSERT_TRUE(hierarchy.engine->OrderAfter(compute).ok());
  ASSERT_TRUE(manager->Release(0, TensorState::kHold).ok());

  ASSERT_TRUE(manager->Access(1, TierKind::kDevice).ok());  // evicts chunk 0 to the host
  ASSERT_TRUE(manager->Release(1, TensorState::kHold).ok());
  auto moved = manager->Access(0, TierKind::kHost);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(static_cast<const unsigned char*>(testing::ComputePointer(*moved))[0], 0x11);
  EXPECT_EQ(static_cast<const unsigned char*>(testing::ComputePointer(*moved))[kChunkBytes - 1],
            0x11);
  ASSERT_TRUE(manager->Release(0, TensorState::kHold).ok());
  gpu::strict::SetKernelDelay(absl::Microseconds(200));
}

}  // namespace
}  // namespace ps
