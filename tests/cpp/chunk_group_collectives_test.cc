// GroupCollectives over a fake world of 2 and 4 ranks, each rank on its own thread with its own
// chunk manager and communicator: gathers bring back the owners' bytes with one collective per
// group, reduce-scatters leave each rank the average of its own chunk and drop the rest, the
// memory-saving mode gives the same bytes with broadcast/reduce, and a rank that never comes
// makes the others fail with DeadlineExceeded naming the collective.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "chunk/group_collectives.h"
#include "kernels/cast.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"
#include "tests/cpp/fake_communicator.h"

namespace ps {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kChunkElements = 1024;

// Compute params and their gradients; sizes chosen so groups have several tensors, one group has
// an empty (padding) member for world size 4, and first-fit reorders a little.
std::vector<TensorSpec> ModelSpecs() {
  const int64_t sizes[] = {700, 300, 1000, 24, 512, 512, 900, 100, 64, 1024, 333};
  std::vector<TensorSpec> specs;
  for (ChunkKind kind : {ChunkKind::kComputeParam, ChunkKind::kGradient}) {
    for (size_t i = 0; i < std::size(sizes); ++i) {
      specs.push_back(testing::Spec(absl::StrCat("p", i, kind == ChunkKind::kGradient ? "#g" : ""),
                                    {sizes[i]}, kind, DType::kFloat32));
    }
  }
  return specs;
}

int64_t NumParams() { return static_cast<int64_t>(ModelSpecs().size() / 2); }

float Value(TensorId tensor, int64_t i) { return static_cast<float>(tensor * 1000 + i % 997); }

struct Rank {
  testing::Hierarchy hierarchy = testing::MakeHierarchy(0, 0, 8192);
  std::unique_ptr<ChunkManager> manager;
  std::unique_ptr<testing::FakeCommunicator> communicator;
  std::unique_ptr<GroupCollectives> collectives;
};

// The ranks of `world`, each with `tensors` tensors of a whole chunk (tensor t alone in chunk t,
// owned by rank t % world); `configure` adjusts a rank's hierarchy and manager options.
std::vector<std::unique_ptr<Rank>> OneTensorPerChunk(
    const std::shared_ptr<testing::FakeWorld>& world, int tensors,
    const std::function<void(int, Rank&, ChunkManagerOptions&)>& configure,
    GroupCollectiveOptions collective_options = {}) {
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < world->world_size(); ++r) {
    auto rank = std::make_unique<Rank>();
    ChunkManagerOptions options;
    options.world_size = world->world_size();
    options.rank = r;
    configure(r, *rank, options);
    rank->manager = testing::MakeManager(rank->hierarchy, options);
    for (int t = 0; t < tensors; ++t) {
      const TensorSpec spec = testing::Spec(absl::StrCat("w", t), {kChunkElements});
      EXPECT_TRUE(rank->manager->RegisterTensor(spec).ok());
    }
    EXPECT_TRUE(rank->manager->BuildChunkLists(kChunkElements).ok());
    rank->communicator = std::make_unique<testing::FakeCommunicator>(world, r);
    rank->collectives = *GroupCollectives::Create(rank->manager.get(), rank->communicator.get(),
                                                  collective_options);
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

// Every rank builds every tensor (Value) in `tier`, as initialization does.
void WriteEveryTensor(ChunkManager& m, TierKind tier) {
  for (TensorId t = 0; t < m.num_tensors(); ++t) {
    auto view = m.Access(t, tier);
    ASSERT_TRUE(view.ok()) << view.status();
    auto* data = static_cast<float*>(testing::ComputePointer(*view));
    for (int64_t i = 0; i < view->numel; ++i) data[i] = Value(t, i);
    ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
  }
}

class GroupCollectivesTest : public ::testing::TestWithParam<int> {
 protected:
  void Build(GroupCollectiveOptions options,
             const std::vector<TensorSpec>& specs = ModelSpecs()) {
    world_size_ = GetParam();
    world_ = std::make_shared<testing::FakeWorld>(world_size_);
    for (int r = 0; r < world_size_; ++r) {
      auto rank = std::make_unique<Rank>();
      ChunkManagerOptions manager_options;
      manager_options.world_size = world_size_;
      manager_options.rank = r;
      rank->manager = testing::MakeManager(rank->hierarchy, manager_options);
      for (const TensorSpec& spec : specs) {
        ASSERT_TRUE(rank->manager->RegisterTensor(spec).ok());
      }
      ASSERT_TRUE(rank->manager->BuildChunkLists(kChunkElements).ok());
      rank->communicator = std::make_unique<testing::FakeCommunicator>(world_, r);
      auto collectives =
          GroupCollectives::Create(rank->manager.get(), rank->communicator.get(), options);
      ASSERT_TRUE(collectives.ok()) << collectives.status();
      rank->collectives = std::move(*collectives);
      ranks_.push_back(std::move(rank));
    }
  }

  void TearDown() override {
    // Every rank's worker stops before any rank's collectives or chunks go: a worker still
    // copying a collective (one rank's program returned early on a failed ASSERT, or left a
    // gather in flight) reads and writes the other ranks' buffers, which resetting their
    // collectives would free under it.
    for (auto& rank : ranks_) {
      if (rank->communicator != nullptr) rank->communicator->Shutdown();
    }
    for (auto& rank : ranks_) rank->collectives.reset();
    for (auto& rank : ranks_) rank->communicator.reset();
  }

  // Runs `program(rank)` on one thread per rank, as separate processes would. A rank whose
  // program stops on a fatal failure aborts the world, so the others fail at their next
  // collective instead of waiting for it, and the failure names the rank.
  void OnEveryRank(const std::function<void(int)>& program) {
    std::vector<std::thread> threads;
    for (int r = 0; r < world_size_; ++r) {
      threads.emplace_back([&, r] {
        program(r);
        if (::testing::Test::HasFatalFailure()) {
          ADD_FAILURE() << "rank " << r << " ended after a fatal failure of the test (this rank's "
                        << "or another's); aborting the world";
          world_->Abort();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
  }

  void Write(int r, TensorId tensor, float scale) {
    ChunkManager& m = *ranks_[r]->manager;
    auto view = m.Access(tensor, TierKind::kHost);
    ASSERT_TRUE(view.ok()) << view.status();
    auto* data = static_cast<float*>(testing::ComputePointer(*view));
    for (int64_t i = 0; i < view->numel; ++i) data[i] = scale * Value(tensor % NumParams(), i);
    ASSERT_TRUE(m.Release(tensor, TensorState::kHold).ok());
  }

  // Adds scale * Value to a tensor that holds data, as a gradient hook accumulates.
  void Add(int r, TensorId tensor, float scale) {
    ChunkManager& m = *ranks_[r]->manager;
    auto view = m.Access(tensor, TierKind::kHost);
    ASSERT_TRUE(view.ok()) << view.status();
    auto* data = static_cast<float*>(testing::ComputePointer(*view));
    for (int64_t i = 0; i < view->numel; ++i) data[i] += scale * Value(tensor % NumParams(), i);
    ASSERT_TRUE(m.Release(tensor, TensorState::kHold).ok());
  }

  // Initialization: every rank writes every parameter (1 * Value), then keeps its own chunks.
  void InitializeAndRelease(int r) {
    for (TensorId t = 0; t < NumParams(); ++t) Write(r, t, 1.0f);
    ASSERT_TRUE(ranks_[r]->collectives->ReleaseAll(ChunkKind::kComputeParam).ok());
  }

  // Reads a tensor and compares it with scale * Value.
  void Expect(int r, TensorId tensor, float scale) {
    ChunkManager& m = *ranks_[r]->manager;
    auto view = m.Access(tensor, TierKind::kHost);
    ASSERT_TRUE(view.ok()) << view.status();
    const auto* data = static_cast<const float*>(testing::ComputePointer(*view));
    for (int64_t i = 0; i < view->numel; ++i) {
      ASSERT_FLOAT_EQ(data[i], scale * Value(tensor % NumParams(), i))
          << "rank " << r << " tensor " << tensor << " element " << i;
    }
    ASSERT_TRUE(m.Release(tensor, TensorState::kHold).ok());
  }

  int world_size_ = 0;
  std::shared_ptr<testing::FakeWorld> world_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

TEST_P(GroupCollectivesTest, GatherBringsBackTheOwnersBytesOneCollectivePerGroup) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    InitializeAndRelease(r);
    // The owner changes its chunk (an optimizer step): remote ranks must receive the new bytes.
    for (TensorId t = 0; t < NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Write(r, t, 2.0f);
    }
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    for (ChunkId group : groups) {
      auto gathered = c.Gather(group);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_TRUE(*gathered);
      auto again = c.Gather(group);  // nothing missing any more: no collective
      ASSERT_TRUE(again.ok());
      EXPECT_FALSE(*again);
    }
    EXPECT_EQ(c.collectives_issued(), static_cast<int64_t>(groups.size()));
    for (TensorId t = 0; t < NumParams(); ++t) Expect(r, t, 2.0f);
  });
}

// Note [Compute chunks re-made from the master]: the owner's bf16 chunks go with their groups,
// and the gather sends what their fp32 masters say now, converted as the optimizer would.
TEST_P(GroupCollectivesTest, GatherRemakesTheOwnersDroppedChunkFromItsMaster) {
  std::vector<TensorSpec> specs;
  for (ChunkKind kind : {ChunkKind::kComputeParam, ChunkKind::kMasterParam}) {
    for (int i = 0; i < 5; ++i) {
      const bool compute = kind == ChunkKind::kComputeParam;
      specs.push_back(testing::Spec(absl::StrCat("p", i, compute ? "" : "#m"), {300 + 100 * i},
                                    kind, compute ? DType::kBFloat16 : DType::kFloat32));
    }
  }
  Build({}, specs);
  const auto value = [](TensorId t, int64_t i, float scale) {
    return scale * (static_cast<float>(t * 1000 + i) + 0.3f);
  };
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    std::vector<std::pair<TensorId, TensorId>> pairs;
    for (TensorId t = 0; t < 5; ++t) {
      pairs.emplace_back(t, t + 5);
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      auto* data = static_cast<uint16_t*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) {
        data[i] = kernels::FloatToBFloat16Bits(value(t, i, 1.0f));
      }
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    }
    auto declared = m.SetRemakeSources(pairs, &kernels::CastFloatTo16);
    ASSERT_TRUE(declared.ok()) << declared.status();
    ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
    for (ChunkId chunk : m.ChunksOfKind(ChunkKind::kComputeParam)) {
      EXPECT_FALSE((*m.chunk(chunk))->has_payload()) << "rank " << r << " chunk " << chunk;
    }
    // An optimizer step writes only the masters this rank owns.
    for (TensorId t = 5; t < 10; ++t) {
      if (!m.IsLocal((*m.tensor(t))->chunk)) continue;
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      auto* data = static_cast<float*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) data[i] = value(t - 5, i, 3.0f);
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    }
    for (ChunkId group : c.Groups(ChunkKind::kComputeParam)) {
      auto gathered = c.Gather(group);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
    }
    EXPECT_EQ(m.remakes(), *declared);
    for (TensorId t = 0; t < 5; ++t) {
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      const auto* data = static_cast<const uint16_t*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < view->numel; ++i) {
        ASSERT_EQ(data[i], kernels::FloatToBFloat16Bits(value(t, i, 3.0f)))
            << "rank " << r << " tensor " << t << " element " << i;
      }
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    }
  });
}

TEST_P(GroupCollectivesTest, ReduceScatterLeavesEachRankTheAverageOfItsChunk) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    // Rank r's gradients are (r + 1) * Value; tensor 3 gets no gradient on rank 0.
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (!(r == 0 && t == NumParams() + 3)) Write(r, t, static_cast<float>(r + 1));
    }
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kGradient);
    for (auto it = groups.rbegin(); it != groups.rend(); ++it) {
      ASSERT_TRUE(c.StartReduceScatter(*it).ok());
    }
    EXPECT_EQ(c.pending_reduce_scatters(), static_cast<int>(groups.size()));
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    EXPECT_EQ(c.collectives_issued(), static_cast<int64_t>(groups.size()));
    const float world = static_cast<float>(world_size_);
    const float mean = (world + 1) / 2;  // of 1..world
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      const TensorInfo& info = **m.tensor(t);
      if (!m.IsLocal(info.chunk)) {
        EXPECT_EQ(info.state, TensorState::kFree) << info.name;
        EXPECT_FALSE((*m.chunk(info.chunk))->has_payload()) << info.name;
        continue;
      }
      EXPECT_EQ(info.state, TensorState::kHold) << info.name;
      Expect(r, t, t == NumParams() + 3 ? mean - 1 / world : mean);
    }
  });
}

// Note [Releasing one group]: releasing is local; a released group is gathered again (with the
// owners' current bytes) and the other groups stay as they are. A group with a tensor in use is
// not released.
TEST_P(GroupCollectivesTest, ReleasingOneGroupRegathersOnlyThatGroup) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    InitializeAndRelease(r);
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    ASSERT_GE(groups.size(), 2u);
    for (ChunkId group : groups) ASSERT_TRUE(c.Gather(group).ok());
    const int64_t issued = c.collectives_issued();
    // A tensor of group 0 in use: the release is refused and changes nothing.
    TensorId in_use = -1;
    for (TensorId t = 0; t < NumParams(); ++t) {
      if (*c.GroupOf(t) == groups[0]) in_use = t;
    }
    ASSERT_GE(in_use, 0);
    ASSERT_TRUE(m.Access(in_use, TierKind::kHost).ok());
    auto refused = c.Release(groups[0]);
    ASSERT_TRUE(refused.ok()) << refused.status();
    EXPECT_FALSE(*refused);
    ASSERT_TRUE(m.Release(in_use, TensorState::kHold).ok());
    auto released = c.Release(groups[0]);
    ASSERT_TRUE(released.ok()) << released.status();
    EXPECT_TRUE(*released);
    for (ChunkId member = groups[0]; member < groups[0] + world_size_; ++member) {
      EXPECT_EQ((*m.chunk(member))->has_payload(), m.IsLocal(member)) << "chunk " << member;
    }
    // The owners change their bytes; only the released group is gathered again.
    for (TensorId t = 0; t < NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Write(r, t, 2.0f);
    }
    for (ChunkId group : groups) ASSERT_TRUE(c.Gather(group).ok());
    EXPECT_EQ(c.collectives_issued(), issued + 1);
    for (TensorId t = 0; t < NumParams(); ++t) {
      const bool fresh = m.IsLocal((*m.tensor(t))->chunk) || *c.GroupOf(t) == groups[0];
      Expect(r, t, fresh ? 2.0f : 1.0f);
    }
    EXPECT_FALSE(c.Release((*m.tensor(NumParams()))->chunk).ok())
        << "a gradient group is not released one by one";
  });
}

// Note [Waiting for reduce-scatters every rank issued]: rank 0 does not wait for a reduce-scatter
// that rank 1 has not issued when rank 1 went ahead on the watched communicator, nor past the
// bound; it waits for one every rank issued, which completes; a world that cannot tell who
// issued what finishes only what is done.
TEST_P(GroupCollectivesTest, WaitsOnlyForReduceScattersEveryRankIssued) {
  if (GetParam() != 2) GTEST_SKIP() << "two ranks take turns";
  Build({});
  auto watched_world = std::make_shared<testing::FakeWorld>(2);
  watched_world->CountIssued();
  testing::FakeCommunicator watched_0(watched_world, 0), watched_1(watched_world, 1);
  std::atomic<int> turn{0};
  auto wait_for = [&](int value) {
    while (turn != value) absl::SleepFor(absl::Milliseconds(1));
  };
  OnEveryRank([&](int r) {
    GroupCollectives& c = *ranks_[r]->collectives;
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) Write(r, t, 1.0f + r);
    const ChunkId group = c.Groups(ChunkKind::kGradient).back();
    if (r == 0) {
      // The world does not count yet: nothing is done, and nothing is waited for.
      ASSERT_TRUE(c.StartReduceScatter(group).ok());
      auto blind = c.FinishReduceScattersIssuedEverywhere(nullptr, absl::Seconds(30));
      ASSERT_TRUE(blind.ok()) << blind.status();
      EXPECT_EQ(blind->finished, 0);
      EXPECT_FALSE(blind->gave_up);
      turn = 1;
      ASSERT_TRUE(c.FinishReduceScatters().ok());
      wait_for(2);
      ASSERT_TRUE(c.StartReduceScatter(group).ok());  // counted: rank 1 has issued none
      turn = 3;
      wait_for(4);
      // Rank 1 went ahead on the watched communicator: it may be waiting there for rank 0, so
      // rank 0 stops at once (with no bound at all: a wrong wait hangs the test).
      auto ahead =
          c.FinishReduceScattersIssuedEverywhere(&watched_0, absl::InfiniteDuration());
      ASSERT_TRUE(ahead.ok()) << ahead.status();
      EXPECT_EQ(ahead->finished, 0);
      EXPECT_TRUE(ahead->gave_up);
      auto bounded = c.FinishReduceScattersIssuedEverywhere(nullptr, absl::Milliseconds(20));
      ASSERT_TRUE(bounded.ok()) << bounded.status();
      EXPECT_EQ(bounded->finished, 0);
      EXPECT_TRUE(bounded->gave_up);
      turn = 5;
      // Rank 1 issues its reduce-scatter a little later: this call waits for it and finishes.
      auto waited = c.FinishReduceScattersIssuedEverywhere(nullptr, absl::InfiniteDuration());
      ASSERT_TRUE(waited.ok()) << waited.status();
      EXPECT_EQ(waited->finished, 1);
      EXPECT_FALSE(waited->gave_up);
      EXPECT_EQ(c.pending_reduce_scatters(), 0);
      float value = 1;
      EXPECT_TRUE(watched_0.AllReduce(&value, 1, DType::kFloat32, ReduceOp::kSum, "x")
                      .Wait(absl::Seconds(30)).ok());
    } else {
      wait_for(1);
      ASSERT_TRUE(c.StartReduceScatter(group).ok());
      ASSERT_TRUE(c.FinishReduceScatters().ok());
      world_->CountIssued();
      turn = 2;
      wait_for(3);
      float value = 2;
      CollectiveHandle ahead = watched_1.AllReduce(&value, 1, DType::kFloat32, ReduceOp::kSum, "x");
      turn = 4;
      wait_for(5);
      absl::SleepFor(absl::Milliseconds(50));
      ASSERT_TRUE(c.StartReduceScatter(group).ok());
      ASSERT_TRUE(c.FinishReduceScatters().ok());
      EXPECT_TRUE(ahead.Wait(absl::Seconds(30)).ok());
    }
  });
}

// A started reduce-scatter that is done is finished without waiting for the ones behind it:
// its remote gradient payloads go at once.
TEST_P(GroupCollectivesTest, FinishingCompletedReduceScattersDropsTheirRemoteGradients) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) Write(r, t, 1.0f + r);
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kGradient);
    ASSERT_TRUE(c.StartReduceScatter(groups.back()).ok());
    int finished = 0;
    for (int tries = 0; tries < 10000 && finished == 0; ++tries) {
      auto done = c.FinishCompletedReduceScatters();
      ASSERT_TRUE(done.ok()) << done.status();
      finished = *done;
      if (finished == 0) absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(finished, 1);
    EXPECT_EQ(c.pending_reduce_scatters(), 0);
    for (ChunkId member = groups.back(); member < groups.back() + world_size_; ++member) {
      if (!m.IsLocal(member)) {
        EXPECT_FALSE((*m.chunk(member))->has_payload()) << member;
      }
    }
    auto none = c.FinishCompletedReduceScatters();
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(*none, 0);
    for (auto it = groups.rbegin() + 1; it != groups.rend(); ++it) {
      ASSERT_TRUE(c.StartReduceScatter(*it).ok());
    }
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Expect(r, t, (world_size_ + 1) / 2.0f);
    }
  });
}

// Note [Sharded accumulation]: a micro-step's reduce-scatter sums into the owner's chunk, the
// next micro-step adds its local gradients there and writes fresh remote chunks, and the
// boundary's average gives the average of the accumulated gradients.
TEST_P(GroupCollectivesTest, SumPerMicroStepThenAverageAccumulatesIntoTheOwnersShard) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    const std::vector<ChunkId> grads = c.Groups(ChunkKind::kGradient);
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) Write(r, t, 1.0f + r);
    for (auto it = grads.rbegin(); it != grads.rend(); ++it) {
      ASSERT_TRUE(c.StartReduceScatter(*it, ReduceOp::kSum).ok());
    }
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    const float sum = world_size_ * (world_size_ + 1) / 2.0f;
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      const bool local = m.IsLocal((*m.tensor(t))->chunk);
      if (local) Expect(r, t, sum);
      EXPECT_EQ(HoldsData((*m.tensor(t))->state), local) << "tensor " << t;
    }
    // Micro-step 2: the same gradients again.
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) {
        Add(r, t, 1.0f + r);
      } else {
        Write(r, t, 1.0f + r);
      }
    }
    for (auto it = grads.rbegin(); it != grads.rend(); ++it) {
      ASSERT_TRUE(c.StartReduceScatter(*it).ok());  // the options' kAvg
    }
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Expect(r, t, 2 * sum / world_size_);
    }
  });
}

// Note [FREE tensors in a reduced chunk]: a gradient freed on its owner (zero_grad) keeps its
// old bytes while the chunk's other tensors hold data; the reduce-scatter counts it as zeros.
TEST_P(GroupCollectivesTest, AFreeTensorInAnOwnedChunkWithDataAddsNothing) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) Write(r, t, 1.0f + r);
    // On its owner, the first tensor of every local gradient chunk with more than one tensor
    // is freed; its stale bytes stay in the payload.
    std::vector<TensorId> freed;
    for (ChunkId id : c.Groups(ChunkKind::kGradient)) {
      const ChunkId local = id + r;
      const std::vector<TensorId>& tensors = (*m.chunk(local))->tensors();
      if (tensors.size() < 2) continue;
      ASSERT_TRUE(m.SetTensorState(tensors.front(), TensorState::kFree).ok());
      freed.push_back(tensors.front());
    }
    const std::vector<ChunkId> grads = c.Groups(ChunkKind::kGradient);
    for (auto it = grads.rbegin(); it != grads.rend(); ++it) {
      ASSERT_TRUE(c.StartReduceScatter(*it).ok());
    }
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    const float sum = world_size_ * (world_size_ + 1) / 2.0f;
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (!m.IsLocal((*m.tensor(t))->chunk)) continue;
      const bool was_freed = std::find(freed.begin(), freed.end(), t) != freed.end();
      Expect(r, t, (was_freed ? sum - (1.0f + r) : sum) / world_size_);
    }
  });
}

// Note [One holder, one broadcast]: an oversize group's gather is one broadcast from its holder
// and its reduce-scatter one reduce to it, moving the tensor's bytes once.
TEST_P(GroupCollectivesTest, AnOversizeGroupMovesOnlyItsHoldersBytes) {
  constexpr int64_t kBig = 3 * kChunkElements;
  std::vector<TensorSpec> specs;
  for (ChunkKind kind : {ChunkKind::kComputeParam, ChunkKind::kGradient}) {
    specs.push_back(testing::Spec(absl::StrCat("big", kind == ChunkKind::kGradient ? "#g" : ""),
                                  {kBig}, kind, DType::kFloat32));
  }
  Build({}, specs);
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    auto fill = [&](TensorId t, float scale, bool check) {
      auto view = m.Access(t, TierKind::kHost);
      ASSERT_TRUE(view.ok()) << view.status();
      auto* data = static_cast<float*>(testing::ComputePointer(*view));
      for (int64_t i = 0; i < kBig; ++i) {
        const float expected = scale * static_cast<float>(i % 997);
        if (check) {
          ASSERT_FLOAT_EQ(data[i], expected) << "rank " << r << " element " << i;
        } else {
          data[i] = expected;
        }
      }
      ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
    };
    fill(0, 1.0f, /*check=*/false);  // initialization: every rank builds the tensor
    ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    ASSERT_EQ(groups.size(), 1u);
    ASSERT_TRUE((*m.chunk(groups[0]))->oversize());
    auto gathered = c.Gather(groups[0]);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    EXPECT_EQ(*gathered, world_size_ > 1) << "the holder alone needs no gather";
    fill(0, 1.0f, /*check=*/true);
    const int64_t gather_collectives = c.collectives_issued();
    EXPECT_EQ(gather_collectives, world_size_ > 1 ? 1 : 0);
    EXPECT_EQ(c.bytes_communicated(), gather_collectives * kBig * 4);
    fill(1, 1.0f + r, /*check=*/false);  // every rank's gradient of it
    const std::vector<ChunkId> grads = c.Groups(ChunkKind::kGradient);
    ASSERT_EQ(grads.size(), 1u);
    ASSERT_TRUE(c.StartReduceScatter(grads[0]).ok());
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    EXPECT_EQ(c.collectives_issued(), gather_collectives + 1);
    EXPECT_EQ(c.bytes_communicated(), (gather_collectives + 1) * kBig * 4);
    if (m.IsLocal((*m.tensor(1))->chunk)) {
      fill(1, (world_size_ + 1) / 2.0f, /*check=*/true);
    } else {
      EXPECT_FALSE(HoldsData((*m.tensor(1))->state)) << "the gradient went to its holder";
    }
  });
}

TEST_P(GroupCollectivesTest, MemorySavingModeGivesTheSameBytesWithBroadcastAndReduce) {
  GroupCollectiveOptions options;
  options.memory_saving = true;
  Build(options);
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    InitializeAndRelease(r);
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    for (ChunkId group : groups) ASSERT_TRUE(c.Gather(group).ok());
    for (TensorId t = 0; t < NumParams(); ++t) Expect(r, t, 1.0f);
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) Write(r, t, 1.0f + r);
    const std::vector<ChunkId> grads = c.Groups(ChunkKind::kGradient);
    for (ChunkId group : grads) ASSERT_TRUE(c.StartReduceScatter(group).ok());
    ASSERT_TRUE(c.FinishReduceScatters().ok());
    EXPECT_EQ(c.collectives_issued(),
              static_cast<int64_t>((groups.size() + grads.size()) * world_size_));
    for (TensorId t = NumParams(); t < 2 * NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Expect(r, t, (world_size_ + 1) / 2.0f);
    }
  });
}

TEST_P(GroupCollectivesTest, ARankThatNeverComesIsADeadlineNamingTheCollective) {
  GroupCollectiveOptions options;
  options.timeout = absl::Milliseconds(200);
  Build(options);
  OnEveryRank([&](int r) {
    InitializeAndRelease(r);
  });
  // Only rank 0 runs its program; the others are "dead".
  GroupCollectives& c = *ranks_[0]->collectives;
  auto gathered = c.Gather(c.Groups(ChunkKind::kComputeParam).front());
  ASSERT_FALSE(gathered.ok());
  EXPECT_EQ(gathered.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(gathered.status().message(), HasSubstr("allgather"));
  EXPECT_THAT(gathered.status().message(), HasSubstr("compute_param group 0"));
  EXPECT_THAT(gathered.status().message(), HasSubstr("on fake"));
}

// Note [Pinning a group for a collective]: a gather pins the local chunk by accessing one of its
// tensors, so a tensor of the group already in use cannot be pinned again (the engine used to
// access a local weight before gathering its group: "illegal state transition COMPUTE ->
// COMPUTE"). The collective is refused before anything is issued or materialized, naming the
// tensor, and the group gathers normally once the tensor is released.
TEST_P(GroupCollectivesTest, AGatherOfAGroupWithATensorInUseIsAClearError) {
  Build({});
  OnEveryRank([&](int r) { InitializeAndRelease(r); });
  ChunkManager& m = *ranks_[0]->manager;
  GroupCollectives& c = *ranks_[0]->collectives;
  const ChunkId group = c.Groups(ChunkKind::kComputeParam).front();
  TensorId in_use = -1;
  for (TensorId t = 0; t < NumParams() && in_use < 0; ++t) {
    if (m.IsLocal((*m.tensor(t))->chunk) && *c.GroupOf(t) == group) in_use = t;
  }
  ASSERT_GE(in_use, 0);
  ASSERT_TRUE(m.Access(in_use, TierKind::kHost).ok());
  for (bool start : {false, true}) {
    absl::StatusOr<bool> gathered = start ? c.StartGather(group) : c.Gather(group);
    ASSERT_FALSE(gathered.ok());
    EXPECT_EQ(gathered.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(gathered.status().message(), HasSubstr("compute_param group 0"));
    EXPECT_THAT(gathered.status().message(),
                HasSubstr(absl::StrCat("'", (*m.tensor(in_use))->name, "' is in use")));
  }
  EXPECT_EQ(c.collectives_issued(), 0);
  EXPECT_EQ(c.pending_gathers(), 0);
  EXPECT_EQ((*m.tensor(in_use))->state, TensorState::kCompute);
  for (int r = 0; r < world_size_; ++r) {
    const ChunkId member = group + r;
    if (!m.IsLocal(member)) {
      EXPECT_FALSE((*m.chunk(member))->has_payload()) << member;
    }
  }
  ASSERT_TRUE(m.Release(in_use, TensorState::kHold).ok());
  OnEveryRank([&](int r) {
    auto gathered = ranks_[r]->collectives->Gather(group);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    EXPECT_TRUE(*gathered);
    for (TensorId t = 0; t < NumParams(); ++t) {
      if (*ranks_[r]->collectives->GroupOf(t) == group) Expect(r, t, 1.0f);
    }
  });
}

// Note [Started gathers]: starting is only timing. Even ranks start every group's gather ahead
// and then gather them in order; odd ranks gather synchronously: the collectives still pair up
// (one per group, issued in the same order everywhere) and bring back the owners' bytes. While
// a gather is in flight its group's chunks with data are pinned, and starting it again issues
// nothing.
TEST_P(GroupCollectivesTest, StartedGathersKeepTheOrderAndPinTheirGroups) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    InitializeAndRelease(r);
    for (TensorId t = 0; t < NumParams(); ++t) {
      if (m.IsLocal((*m.tensor(t))->chunk)) Write(r, t, 3.0f);
    }
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    ASSERT_GT(groups.size(), 1u);
    const bool ahead = r % 2 == 0;
    if (ahead) {
      for (ChunkId group : groups) {
        auto started = c.StartGather(group);
        ASSERT_TRUE(started.ok()) << started.status();
        EXPECT_TRUE(*started);
        auto again = c.StartGather(group);
        ASSERT_TRUE(again.ok());
        EXPECT_FALSE(*again);
        for (int k = 0; k < world_size_; ++k) {
          const Chunk& member = **m.chunk(group + k);
          if (member.tensors().empty()) continue;
          EXPECT_TRUE(member.pinned()) << "rank " << r << " chunk " << member.id();
          EXPECT_TRUE(member.has_payload()) << "rank " << r << " chunk " << member.id();
        }
      }
      EXPECT_EQ(c.pending_gathers(), static_cast<int>(groups.size()));
      EXPECT_EQ(c.collectives_issued(), static_cast<int64_t>(groups.size()));
    }
    for (ChunkId group : groups) {
      auto gathered = c.Gather(group);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_TRUE(*gathered);
      for (int k = 0; k < world_size_; ++k) {
        EXPECT_FALSE((*m.chunk(group + k))->pinned()) << "rank " << r << " chunk " << group + k;
      }
    }
    EXPECT_EQ(c.pending_gathers(), 0);
    EXPECT_EQ(c.gathers_started(), ahead ? static_cast<int64_t>(groups.size()) : 0);
    EXPECT_EQ(c.collectives_issued(), static_cast<int64_t>(groups.size()));
    for (TensorId t = 0; t < NumParams(); ++t) Expect(r, t, 3.0f);
  });
}

// ReleaseAll after StartGather (an optimizer step, or an error in forward, while a gather is
// in flight) finishes it before dropping payloads; the next step gathers the group again.
TEST_P(GroupCollectivesTest, ReleaseAllFinishesAStartedGather) {
  Build({});
  OnEveryRank([&](int r) {
    ChunkManager& m = *ranks_[r]->manager;
    GroupCollectives& c = *ranks_[r]->collectives;
    InitializeAndRelease(r);
    const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
    ASSERT_GE(groups.size(), 2u);
    ASSERT_TRUE(c.StartGather(groups[0]).ok());
    ASSERT_TRUE(c.StartGather(groups[1]).ok());
    ASSERT_TRUE(c.FinishGathers().ok());
    EXPECT_EQ(c.pending_gathers(), 0);
    auto started = c.StartGather(groups[0]);  // gathered already: nothing to start
    ASSERT_TRUE(started.ok());
    EXPECT_FALSE(*started);
    EXPECT_EQ(c.pending_gathers(), 0);
    ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
    started = c.StartGather(groups[1]);
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_TRUE(*started);
    ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok()) << "rank " << r;
    EXPECT_EQ(c.pending_gathers(), 0);
    for (ChunkId id = 0; id < m.num_chunks(); ++id) {
      EXPECT_FALSE((*m.chunk(id))->pinned()) << "rank " << r << " chunk " << id;
    }
    for (ChunkId group : groups) {
      auto gathered = c.Gather(group);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_TRUE(*gathered);
    }
    EXPECT_EQ(c.collectives_issued(), static_cast<int64_t>(3 + groups.size()));
    for (TensorId t = 0; t < NumParams(); ++t) Expect(r, t, 1.0f);
  });
}

// A started gather whose peers never come is an error naming the collective where it is
// waited for, and the gathers queued behind it are dropped without waiting for them too.
TEST_P(GroupCollectivesTest, AStartedGatherWithoutPeersIsADeadlineNamingTheCollective) {
  GroupCollectiveOptions options;
  options.timeout = absl::Milliseconds(200);
  Build(options);
  OnEveryRank([&](int r) {
    InitializeAndRelease(r);
  });
  GroupCollectives& c = *ranks_[0]->collectives;
  const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
  auto started = c.StartGather(groups[0]);
  ASSERT_TRUE(started.ok()) << started.status();  // issuing does not wait
  ASSERT_TRUE(c.StartGather(groups[1]).ok());
  auto gathered = c.Gather(groups[1]);
  ASSERT_FALSE(gathered.ok());
  EXPECT_EQ(gathered.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(gathered.status().message(), HasSubstr("allgather"));
  EXPECT_THAT(gathered.status().message(), HasSubstr("compute_param group 0"));
  EXPECT_EQ(c.pending_gathers(), 0);
  EXPECT_TRUE(c.FinishGathers().ok());  // nothing left to wait for
}

// Note [Started gathers]: a rank whose host tier cannot take a started group's received chunk
// yet declines to start it (nothing issued, the group untouched) and gathers it at first use;
// the other rank starts it ahead. The collectives still pair up and bring the right bytes.
TEST(GroupCollectivesStartTest, ARankWithoutRoomDeclinesToStartAndGathersAtFirstUse) {
  constexpr int kWorld = 2;
  constexpr int64_t kChunkBytes = kChunkElements * 4;
  auto world = std::make_shared<testing::FakeWorld>(kWorld);
  GroupCollectiveOptions collective_options;
  collective_options.timeout = absl::Seconds(30);  // a failing rank must not hang the other
  // Two groups of two chunks; rank 0's host tier holds one chunk, rank 1's is unlimited.
  std::vector<std::unique_ptr<Rank>> ranks = OneTensorPerChunk(
      world, 2 * kWorld,
      [&](int r, Rank& rank, ChunkManagerOptions&) {
        // A host-memory device tier: the host communicator gathers into it in place.
        rank.hierarchy = testing::MakeHierarchy(0, r == 0 ? kChunkBytes : 0, kChunkBytes, nullptr,
                                                /*device_in_host_memory=*/true);
      },
      collective_options);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      ChunkManager& m = *ranks[r]->manager;
      GroupCollectives& c = *ranks[r]->collectives;
      WriteEveryTensor(m, TierKind::kDevice);  // initialization, on the device
      ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
      const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
      ASSERT_EQ(groups.size(), 2u);
      auto gathered = c.Gather(groups[0]);  // group 0's received chunk fills rank 0's host
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      auto started = c.StartGather(groups[1]);
      ASSERT_TRUE(started.ok()) << "rank " << r << ": " << started.status();
      EXPECT_EQ(*started, r == 1) << "rank " << r;
      EXPECT_EQ(c.gathers_declined(), r == 0 ? 1 : 0) << "rank " << r;
      EXPECT_EQ(c.pending_gathers(), r == 0 ? 0 : 1) << "rank " << r;
      for (ChunkId id = groups[1]; id < groups[1] + kWorld; ++id) {
        EXPECT_EQ((*m.chunk(id))->pinned(), r == 1) << "rank " << r << " chunk " << id;
      }
      for (TensorId t = 0; t < 2 * kWorld; ++t) {  // the model runs, group by group
        if (t == kWorld) {
          gathered = c.Gather(groups[1]);
          ASSERT_TRUE(gathered.ok()) << "rank " << r << ": " << gathered.status();
          EXPECT_TRUE(*gathered);
        }
        auto view = m.Access(t, TierKind::kDevice);
        ASSERT_TRUE(view.ok()) << view.status();
        const auto* data = static_cast<const float*>(testing::ComputePointer(*view));
        for (int64_t i = 0; i < view->numel; ++i) {
          ASSERT_EQ(data[i], Value(t, i)) << "rank " << r << " tensor " << t << " element " << i;
        }
        ASSERT_TRUE(m.Release(t, TensorState::kHoldAfterFwd).ok());
      }
      EXPECT_EQ(c.collectives_issued(), 2);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (auto& rank : ranks) rank->collectives.reset();
}

// Note [Receiving where the group is computed on]: with a compute tier the communicator can
// address, a gathered chunk is received there when it has free room (its access then moves
// nothing), and in the collective's tier when it has none, without evicting for it; a started
// gather receives in the collective's tier.
TEST(GroupCollectivesComputeTierTest, AGatherReceivesIntoFreeComputeRoomAndNeverEvictsForIt) {
  constexpr int kWorld = 2;
  constexpr int64_t kChunkBytes = kChunkElements * 4;
  constexpr int kDevice = 0;  // MakeHierarchy's tier order
  constexpr int kHost = 1;
  auto world = std::make_shared<testing::FakeWorld>(kWorld);
  GroupCollectiveOptions collective_options;
  collective_options.timeout = absl::Seconds(30);  // a failing rank must not hang the other
  collective_options.compute_tier = TierKind::kDevice;
  // Three groups of two chunks (tensor t alone in chunk t); a device tier of one chunk, in
  // host memory so that the host communicator can write into it.
  std::vector<std::unique_ptr<Rank>> ranks = OneTensorPerChunk(
      world, 3 * kWorld,
      [&](int, Rank& rank, ChunkManagerOptions&) {
        rank.hierarchy = testing::MakeHierarchy(kChunkBytes, 0, kChunkBytes, nullptr,
                                                /*device_in_host_memory=*/true);
      },
      collective_options);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      ChunkManager& m = *ranks[r]->manager;
      GroupCollectives& c = *ranks[r]->collectives;
      WriteEveryTensor(m, TierKind::kHost);  // initialization
      ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
      const std::vector<ChunkId> groups = c.Groups(ChunkKind::kComputeParam);
      ASSERT_EQ(groups.size(), 3u);
      const TensorId remote0 = 1 - r;  // the other rank's tensor of group 0
      const TensorId own1 = kWorld + r;
      const TensorId remote1 = kWorld + 1 - r;
      const auto tier_of = [&](TensorId t) {
        return (*m.chunk((*m.tensor(t))->chunk))->tier_index();
      };
      // A started gather pins its chunks until first use: the host, though the device is free.
      const TensorId remote2 = 2 * kWorld + 1 - r;
      auto started = c.StartGather(groups[2]);
      ASSERT_TRUE(started.ok()) << started.status();
      ASSERT_TRUE(*started);
      EXPECT_EQ(tier_of(remote2), kHost) << "rank " << r;
      ASSERT_TRUE(c.Gather(groups[2]).ok());
      EXPECT_EQ(tier_of(remote2), kHost) << "rank " << r;
      // The device is empty: group 0's remote chunk is received there, and its access moves
      // nothing.
      auto gathered = c.Gather(groups[0]);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      ASSERT_TRUE(*gathered);
      EXPECT_EQ(tier_of(remote0), kDevice) << "rank " << r;
      const int64_t moved_in = m.Stats()[kDevice].chunks_in;
      auto view = m.Access(remote0, TierKind::kDevice);
      ASSERT_TRUE(view.ok()) << view.status();
      for (int64_t i = 0; i < view->numel; ++i) {
        ASSERT_EQ(static_cast<const float*>(testing::ComputePointer(*view))[i], Value(remote0, i))
            << "rank " << r << " element " << i;
      }
      ASSERT_TRUE(m.Release(remote0, TensorState::kHoldAfterFwd).ok());
      EXPECT_EQ(m.Stats()[kDevice].chunks_in, moved_in) << "rank " << r;
      // This rank's chunk of group 1 takes the device (evicting group 0's received chunk, as
      // any access does); group 1's remote chunk then finds no free room and goes to the host
      // without evicting it.
      ASSERT_TRUE(m.Access(own1, TierKind::kDevice).ok());
      ASSERT_TRUE(m.Release(own1, TensorState::kHold).ok());
      const size_t evictions = m.eviction_log().size();
      gathered = c.Gather(groups[1]);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      ASSERT_TRUE(*gathered);
      EXPECT_EQ(tier_of(remote1), kHost) << "rank " << r;
      EXPECT_EQ(tier_of(own1), kDevice) << "rank " << r;
      EXPECT_EQ(m.eviction_log().size(), evictions) << "rank " << r;
      for (TensorId t = 0; t < 3 * kWorld; ++t) {
        view = m.Access(t, TierKind::kHost);
        ASSERT_TRUE(view.ok()) << view.status();
        for (int64_t i = 0; i < view->numel; ++i) {
          ASSERT_EQ(static_cast<const float*>(testing::ComputePointer(*view))[i], Value(t, i))
              << "rank " << r << " tensor " << t << " element " << i;
        }
        ASSERT_TRUE(m.Release(t, TensorState::kHold).ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (auto& rank : ranks) rank->collectives.reset();
}

TEST(GroupCollectivesSingleOwnerTest, EveryRankGathersAGroupOneRankOwnsEntirely) {
  // One small tensor: chunk 0 holds it, chunk 1 is padding, so rank 0 holds no remote payload.
  // Both ranks must still run the group's allgather (a rank-dependent decision would pair the
  // collective with a different one on the other rank).
  auto world = std::make_shared<testing::FakeWorld>(2);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto rank = std::make_unique<Rank>();
    ChunkManagerOptions options;
    options.world_size = 2;
    options.rank = r;
    rank->manager = testing::MakeManager(rank->hierarchy, options);
    ASSERT_TRUE(rank->manager->RegisterTensor(testing::Spec("only", {100})).ok());
    ASSERT_TRUE(rank->manager->BuildChunkLists(kChunkElements).ok());
    rank->communicator = std::make_unique<testing::FakeCommunicator>(world, r);
    rank->collectives =
        *GroupCollectives::Create(rank->manager.get(), rank->communicator.get(), {});
    ranks.push_back(std::move(rank));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ChunkManager& m = *ranks[r]->manager;
      auto view = m.Access(0, TierKind::kHost);
      ASSERT_TRUE(view.ok());
      static_cast<float*>(testing::ComputePointer(*view))[7] = r == 0 ? 42.0f : -1.0f;
      ASSERT_TRUE(m.Release(0, TensorState::kHold).ok());
      GroupCollectives& c = *ranks[r]->collectives;
      ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
      auto gathered = c.Gather(c.Groups(ChunkKind::kComputeParam).front());
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      EXPECT_TRUE(*gathered) << "rank " << r;
      view = m.Access(0, TierKind::kHost);
      ASSERT_TRUE(view.ok());
      EXPECT_EQ(static_cast<float*>(testing::ComputePointer(*view))[7], 42.0f) << "rank " << r;
      ASSERT_TRUE(m.Release(0, TensorState::kHold).ok());
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (auto& rank : ranks) rank->collectives.reset();
}

// Note [Pinning a group for a collective]: with prefetch on, the trace of the warm-up iteration
// says the local chunk of a group is pinned for the gather (where it was then: host) and used on
// the device right after, so the next iteration's Tick prefetches it to the device. The gather's
// pin must take it there, not settle the prefetch and copy it back to the host.
TEST(GroupCollectivesPrefetchTest, PinningAChunkWithAPrefetchInFlightKeepsThePrefetch) {
  constexpr int kWorld = 2;
  auto world = std::make_shared<testing::FakeWorld>(kWorld);
  // One group of two full chunks: tensor r alone in chunk r, owned by rank r.
  std::vector<std::unique_ptr<Rank>> ranks =
      OneTensorPerChunk(world, kWorld, [](int, Rank& rank, ChunkManagerOptions& options) {
        // The device tier must be one the host communicator can pin the chunk in (host
        // memory); with a GPU's device tier the pin takes the chunk to the host tier.
        rank.hierarchy = testing::MakeHierarchy(0, 0, 8192, nullptr,
                                                /*device_in_host_memory=*/true);
        options.prefetch_moments = 2;
      });
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      ChunkManager& m = *ranks[r]->manager;
      GroupCollectives& c = *ranks[r]->collectives;
      const TensorId own = r;
      const ChunkId local = (*m.tensor(own))->chunk;
      WriteEveryTensor(m, TierKind::kHost);  // initialization: every rank builds everything
      ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());
      ASSERT_TRUE(m.RestartWarmup().ok());
      for (int iteration = 0; iteration < 3; ++iteration) {
        // The optimizer step left the local chunk on the host (evicted, or updated there).
        ASSERT_TRUE(m.MoveChunk(local, TierKind::kHost).ok());
        ASSERT_TRUE(m.Tick().ok());  // a module's pre-forward
        const bool prefetching = (*m.chunk(local))->prefetch_in_flight();
        EXPECT_EQ(prefetching, iteration > 0) << "rank " << r << " iteration " << iteration;
        const std::vector<TierChunkStats> before = m.Stats();
        auto gathered = c.Gather(c.Groups(ChunkKind::kComputeParam).front());
        ASSERT_TRUE(gathered.ok()) << gathered.status();
        ASSERT_TRUE(*gathered);
        for (TensorId t = 0; t < kWorld; ++t) {  // the module computes on the device
          auto view = m.Access(t, TierKind::kDevice);
          ASSERT_TRUE(view.ok()) << view.status();
          const auto* data = static_cast<const float*>(testing::ComputePointer(*view));
          for (int64_t i = 0; i < view->numel; ++i) {
            ASSERT_EQ(data[i], Value(t, i)) << "rank " << r << " tensor " << t << " element " << i;
          }
          ASSERT_TRUE(m.Release(t, TensorState::kHoldAfterFwd).ok());
        }
        const std::vector<TierChunkStats> after = m.Stats();
        if (prefetching) {
          // The prefetched copy served the pin and the compute: nothing went back to the host,
          // and the device received the prefetch and the remote chunk gathered on the host.
          EXPECT_EQ(after[1].chunks_in - before[1].chunks_in, 0) << "rank " << r;
          EXPECT_EQ(after[0].chunks_in - before[0].chunks_in, 2) << "rank " << r;
          EXPECT_EQ(after[0].prefetch_hits - before[0].prefetch_hits, 1) << "rank " << r;
        }
        ASSERT_TRUE(m.SetTensorState(own, TensorState::kHold).ok());
        ASSERT_TRUE(c.ReleaseAll(ChunkKind::kComputeParam).ok());  // the step
        ASSERT_TRUE(m.EndIteration().ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (auto& rank : ranks) rank->collectives.reset();
}

TEST_P(GroupCollectivesTest, MismatchedWorldIsRefused) {
  Build({});
  testing::FakeCommunicator other(world_, 1);
  auto refused = GroupCollectives::Create(ranks_[0]->manager.get(), &other, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("rank 0 of"));
}

INSTANTIATE_TEST_SUITE_P(Worlds, GroupCollectivesTest, ::testing::Values(2, 4));

}  // namespace
}  // namespace ps
