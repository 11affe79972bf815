// The tensor state machine: the legal table, every illegal pair refused through the manager's
// API, and the rules that tie states to chunk residency.
#include <cstring>
#include <set>
#include <utility>

#include "chunk/chunk_manager.h"
#include "chunk/tensor_state.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/status.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;
using ::testing::HasSubstr;

using S = TensorState;

// Written out independently of tensor_state.cc: the machine of Note [Tensor state machine].
const std::set<std::pair<S, S>>& ExpectedLegal() {
  static const auto* legal = new std::set<std::pair<S, S>>{
      {S::kFree, S::kCompute},
      {S::kCompute, S::kHold},
      {S::kCompute, S::kHoldAfterFwd},
      {S::kCompute, S::kHoldAfterBwd},
      {S::kCompute, S::kFree},
      {S::kHold, S::kCompute},
      {S::kHold, S::kFree},
      {S::kHold, S::kReleased},
      {S::kHoldAfterFwd, S::kCompute},
      {S::kHoldAfterFwd, S::kHold},
      {S::kHoldAfterFwd, S::kFree},
      {S::kHoldAfterFwd, S::kReleased},
      {S::kHoldAfterBwd, S::kCompute},
      {S::kHoldAfterBwd, S::kHold},
      {S::kHoldAfterBwd, S::kFree},
      {S::kHoldAfterBwd, S::kReleased},
      {S::kReleased, S::kCompute},
      {S::kReleased, S::kHold},
      {S::kReleased, S::kFree},
  };
  return *legal;
}

TEST(TensorStateTest, TableMatchesTheDesignAndErrorsNameTensorAndStates) {
  int legal_count = 0;
  for (S from : kAllTensorStates) {
    for (S to : kAllTensorStates) {
      const bool expected = ExpectedLegal().contains({from, to});
      EXPECT_EQ(IsLegalTransition(from, to), expected)
          << TensorStateName(from) << " -> " << TensorStateName(to);
      absl::Status status = CheckTransition("layer.weight", from, to);
      EXPECT_EQ(status.ok(), expected);
      if (!expected) {
        EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(status.message(), HasSubstr("'layer.weight'"));
        EXPECT_THAT(status.message(),
                    HasSubstr(absl::StrCat(TensorStateName(from), " -> ", TensorStateName(to))));
      }
      legal_count += expected;
    }
  }
  EXPECT_EQ(legal_count, 19);
}

// Drives tensor "w" of a fresh manager into `state`. The world has 2 ranks and this is rank 1,
// so "w" (in chunk 0, owned by rank 0) is remote and can be RELEASED. "w2" shares its chunk and
// holds data, so the payload stays when "w" alone is RELEASED and RELEASED -> COMPUTE is a plain
// access (with the whole chunk released it needs a gather first; see the next test).
class StateMachineThroughManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ChunkManagerOptions options;
    options.world_size = 2;
    options.rank = 1;
    manager_ = testing::MakeManager(hierarchy_, options);
    ASSERT_NE(manager_, nullptr);
    ASSERT_TRUE(manager_->RegisterTensor(Spec("w", {256})).ok());
    ASSERT_TRUE(manager_->RegisterTensor(Spec("mine", {1024})).ok());
    ASSERT_TRUE(manager_->RegisterTensor(Spec("w2", {256})).ok());
    ASSERT_TRUE(manager_->RegisterTensor(Spec("never_written", {256})).ok());
    ASSERT_TRUE(manager_->BuildChunkLists(1024).ok());
    ASSERT_EQ((*manager_->tensor(3))->chunk, 0);
    ASSERT_FALSE(manager_->IsLocal(0));
    ASSERT_EQ((*manager_->tensor(2))->chunk, 0);
    ASSERT_TRUE(manager_->Access(2, TierKind::kHost).ok());
    ASSERT_TRUE(manager_->Release(2, S::kHold).ok());
  }

  absl::Status Drive(S state) {
    if (state == S::kFree) return absl::OkStatus();
    PS_RETURN_IF_ERROR(manager_->Access(0, TierKind::kHost).status());
    if (state == S::kCompute) return absl::OkStatus();
    if (state == S::kReleased) {
      PS_RETURN_IF_ERROR(manager_->Release(0, S::kHold));
      return manager_->SetTensorState(0, S::kReleased);
    }
    return manager_->Release(0, state);
  }

  // The API a caller uses for `from -> to`.
  absl::Status Attempt(S from, S to) {
    if (to == S::kCompute) return manager_->Access(0, TierKind::kHost).status();
    if (from == S::kCompute) return manager_->Release(0, to);
    return manager_->SetTensorState(0, to);
  }

  testing::Hierarchy hierarchy_ = testing::MakeHierarchy(0, 0, 4096);
  std::unique_ptr<ChunkManager> manager_;
};

TEST_F(StateMachineThroughManagerTest, EveryPairIsAcceptedExactlyWhenLegal) {
  for (S from : kAllTensorStates) {
    for (S to : kAllTensorStates) {
      if (from == S::kReleased && to == S::kHold) continue;  // needs a gather; next test
      SetUp();
      ASSERT_TRUE(Drive(from).ok()) << TensorStateName(from);
      ASSERT_EQ((*manager_->tensor(0))->state, from);
      absl::Status status = Attempt(from, to);
      const bool legal = ExpectedLegal().contains({from, to});
      EXPECT_EQ(status.ok(), legal)
          << TensorStateName(from) << " -> " << TensorStateName(to) << ": " << status;
      if (legal) {
        EXPECT_EQ((*manager_->tensor(0))->state, to);
      } else {
        EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
        EXPECT_THAT(status.message(), HasSubstr("'w'"));
        EXPECT_THAT(status.message(), HasSubstr(TensorStateName(from)));
        EXPECT_THAT(status.message(), HasSubstr(TensorStateName(to)));
        EXPECT_EQ((*manager_->tensor(0))->state, from) << "a refused transition changed state";
      }
    }
  }
}

TEST_F(StateMachineThroughManagerTest, ReleasedBackToHoldOnlyThroughAGather) {
  ASSERT_TRUE(Drive(S::kReleased).ok());
  EXPECT_TRUE((*manager_->chunk(0))->has_payload()) << "w2 still holds data";
  ASSERT_TRUE(manager_->SetTensorState(2, S::kReleased).ok());
  EXPECT_FALSE((*manager_->chunk(0))->has_payload());
  absl::Status access = manager_->Access(0, TierKind::kHost).status();
  EXPECT_EQ(access.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(access.message(), HasSubstr("gather"));
  // A FREE neighbour cannot zero-fill the chunk either: that would pass zeros off as w's data.
  absl::Status neighbour = manager_->Access(3, TierKind::kHost).status();
  EXPECT_EQ(neighbour.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(neighbour.message(), HasSubstr("gather"));
  absl::Status direct = manager_->SetTensorState(0, S::kHold);
  EXPECT_EQ(direct.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(direct.message(), HasSubstr("MaterializeGathered"));
  ASSERT_TRUE(manager_
                  ->MaterializeGathered(0, TierKind::kHost,
                                        [](void* data, int64_t bytes) {
                                          std::memset(data, 0x3f, bytes);
                                          return absl::OkStatus();
                                        })
                  .ok());
  EXPECT_EQ((*manager_->tensor(0))->state, S::kHold);
  EXPECT_EQ((*manager_->tensor(2))->state, S::kHold);
  auto view = manager_->Access(0, TierKind::kHost);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(static_cast<const uint8_t*>(testing::ComputePointer(*view))[17], 0x3f);
}

TEST_F(StateMachineThroughManagerTest, ComputeEntersAndLeavesOnlyThroughAccessAndRelease) {
  ASSERT_TRUE(Drive(S::kHold).ok());
  EXPECT_THAT(manager_->SetTensorState(0, S::kCompute).message(), HasSubstr("Access"));
  ASSERT_TRUE(manager_->Access(0, TierKind::kHost).ok());
  EXPECT_THAT(manager_->SetTensorState(0, S::kHold).message(), HasSubstr("Release"));
  // The local chunk's tensor cannot be RELEASED: its data lives nowhere else.
  ASSERT_TRUE(manager_->Access(1, TierKind::kHost).ok());
  ASSERT_TRUE(manager_->Release(1, S::kHold).ok());
  absl::Status local = manager_->SetTensorState(1, S::kReleased);
  EXPECT_EQ(local.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(local.message(), HasSubstr("owned by this rank"));
}

TEST(ChunkResidencyTest, AChunkWithAComputeTensorNeverMoves) {
  testing::TempDir nvme_dir;
  auto hierarchy = testing::MakeHierarchy(0, 0, 4096, &nvme_dir.path());
  auto manager = testing::MakeManager(hierarchy);
  ASSERT_TRUE(manager->RegisterTensor(Spec("a", {512})).ok());
  ASSERT_TRUE(manager->RegisterTensor(Spec("b", {512})).ok());
  ASSERT_TRUE(manager->BuildChunkLists(1024).ok());
  ASSERT_TRUE(manager->Access(0, TierKind::kDevice).ok());
  // The same chunk on another tier while "a" computes on the device: refused.
  absl::Status elsewhere = manager->Access(1, TierKind::kHost).status();
  EXPECT_EQ(elsewhere.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(elsewhere.message(), HasSubstr("'b'"));
  EXPECT_EQ(manager->MoveChunk(0, TierKind::kNvme).code(), absl::StatusCode::kFailedPrecondition);
  // The same tier is fine: both tensors compute in one chunk.
  ASSERT_TRUE(manager->Access(1, TierKind::kDevice).ok());
  ASSERT_TRUE(manager->Release(0, S::kHold).ok());
  EXPECT_EQ(manager->MoveChunk(0, TierKind::kHost).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(manager->Release(1, S::kHold).ok());
  EXPECT_TRUE(manager->MoveChunk(0, TierKind::kNvme).ok());
  EXPECT_EQ(manager->Access(0, TierKind::kNvme).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChunkResidencyTest, FreeDropsThePayloadAndTheNextAccessZeroFills) {
  auto hierarchy = testing::MakeHierarchy(0, 0, 4096);
  auto manager = testing::MakeManager(hierarchy);
  ASSERT_TRUE(manager->RegisterTensor(Spec("a", {512})).ok());
  ASSERT_TRUE(manager->RegisterTensor(Spec("b", {512})).ok());
  ASSERT_TRUE(manager->BuildChunkLists(1024).ok());
  for (TensorId t : {0, 1}) {
    auto view = manager->Access(t, TierKind::kHost);
    ASSERT_TRUE(view.ok());
    std::memset(testing::ComputePointer(*view), 0x7a, 512 * 4);
    ASSERT_TRUE(manager->Release(t, S::kHold).ok());
  }
  ASSERT_TRUE(manager->SetTensorState(0, S::kFree).ok());
  EXPECT_TRUE((*manager->chunk(0))->has_payload()) << "b still holds data";
  ASSERT_TRUE(manager->SetTensorState(1, S::kFree).ok());
  EXPECT_FALSE((*manager->chunk(0))->has_payload());
  EXPECT_EQ(manager->Stats()[1].chunk_bytes, 0);
  auto view = manager->Access(1, TierKind::kHost);
  ASSERT_TRUE(view.ok());
  const auto* floats = static_cast<const float*>(testing::ComputePointer(*view));
  for (int i = 0; i < 512; ++i) ASSERT_EQ(floats[i], 0.0f) << i;
  EXPECT_EQ(manager->Stats()[1].zero_fills, 2);
  EXPECT_EQ(manager->View(0).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ps
