// Moves keep bytes intact: random payloads round-trip device -> host -> NVMe -> device, both
// through explicit moves and through evictions down the hierarchy.
#include <cstring>
#include <random>
#include <vector>

#include "chunk/chunk_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/device_tier.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;

constexpr int64_t kChunkElements = 4096;  // 16 KiB of fp32
constexpr int64_t kChunkBytes = kChunkElements * 4;

std::vector<uint8_t> RandomBytes(int64_t bytes, uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<uint8_t> data(bytes);
  for (uint8_t& byte : data) byte = static_cast<uint8_t>(generator());
  return data;
}

class ChunkMoveTest : public ::testing::Test {
 protected:
  void Build(int64_t device_budget, int64_t host_budget, int tensors) {
    hierarchy_ = testing::MakeHierarchy(device_budget, host_budget, kChunkBytes, &nvme_dir_.path());
    manager_ = testing::MakeManager(hierarchy_);
    ASSERT_NE(manager_, nullptr);
    // Two tensors per chunk, of different shapes, so offsets inside the chunk matter too.
    for (int i = 0; i < tensors; ++i) {
      std::vector<int64_t> shape =
          i % 2 == 0 ? std::vector<int64_t>{32, 64} : std::vector<int64_t>{kChunkElements - 2048};
      ASSERT_TRUE(manager_->RegisterTensor(Spec("t" + std::to_string(i), shape)).ok());
    }
    ASSERT_TRUE(manager_->BuildChunkLists(kChunkElements).ok());
    for (int i = 0; i < tensors; ++i) {
      const TensorInfo* info = *manager_->tensor(i);
      expected_.push_back(RandomBytes(info->numel * 4, 1000 + i));
    }
  }

  void WriteAll(TierKind tier) {
    for (TensorId t = 0; t < manager_->num_tensors(); ++t) {
      auto view = manager_->Access(t, tier);
      ASSERT_TRUE(view.ok()) << view.status();
      std::memcpy(testing::ComputePointer(*view), expected_[t].data(), expected_[t].size());
      ASSERT_TRUE(manager_->Release(t, TensorState::kHold).ok());
    }
  }

  void CheckAll(TierKind tier) {
    for (TensorId t = 0; t < manager_->num_tensors(); ++t) {
      auto view = manager_->Access(t, tier);
      ASSERT_TRUE(view.ok()) << view.status();
      EXPECT_EQ(
          std::memcmp(testing::ComputePointer(*view), expected_[t].data(), expected_[t].size()), 0)
          << "tensor " << t << " corrupted";
      ASSERT_TRUE(manager_->Release(t, TensorState::kHold).ok());
    }
  }

  testing::TempDir nvme_dir_;
  testing::Hierarchy hierarchy_;
  std::unique_ptr<ChunkManager> manager_;
  std::vector<std::vector<uint8_t>> expected_;
};

TEST_F(ChunkMoveTest, ExplicitMovesThroughEveryTierKeepBytes) {
  Build(0, 0, 6);
  ASSERT_EQ(manager_->num_chunks(), 3);
  WriteAll(TierKind::kDevice);
  const TierKind route[] = {TierKind::kHost, TierKind::kNvme, TierKind::kDevice,
                            TierKind::kNvme, TierKind::kHost, TierKind::kDevice};
  for (TierKind tier : route) {
    for (ChunkId c = 0; c < manager_->num_chunks(); ++c) {
      ASSERT_TRUE(manager_->MoveChunk(c, tier).ok());
      EXPECT_EQ(manager_->tier((*manager_->chunk(c))->tier_index()).kind(), tier);
    }
  }
  CheckAll(TierKind::kDevice);
  const std::vector<TierChunkStats> stats = manager_->Stats();
  // Each of the 3 chunks entered the host twice, NVMe twice, the device twice (after its
  // zero-filled start there).
  for (const TierChunkStats& tier : stats) {
    EXPECT_EQ(tier.bytes_in, 2 * 3 * kChunkBytes) << tier.name;
    EXPECT_EQ(tier.bytes_out, 2 * 3 * kChunkBytes) << tier.name;
  }
  EXPECT_EQ(stats[0].zero_fills, 3);
  EXPECT_EQ(stats[0].chunk_bytes, 3 * kChunkBytes);
  EXPECT_EQ(stats[1].chunk_bytes, 0);
  EXPECT_EQ(stats[2].chunk_bytes, 0);
}

TEST_F(ChunkMoveTest, EvictionsDownTheHierarchyKeepBytes) {
  // Device holds 2 chunks, host 2, so writing 6 chunks pushes 2 to NVMe; reading them back in
  // order cycles every chunk through all three tiers.
  Build(2 * kChunkBytes, 2 * kChunkBytes, 12);
  ASSERT_EQ(manager_->num_chunks(), 6);
  WriteAll(TierKind::kDevice);
  std::vector<TierChunkStats> stats = manager_->Stats();
  EXPECT_EQ(stats[0].chunk_bytes, 2 * kChunkBytes);
  EXPECT_EQ(stats[1].chunk_bytes, 2 * kChunkBytes);
  EXPECT_EQ(stats[2].chunk_bytes, 2 * kChunkBytes);
  EXPECT_GT(stats[1].evictions, 0);
  CheckAll(TierKind::kDevice);
  CheckAll(TierKind::kHost);
  stats = manager_->Stats();
  for (const TierChunkStats& tier : stats) {
    EXPECT_LE(tier.peak_chunk_bytes, tier.budget_bytes == 0 ? INT64_MAX : tier.budget_bytes);
    EXPECT_LE(tier.reserved_bytes, tier.budget_bytes == 0 ? INT64_MAX : tier.budget_bytes);
  }
  EXPECT_GT(stats[2].bytes_in, 0);
  EXPECT_GT(stats[2].bytes_out, 0);
}

TEST_F(ChunkMoveTest, EverythingPinnedIsResourceExhaustedWithTheNumbers) {
  Build(2 * kChunkBytes, 0, 6);
  auto first = manager_->Access(0, TierKind::kDevice);   // chunk 0
  auto second = manager_->Access(2, TierKind::kDevice);  // chunk 1
  ASSERT_TRUE(first.ok() && second.ok());
  absl::Status third = manager_->Access(4, TierKind::kDevice).status();  // chunk 2
  ASSERT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_THAT(third.message(), ::testing::HasSubstr("'t4'"));
  EXPECT_THAT(third.message(), ::testing::HasSubstr("budget 32768 bytes"));
  EXPECT_THAT(third.message(), ::testing::HasSubstr("32768 bytes pinned"));
  EXPECT_EQ((*manager_->tensor(4))->state, TensorState::kFree);
  // Releasing one makes room.
  ASSERT_TRUE(manager_->Release(0, TensorState::kHold).ok());
  EXPECT_TRUE(manager_->Access(4, TierKind::kDevice).ok());
}

// The same route with a real CUDA device tier (skipped without a CUDA build and a GPU): bytes are
// written on the host, travel host -> device -> NVMe -> device -> host and are compared there.
TEST(ChunkMoveCudaTest, RealDeviceTierRoundTripKeepsBytes) {
  auto device =
      CreateDeviceTier(DeviceTierOptions{0, testing::TierOptions("cuda", 0, kChunkBytes)});
  if (!device.ok()) GTEST_SKIP() << device.status();
  testing::TempDir nvme_dir;
  testing::Hierarchy hierarchy = testing::MakeHierarchy(0, 0, kChunkBytes, &nvme_dir.path());
  ChunkManagerOptions options;
  options.tiers = {std::shared_ptr<Tier>(std::move(*device)), hierarchy.host, hierarchy.nvme};
  options.copy_engine = hierarchy.engine;
  auto manager = ChunkManager::Create(std::move(options));
  ASSERT_TRUE(manager.ok()) << manager.status();
  ASSERT_TRUE((*manager)->RegisterTensor(Spec("w", {kChunkElements})).ok());
  ASSERT_TRUE((*manager)->BuildChunkLists(kChunkElements).ok());
  const std::vector<uint8_t> expected = RandomBytes(kChunkBytes, 99);
  auto view = (*manager)->Access(0, TierKind::kHost);
  ASSERT_TRUE(view.ok()) << view.status();
  std::memcpy(testing::ComputePointer(*view), expected.data(), expected.size());
  ASSERT_TRUE((*manager)->Release(0, TensorState::kHold).ok());
  for (TierKind tier : {TierKind::kDevice, TierKind::kNvme, TierKind::kDevice, TierKind::kHost}) {
    ASSERT_TRUE((*manager)->MoveChunk(0, tier).ok());
  }
  view = (*manager)->Access(0, TierKind::kHost);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(std::memcmp(testing::ComputePointer(*view), expected.data(), expected.size()), 0);
  auto on_device = (*manager)->Access(0, TierKind::kDevice);
  EXPECT_EQ(on_device.status().code(), absl::StatusCode::kFailedPrecondition)
      << "the chunk computes on the host; it cannot move to the device now";
  ASSERT_TRUE((*manager)->Release(0, TensorState::kHold).ok());
  on_device = (*manager)->Access(0, TierKind::kDevice);
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  EXPECT_EQ(on_device->address_space, AddressSpace::kDeviceMemory);
}

}  // namespace
}  // namespace ps
