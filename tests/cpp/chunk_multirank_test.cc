// Multi-rank bookkeeping with a fake world of several ranks in one process: identical layouts,
// ownership, release of remote chunks after use, and gathers that bring back the owner's bytes.
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunk/chunk_manager.h"
#include "kernels/cast.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;
using ::testing::HasSubstr;

constexpr int64_t kChunkElements = 2048;

// Sizes chosen so first-fit puts some later tensors into earlier chunks.
std::vector<TensorSpec> ModelSpecs() {
  const int64_t sizes[] = {1500, 700, 400, 2048, 90, 1200, 1000, 300, 5000, 64, 640, 1900, 48};
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    specs.push_back(
        Spec(absl::StrCat("p", i), {sizes[i]}, ChunkKind::kComputeParam, DType::kFloat16));
  }
  for (size_t i = 0; i < std::size(sizes); ++i) {
    specs.push_back(Spec(absl::StrCat("p", i, ".master"), {sizes[i]}, ChunkKind::kMasterParam,
                         DType::kFloat32));
  }
  return specs;
}

uint16_t Pattern(TensorId tensor, int64_t i) { return static_cast<uint16_t>(tensor * 37 + i); }

struct Rank {
  testing::Hierarchy hierarchy = testing::MakeHierarchy(0, 0, 4096);
  std::unique_ptr<ChunkManager> manager;
};

class FakeWorldTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    world_size_ = GetParam();
    for (int r = 0; r < world_size_; ++r) {
      auto rank = std::make_unique<Rank>();
      ChunkManagerOptions options;
      options.world_size = world_size_;
      options.rank = r;
      rank->manager = testing::MakeManager(rank->hierarchy, options);
      for (const TensorSpec& spec : ModelSpecs()) {
        ASSERT_TRUE(rank->manager->RegisterTensor(spec).ok());
      }
      auto report = rank->manager->BuildChunkLists(kChunkElements);
      ASSERT_TRUE(report.ok()) << report.status();
      ranks_.push_back(std::move(rank));
    }
  }

  ChunkManager& M(int r) { return *ranks_[r]->manager; }

  int64_t NumComputeTensors() const { return static_cast<int64_t>(ModelSpecs().size() / 2); }

  int world_size_ = 0;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

TEST_P(FakeWorldTest, LayoutsAgreeAndOwnershipPartitionsEveryList) {
  for (int r = 1; r < world_size_; ++r) EXPECT_EQ(M(r).layout_hash(), M(0).layout_hash());
  for (ChunkKind kind : {ChunkKind::kComputeParam, ChunkKind::kMasterParam}) {
    const std::vector<ChunkId> list = M(0).ChunksOfKind(kind);
    ASSERT_EQ(list.size() % world_size_, 0u);
    for (size_t i = 0; i < list.size(); ++i) {
      const Chunk& chunk = **M(0).chunk(list[i]);
      EXPECT_EQ(chunk.owner_rank(), static_cast<int>(i % world_size_));
      EXPECT_EQ(chunk.group(), static_cast<int64_t>(i / world_size_));
      int owners = 0;
      for (int r = 0; r < world_size_; ++r) owners += M(r).IsLocal(list[i]) ? 1 : 0;
      EXPECT_EQ(owners, 1) << "chunk " << list[i];
    }
  }
  // A rank that registered one tensor under another name disagrees.
  Rank odd;
  ChunkManagerOptions options;
  options.world_size = world_size_;
  odd.manager = testing::MakeManager(odd.hierarchy, options);
  std::vector<TensorSpec> specs = ModelSpecs();
  specs[3].name = "renamed";
  for (const TensorSpec& spec : specs) ASSERT_TRUE(odd.manager->RegisterTensor(spec).ok());
  ASSERT_TRUE(odd.manager->BuildChunkLists(kChunkElements).ok());
  EXPECT_NE(odd.manager->layout_hash(), M(0).layout_hash());
}

TEST_P(FakeWorldTest, ReleaseAfterInitThenGatherRestoresTheOwnersBytes) {
  const int64_t compute_tensors = NumComputeTensors();
  const std::vector<ChunkId> list = M(0).ChunksOfKind(ChunkKind::kComputeParam);
  // Initialization: every rank builds the whole model with the same values, then keeps only
  // what it owns (release_after_init).
  for (int r = 0; r < world_size_; ++r) {
    for (TensorId t = 0; t < compute_tensors; ++t) {
      auto view = M(r).Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      auto* data = static_cast<uint16_t*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) data[i] = Pattern(t, i);
      ASSERT_TRUE(M(r).Release(t, TensorState::kHold).ok());
    }
    for (size_t first = 0; first < list.size(); first += world_size_) {
      ASSERT_TRUE(M(r).ReleaseGroup(list[first]).ok());
    }
    int64_t local_bytes = 0;
    for (ChunkId c : list) {
      const Chunk& chunk = **M(r).chunk(c);
      EXPECT_EQ(chunk.has_payload(), M(r).IsLocal(c) && !chunk.tensors().empty()) << c;
      if (chunk.has_payload()) local_bytes += chunk.bytes();
      for (TensorId t : chunk.tensors()) {
        EXPECT_EQ((*M(r).tensor(t))->state,
                  M(r).IsLocal(c) ? TensorState::kHold : TensorState::kReleased);
      }
    }
    EXPECT_EQ(M(r).Stats()[1].chunk_bytes, local_bytes);
  }

  // Forward in registration order, all ranks in lock step as collectives would force: gather a
  // group when the plan says so, compute, release groups once all their tensors were used.
  std::set<TensorId> used;
  std::set<ChunkId> released;  // groups released during the pass
  int64_t gathers = 0;
  for (TensorId t = 0; t < compute_tensors; ++t) {
    std::vector<GatherPlan> plans;
    for (int r = 0; r < world_size_; ++r) {
      auto plan = M(r).PlanGather(t);
      ASSERT_TRUE(plan.ok()) << plan.status();
      ASSERT_EQ(static_cast<int>(plan->chunks.size()), world_size_);
      ASSERT_TRUE(M(r).IsLocal(plan->local_chunk));
      EXPECT_EQ(plan->chunks[r], plan->local_chunk);
      plans.push_back(*plan);
    }
    for (int r = 1; r < world_size_; ++r) {
      EXPECT_EQ(plans[r].needs_gather, plans[0].needs_gather)
          << "ranks disagree on gathering for tensor " << t << ": a collective would hang";
      EXPECT_EQ(plans[r].chunks, plans[0].chunks);
    }
    if (plans[0].needs_gather) {
      ++gathers;
      for (int r = 0; r < world_size_; ++r) {
        std::vector<ChunkId> remote_with_tensors;
        for (ChunkId c : plans[r].chunks) {
          if (!M(r).IsLocal(c) && !(*M(r).chunk(c))->tensors().empty()) {
            remote_with_tensors.push_back(c);
          }
        }
        EXPECT_EQ(plans[r].to_receive, remote_with_tensors) << "rank " << r;
        for (ChunkId c : plans[r].to_receive) {
          const Chunk& owned = **M((*M(r).chunk(c))->owner_rank()).chunk(c);
          ASSERT_TRUE(owned.has_payload()) << "the owner always keeps its chunk";
          ASSERT_TRUE(M(r).MaterializeGathered(c, TierKind::kHost,
                                               [&](void* data, int64_t bytes) {
                                                 EXPECT_EQ(bytes, owned.bytes());
                                                 std::memcpy(data, owned.payload().data(), bytes);
                                                 return absl::OkStatus();
                                               })
                          .ok());
        }
        ASSERT_TRUE(M(r).CompleteGather(plans[r].local_chunk).ok());
        EXPECT_FALSE(M(r).PlanGather(t)->needs_gather);
      }
    }
    for (int r = 0; r < world_size_; ++r) {
      auto view = M(r).Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      const auto* data = static_cast<const uint16_t*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) {
        ASSERT_EQ(data[i], Pattern(t, i)) << "rank " << r << " tensor " << t << " element " << i;
      }
      ASSERT_TRUE(M(r).Release(t, TensorState::kHoldAfterFwd).ok());
    }
    used.insert(t);

    // A group goes once every tensor of it was used; every rank agrees.
    std::vector<ChunkId> expected_releasable;
    for (size_t first = 0; first < list.size(); first += world_size_) {
      bool all_used = true;
      for (int member = 0; member < world_size_; ++member) {
        for (TensorId u : (*M(0).chunk(list[first + member]))->tensors()) {
          all_used &= used.contains(u);
        }
      }
      if (all_used && !released.contains(list[first])) expected_releasable.push_back(list[first]);
    }
    for (int r = 0; r < world_size_; ++r) {
      EXPECT_EQ(M(r).ReleasableGroups(), expected_releasable) << "rank " << r << " tensor " << t;
      for (ChunkId first : expected_releasable) ASSERT_TRUE(M(r).ReleaseGroup(first).ok());
    }
    released.insert(expected_releasable.begin(), expected_releasable.end());
  }
  // Each group was gathered exactly once: tensors of a group stay available until all are used.
  EXPECT_EQ(gathers, static_cast<int64_t>(list.size() / world_size_));
  // After the pass no remote chunk holds memory, and the local ones kept their bytes.
  for (int r = 0; r < world_size_; ++r) {
    for (ChunkId c : list) {
      if (!M(r).IsLocal(c)) {
        EXPECT_FALSE((*M(r).chunk(c))->has_payload()) << c;
      }
    }
  }
  // A gather that did not receive what it had to is refused.
  const ChunkId remote = list[1];
  absl::Status incomplete = M(0).CompleteGather(remote);
  EXPECT_EQ(incomplete.code(), absl::StatusCode::kFailedPrecondition) << incomplete;
  EXPECT_THAT(incomplete.message(), HasSubstr("was not received"));
  absl::Status ungathered =
      M(0).Access((*M(0).chunk(remote))->tensors()[0], TierKind::kHost).status();
  EXPECT_EQ(ungathered.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ungathered.message(), HasSubstr("gather"));
}

TEST_P(FakeWorldTest, OptimizerStateLivesOnlyOnItsOwner) {
  for (int r = 0; r < world_size_; ++r) {
    for (TensorId t = NumComputeTensors(); t < M(r).num_tensors(); ++t) {
      const ChunkId c = (*M(r).tensor(t))->chunk;
      auto view = M(r).Access(t, TierKind::kHost);
      if (M(r).IsLocal(c)) {
        ASSERT_TRUE(view.ok()) << view.status();
        ASSERT_TRUE(M(r).Release(t, TensorState::kHold).ok());
      } else {
        ASSERT_EQ(view.status().code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(view.status().message(), HasSubstr("optimizer state"));
        EXPECT_THAT(view.status().message(), HasSubstr((*M(r).tensor(t))->name));
      }
    }
    absl::Status gather_local =
        M(r).MaterializeGathered(M(r).ChunksOfKind(ChunkKind::kComputeParam)[r], TierKind::kHost,
                                 [](void*, int64_t) { return absl::OkStatus(); });
    EXPECT_EQ(gather_local.code(), absl::StatusCode::kFailedPrecondition);
  }
}

// Note [Compute chunks re-made from the master]: the owner's compute chunks go with their groups
// and come back, from the masters, at the gather or at an access of the owner alone.
TEST_P(FakeWorldTest, OwnersComputeChunksAreDroppedAndRemadeFromTheirMasters) {
  const int64_t compute_tensors = NumComputeTensors();
  const std::vector<ChunkId> list = M(0).ChunksOfKind(ChunkKind::kComputeParam);
  const auto master_value = [](TensorId t, int64_t i) {
    return static_cast<float>(t * 1000 + i) * 0.37f - 5.0f;
  };
  // The last compute tensor has no master (a frozen 16-bit parameter): its chunk keeps its
  // payload.
  const TensorId frozen = compute_tensors - 1;
  for (int r = 0; r < world_size_; ++r) {
    ChunkManager& m = M(r);
    std::vector<std::pair<TensorId, TensorId>> pairs;
    for (TensorId t = 0; t < compute_tensors; ++t) {
      if (t != frozen) pairs.emplace_back(t, t + compute_tensors);
    }
    for (TensorId t = 0; t < compute_tensors; ++t) {
      const TensorId master = t + compute_tensors;
      const bool owned = m.IsLocal((*m.tensor(master))->chunk);
      std::vector<float> values((*m.tensor(t))->numel);
      for (size_t i = 0; i < values.size(); ++i) values[i] = master_value(t, i);
      if (owned) {
        auto view = m.Access(master, TierKind::kHost);
        ASSERT_TRUE(view.ok()) << view.status();
        std::memcpy(testing::ComputePointer(*view), values.data(), values.size() * 4);
        ASSERT_TRUE(m.Release(master, TensorState::kHold).ok());
      }
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_TRUE(kernels::CastFloatTo16(values.data(),
                                         static_cast<uint16_t*>(testing::ComputePointer(*view)),
                                         view->numel, DType::kFloat16)
                      .ok());
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    }
    auto declared = m.SetRemakeSources(pairs, &kernels::CastFloatTo16);
    ASSERT_TRUE(declared.ok()) << declared.status();
    const ChunkId frozen_chunk = (*m.tensor(frozen))->chunk;
    int64_t expected = 0;
    for (ChunkId c : list) {
      expected += m.IsLocal(c) && c != frozen_chunk && !(*m.chunk(c))->tensors().empty();
    }
    EXPECT_EQ(*declared, expected);
    for (size_t first = 0; first < list.size(); first += world_size_) {
      ASSERT_TRUE(m.ReleaseGroup(list[first]).ok());
    }
    for (ChunkId c : list) {
      const Chunk& chunk = **m.chunk(c);
      const bool kept = m.IsLocal(c) && c == frozen_chunk;
      EXPECT_EQ(chunk.has_payload(), kept) << c;
    }
    // The owner reads its tensors alone: each chunk is made again, bit for bit the values it
    // held (the frozen one was never dropped).
    for (TensorId t = 0; t < compute_tensors; ++t) {
      if (!m.IsLocal((*m.tensor(t))->chunk)) continue;
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      const auto* data = static_cast<const uint16_t*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) {
        ASSERT_EQ(data[i], kernels::FloatToHalfBits(master_value(t, i))) << t << " " << i;
      }
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    }
    EXPECT_EQ(m.remakes(), expected);
    // Released again, then made again by Remake (the gather's call) without any access.
    for (size_t first = 0; first < list.size(); first += world_size_) {
      ASSERT_TRUE(m.ReleaseGroup(list[first]).ok());
    }
    for (ChunkId c : list) {
      auto remade = m.Remake(c);
      ASSERT_TRUE(remade.ok()) << remade.status();
      EXPECT_EQ(*remade, m.Remakeable(c)) << c;
      if (m.Remakeable(c)) {
        for (TensorId t : (*m.chunk(c))->tensors()) {
          EXPECT_EQ((*m.tensor(t))->state, TensorState::kHold);
        }
      }
    }
    EXPECT_EQ(m.remakes(), 2 * expected);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FakeWorldTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("world", info.param);
                         });

}  // namespace
}  // namespace ps
