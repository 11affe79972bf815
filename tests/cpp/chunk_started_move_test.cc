// StartMove (Note [Started moves]): asynchronous read-ahead and write-back keep bytes, settle
// deterministically, free room before anything is evicted, and fail without losing data; and the
// spill order into NVMe (Note [Spill order]).
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "chunk/chunk_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;
using ::testing::HasSubstr;

constexpr int64_t kElements = 1024;
constexpr int64_t kChunkBytes = kElements * 4;

void Fill(ChunkManager& manager, TensorId tensor, TierKind tier, float value) {
  auto view = manager.Access(tensor, tier);
  ASSERT_TRUE(view.ok()) << view.status();
  auto* data = static_cast<float*>(testing::ComputePointer(*view));
  for (int64_t i = 0; i < view->numel; ++i) data[i] = value + static_cast<float>(i);
  ASSERT_TRUE(manager.Release(tensor, TensorState::kHold).ok());
}

void ExpectFilled(ChunkManager& manager, TensorId tensor, TierKind tier, float value) {
  auto view = manager.Access(tensor, tier);
  ASSERT_TRUE(view.ok()) << view.status();
  const auto* data = static_cast<const float*>(testing::ComputePointer(*view));
  for (int64_t i = 0; i < view->numel; ++i) {
    ASSERT_EQ(data[i], value + static_cast<float>(i)) << "tensor " << tensor << " element " << i;
  }
  ASSERT_TRUE(manager.Release(tensor, TensorState::kHold).ok());
}

int64_t StatOf(const ChunkManager& manager, TierKind kind, int64_t TierChunkStats::*member) {
  for (const TierChunkStats& stats : manager.Stats()) {
    if (stats.kind == kind) return stats.*member;
  }
  return -1;
}

class StartedMoveTest : public ::testing::Test {
 protected:
  // `chunks` one-tensor chunks with an NVMe tier below a host tier of `host_chunks` chunks.
  void Build(int chunks, int64_t host_chunks, IoFaultInjector injector = nullptr) {
    hierarchy_ = testing::MakeHierarchy(0, host_chunks * kChunkBytes, kChunkBytes);
    NvmeTierOptions nvme_options;
    nvme_options.tier = testing::TierOptions("nvme", 0, kChunkBytes);
    nvme_options.directory = dir_.path();
    nvme_options.fault_injector = std::move(injector);
    auto nvme = NvmeTier::Create(std::move(nvme_options));
    ASSERT_TRUE(nvme.ok()) << nvme.status();
    hierarchy_.nvme = std::shared_ptr<NvmeTier>(std::move(*nvme));
    manager_ = testing::MakeOneTensorPerChunkManager(hierarchy_, chunks);
    ASSERT_NE(manager_, nullptr);
  }

  testing::TempDir dir_;
  testing::Hierarchy hierarchy_;
  std::unique_ptr<ChunkManager> manager_;
};

TEST_F(StartedMoveTest, WriteBackAndReadAheadKeepBytes) {
  Build(3, 0);
  for (TensorId t = 0; t < 3; ++t) Fill(*manager_, t, TierKind::kHost, 100.0f * t);
  for (ChunkId c = 0; c < 3; ++c) {
    auto started = manager_->StartMove(c, TierKind::kNvme);
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_TRUE(*started);
    // In flight: pinned where it is, so no second move starts.
    EXPECT_TRUE((*manager_->chunk(c))->prefetch_in_flight());
    EXPECT_FALSE(*manager_->StartMove(c, TierKind::kDevice));
  }
  ASSERT_TRUE(manager_->Tick().ok());  // settles every started move
  for (ChunkId c = 0; c < 3; ++c) {
    EXPECT_EQ(*manager_->ChunkTier(c), TierKind::kNvme);
    ASSERT_TRUE(*manager_->StartMove(c, TierKind::kHost));
  }
  for (TensorId t = 0; t < 3; ++t) ExpectFilled(*manager_, t, TierKind::kHost, 100.0f * t);
  EXPECT_EQ(StatOf(*manager_, TierKind::kHost, &TierChunkStats::prefetch_issued), 3);
}

TEST_F(StartedMoveTest, NothingToStartIsFalse) {
  Build(2, 0);
  // No payload yet.
  EXPECT_FALSE(*manager_->StartMove(0, TierKind::kNvme));
  EXPECT_EQ(*manager_->ChunkTier(0), std::nullopt);
  Fill(*manager_, 0, TierKind::kHost, 1.0f);
  // Already there.
  EXPECT_FALSE(*manager_->StartMove(0, TierKind::kHost));
  // Pinned by a COMPUTE tensor.
  ASSERT_TRUE(manager_->Access(0, TierKind::kHost).ok());
  EXPECT_FALSE(*manager_->StartMove(0, TierKind::kNvme));
  ASSERT_TRUE(manager_->Release(0, TensorState::kHold).ok());
  EXPECT_FALSE(manager_->StartMove(7, TierKind::kNvme).ok());
}

// The sweep's ring: with room for one chunk on the host, reading the next chunk waits for the
// write-back of the previous one instead of evicting anything.
TEST_F(StartedMoveTest, ReadAheadWaitsForWriteBackInsteadOfEvicting) {
  Build(4, 1);
  for (TensorId t = 0; t < 4; ++t) Fill(*manager_, t, TierKind::kHost, 10.0f * t);  // evicts
  ASSERT_TRUE(*manager_->StartMove(3, TierKind::kNvme));
  const int64_t evictions_before = StatOf(*manager_, TierKind::kHost, &TierChunkStats::evictions);
  for (TensorId t = 0; t < 4; ++t) {
    ASSERT_TRUE(manager_->StartMove(t, TierKind::kHost).ok());  // settles t-1's write-back
    ExpectFilled(*manager_, t, TierKind::kHost, 10.0f * t);
    ASSERT_TRUE(*manager_->StartMove(t, TierKind::kNvme));
  }
  ASSERT_TRUE(manager_->EndIteration().ok());
  EXPECT_EQ(StatOf(*manager_, TierKind::kHost, &TierChunkStats::evictions), evictions_before);
  EXPECT_EQ(StatOf(*manager_, TierKind::kHost, &TierChunkStats::chunk_bytes), 0);
}

// Note [Started moves]: a failed write-back surfaces where it is settled, names the file, and
// leaves the chunk in memory with its bytes.
TEST_F(StartedMoveTest, FailedWriteBackKeepsTheBytesInMemory) {
  Build(1, 0, [](IoOp op, int64_t, int64_t) {
    return op == IoOp::kWrite ? IoFault{EIO, -1} : IoFault{};
  });
  Fill(*manager_, 0, TierKind::kHost, 7.0f);
  ASSERT_TRUE(*manager_->StartMove(0, TierKind::kNvme));
  const absl::Status settled = manager_->Tick();
  ASSERT_FALSE(settled.ok());
  EXPECT_THAT(std::string(settled.message()), HasSubstr(hierarchy_.nvme->path()));
  EXPECT_EQ(*manager_->ChunkTier(0), TierKind::kHost);
  EXPECT_FALSE((*manager_->chunk(0))->prefetch_in_flight());
  ExpectFilled(*manager_, 0, TierKind::kHost, 7.0f);
}

// A parameter with its two Adam state tensors, one chunk each, over `hierarchy`.
std::unique_ptr<ChunkManager> ParamAndStateManager(const testing::Hierarchy& hierarchy) {
  auto manager = testing::MakeManager(hierarchy);
  if (manager == nullptr) return nullptr;
  EXPECT_TRUE(manager->RegisterTensor(Spec("param", {kElements})).ok());
  EXPECT_TRUE(manager->RegisterTensor(Spec("momentum", {kElements}, ChunkKind::kMomentum)).ok());
  EXPECT_TRUE(manager->RegisterTensor(Spec("variance", {kElements}, ChunkKind::kVariance)).ok());
  EXPECT_TRUE(manager->BuildChunkLists(kElements).ok());
  return manager;
}

// Note [Spill order]: while warming up, optimizer state leaves the host for NVMe before a
// compute parameter, even one used less recently.
TEST(SpillOrderTest, OptimizerStateSpillsBeforeComputeParams) {
  testing::TempDir dir;
  testing::Hierarchy hierarchy = testing::MakeHierarchy(0, 2 * kChunkBytes, kChunkBytes,
                                                        &dir.path());
  auto manager = ParamAndStateManager(hierarchy);
  ASSERT_NE(manager, nullptr);
  const TensorId param = *manager->FindTensor("param");
  const TensorId momentum = *manager->FindTensor("momentum");
  const TensorId variance = *manager->FindTensor("variance");
  Fill(*manager, param, TierKind::kHost, 1.0f);     // least recently used
  Fill(*manager, momentum, TierKind::kHost, 2.0f);
  Fill(*manager, variance, TierKind::kHost, 3.0f);  // evicts one of the two
  const TensorInfo* param_info = *manager->tensor(param);
  const TensorInfo* momentum_info = *manager->tensor(momentum);
  EXPECT_EQ(*manager->ChunkTier(param_info->chunk), TierKind::kHost);
  EXPECT_EQ(*manager->ChunkTier(momentum_info->chunk), TierKind::kNvme);
  ExpectFilled(*manager, momentum, TierKind::kHost, 2.0f);
}

// Between two memory tiers the kind plays no part: plain LRU while warming up.
TEST(SpillOrderTest, DeviceToHostEvictionIsPlainLru) {
  testing::Hierarchy hierarchy = testing::MakeHierarchy(2 * kChunkBytes, 0, kChunkBytes);
  auto manager = ParamAndStateManager(hierarchy);
  ASSERT_NE(manager, nullptr);
  Fill(*manager, 0, TierKind::kDevice, 1.0f);
  Fill(*manager, 1, TierKind::kDevice, 2.0f);
  Fill(*manager, 2, TierKind::kDevice, 3.0f);
  EXPECT_EQ(*manager->ChunkTier((*manager->tensor(0))->chunk), TierKind::kHost);
  EXPECT_EQ(*manager->ChunkTier((*manager->tensor(1))->chunk), TierKind::kDevice);
}

}  // namespace
}  // namespace ps
