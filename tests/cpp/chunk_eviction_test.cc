// Eviction: a scripted sequence under a tight device budget evicts exactly Belady's (OPT)
// victims after warm-up and LRU's during it; OPT moves fewer bytes than LRU where they differ;
// a random sequence matches a reference OPT simulation.
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using Victims = std::vector<std::pair<int64_t, ChunkId>>;  // (access position, chunk)

constexpr int64_t kChunkBytes = 4096;
constexpr ChunkId A = 0, B = 1, C = 2, D = 3, E = 4;

// One single-tensor chunk per name; the device holds `capacity` chunks, the host the rest.
std::unique_ptr<ChunkManager> MakeScriptManager(const testing::Hierarchy& hierarchy, int chunks,
                                                EvictionPolicy policy) {
  ChunkManagerOptions options;
  options.eviction_policy = policy;
  return testing::MakeOneTensorPerChunkManager(hierarchy, chunks, options);
}

// Runs one iteration of `sequence` (tensor i lives alone in chunk i); returns its evictions
// from the device.
Victims RunIteration(ChunkManager& manager, const std::vector<ChunkId>& sequence) {
  const size_t before = manager.eviction_log().size();
  for (ChunkId chunk : sequence) {
    EXPECT_TRUE(manager.Access(chunk, TierKind::kDevice).ok());
    EXPECT_TRUE(manager.Release(chunk, TensorState::kHold).ok());
    EXPECT_TRUE(manager.Tick().ok());
  }
  EXPECT_TRUE(manager.EndIteration().ok());
  Victims victims;
  for (size_t i = before; i < manager.eviction_log().size(); ++i) {
    const EvictionRecord& record = manager.eviction_log()[i];
    if (record.from_tier == 0) victims.emplace_back(record.position, record.chunk);
  }
  return victims;
}

std::set<ChunkId> DeviceResidents(const ChunkManager& manager) {
  std::set<ChunkId> residents;
  for (ChunkId c = 0; c < manager.num_chunks(); ++c) {
    if ((*manager.chunk(c))->tier_index() == 0) residents.insert(c);
  }
  return residents;
}

// Belady over a cyclically repeating sequence, from a given resident set; written from the
// textbook definition, independent of the manager.
Victims ReferenceOpt(const std::vector<ChunkId>& sequence, std::set<ChunkId> residents,
                     size_t capacity) {
  const int64_t n = static_cast<int64_t>(sequence.size());
  auto next_use = [&](ChunkId chunk, int64_t position) {
    for (int64_t q = position + 1; q < position + 1 + n; ++q) {
      if (sequence[q % n] == chunk) return q;
    }
    return INT64_MAX;
  };
  Victims victims;
  for (int64_t p = 0; p < n; ++p) {
    const ChunkId wanted = sequence[p];
    if (residents.contains(wanted)) continue;
    if (residents.size() == capacity) {
      ChunkId victim =
          *std::max_element(residents.begin(), residents.end(),
                            [&](ChunkId x, ChunkId y) { return next_use(x, p) < next_use(y, p); });
      residents.erase(victim);
      victims.emplace_back(p, victim);
    }
    residents.insert(wanted);
  }
  return victims;
}

const std::vector<ChunkId> kScript = {A, B, C, D, A, B, E, A, B, C, D, E};

TEST(ChunkEvictionTest, ScriptedSequenceEvictsLruDuringWarmupThenExactlyOpt) {
  auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto manager = MakeScriptManager(hierarchy, 5, EvictionPolicy::kOptAfterWarmup);
  // Warm-up, LRU from an empty device (worked out by hand in the design notes' example).
  EXPECT_EQ(RunIteration(*manager, kScript),
            (Victims{{3, A}, {4, B}, {5, C}, {6, D}, {9, E}, {10, A}, {11, B}}));
  EXPECT_EQ(DeviceResidents(*manager), (std::set<ChunkId>{C, D, E}));
  // OPT from {C, D, E}: at 0 E is needed last (6); at 1 A (4); at 4 D (10); at 6 C (9); at 9
  // B is next needed in the next iteration (13), after A (12) and E (11); at 10 C (14).
  const Victims expected_opt = {{0, E}, {1, A}, {4, D}, {6, C}, {9, B}, {10, C}};
  EXPECT_EQ(ReferenceOpt(kScript, {C, D, E}, 3), expected_opt);
  EXPECT_EQ(RunIteration(*manager, kScript), expected_opt);
  // Every later iteration starts from {A, E, D} and repeats the same choices.
  const std::set<ChunkId> start = DeviceResidents(*manager);
  EXPECT_EQ(start, (std::set<ChunkId>{A, D, E}));
  EXPECT_EQ(RunIteration(*manager, kScript), ReferenceOpt(kScript, start, 3));
}

TEST(ChunkEvictionTest, OptMovesFewerBytesThanLru) {
  auto opt_hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto lru_hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto opt = MakeScriptManager(opt_hierarchy, 5, EvictionPolicy::kOptAfterWarmup);
  auto lru = MakeScriptManager(lru_hierarchy, 5, EvictionPolicy::kLru);
  // Identical warm-ups (both LRU).
  EXPECT_EQ(RunIteration(*opt, kScript), RunIteration(*lru, kScript));
  auto moved = [](const ChunkManager& manager) {
    const TierChunkStats device = manager.Stats()[0];
    return device.bytes_in + device.bytes_out;
  };
  const int64_t opt_before = moved(*opt);
  const int64_t lru_before = moved(*lru);
  EXPECT_EQ(opt_before, lru_before);
  int64_t opt_evictions = 0;
  int64_t lru_evictions = 0;
  for (int iteration = 0; iteration < 3; ++iteration) {
    opt_evictions += static_cast<int64_t>(RunIteration(*opt, kScript).size());
    lru_evictions += static_cast<int64_t>(RunIteration(*lru, kScript).size());
  }
  // LRU evicts on every miss of this sequence (10 per iteration from {C, D, E}); OPT 6 per
  // iteration (from {C, D, E}, then from {A, D, E}: B->E, C->B, A->D, E->C, C->B, D->C).
  EXPECT_EQ(lru_evictions, 30);
  EXPECT_EQ(opt_evictions, 18);
  const int64_t opt_bytes = moved(*opt) - opt_before;
  const int64_t lru_bytes = moved(*lru) - lru_before;
  EXPECT_LT(opt_bytes, lru_bytes);
  // Each eviction moves a chunk out and the following miss moves one in.
  EXPECT_EQ(opt_bytes, 2 * opt_evictions * kChunkBytes);
  EXPECT_EQ(lru_bytes, 2 * lru_evictions * kChunkBytes);
}

TEST(ChunkEvictionTest, RandomSequenceMatchesReferenceOpt) {
  std::mt19937 generator(7);
  for (int trial = 0; trial < 5; ++trial) {
    constexpr int kChunks = 7;
    std::vector<ChunkId> sequence;
    for (int i = 0; i < 40; ++i) {
      ChunkId next;
      do {
        next = static_cast<ChunkId>(generator() % kChunks);
      } while (!sequence.empty() && sequence.back() == next);
      sequence.push_back(next);
    }
    if (sequence.front() == sequence.back()) sequence.pop_back();
    for (ChunkId c = 0; c < kChunks; ++c) {
      if (std::find(sequence.begin(), sequence.end(), c) == sequence.end()) sequence.push_back(c);
    }
    auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
    auto manager = MakeScriptManager(hierarchy, kChunks, EvictionPolicy::kOptAfterWarmup);
    RunIteration(*manager, sequence);
    for (int iteration = 0; iteration < 2; ++iteration) {
      const std::set<ChunkId> start = DeviceResidents(*manager);
      EXPECT_EQ(RunIteration(*manager, sequence), ReferenceOpt(sequence, start, 3))
          << "trial " << trial << " iteration " << iteration;
    }
  }
}

TEST(ChunkEvictionTest, PinnedChunksAreNeverVictims) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kOptAfterWarmup}) {
    auto hierarchy = testing::MakeHierarchy(2 * kChunkBytes, 0, kChunkBytes);
    auto manager = MakeScriptManager(hierarchy, 3, policy);
    // Sequence A B C B with A held in COMPUTE until after C: when C arrives, A is both the least
    // recently used and (after warm-up) the one needed last, but it is pinned, so B must go.
    for (int iteration = 0; iteration < 2; ++iteration) {
      ASSERT_TRUE(manager->Access(A, TierKind::kDevice).ok());
      ASSERT_TRUE(manager->Access(B, TierKind::kDevice).ok());
      ASSERT_TRUE(manager->Release(B, TensorState::kHold).ok());
      ASSERT_TRUE(manager->Access(C, TierKind::kDevice).ok());
      const EvictionRecord& last = manager->eviction_log().back();
      EXPECT_EQ(last.chunk, B);
      EXPECT_EQ((*manager->chunk(A))->tier_index(), 0);
      ASSERT_TRUE(manager->Release(A, TensorState::kHold).ok());
      ASSERT_TRUE(manager->Release(C, TensorState::kHold).ok());
      ASSERT_TRUE(manager->Access(B, TierKind::kDevice).ok());
      ASSERT_TRUE(manager->Release(B, TensorState::kHold).ok());
      ASSERT_TRUE(manager->EndIteration().ok());
    }
  }
}

TEST(ChunkEvictionTest, NonModelDataGrowthEvictsToStayWithinBudget) {
  auto hierarchy = testing::MakeHierarchy(4 * kChunkBytes, 0, kChunkBytes);
  auto manager = MakeScriptManager(hierarchy, 4, EvictionPolicy::kOptAfterWarmup);
  for (TensorId t = 0; t < 4; ++t) {
    ASSERT_TRUE(manager->Access(t, TierKind::kDevice).ok());
    ASSERT_TRUE(manager->Release(t, TensorState::kHold).ok());
  }
  EXPECT_EQ(manager->Stats()[0].chunk_bytes, 4 * kChunkBytes);
  // Activations take 1.5 chunks of room: two chunks must leave.
  ASSERT_TRUE(manager->ReportNonModelData(TierKind::kDevice, kChunkBytes * 3 / 2).ok());
  TierChunkStats device = manager->Stats()[0];
  EXPECT_EQ(device.chunk_bytes, 2 * kChunkBytes);
  EXPECT_LE(device.reserved_bytes + device.non_model_bytes, 4 * kChunkBytes);
  EXPECT_EQ(device.evictions, 2);
  // Pinned chunks cannot leave: activations that leave no room for them are an error.
  ASSERT_TRUE(manager->Access(0, TierKind::kDevice).ok());
  ASSERT_TRUE(manager->Access(1, TierKind::kDevice).ok());
  absl::Status squeezed = manager->ReportNonModelData(TierKind::kDevice, 3 * kChunkBytes);
  EXPECT_EQ(squeezed.code(), absl::StatusCode::kResourceExhausted) << squeezed;
  EXPECT_THAT(squeezed.message(), ::testing::HasSubstr("pinned"));
  EXPECT_EQ(manager->ReportNonModelData(TierKind::kDevice, -1).code(),
            absl::StatusCode::kInvalidArgument);
}

// Where the tier out of room is the last (a host budget without NVMe), the error names the
// budget and the non-model data, as for pinned chunks; it said only "cannot evict chunk 3 ...:
// 'host' is the last tier of the hierarchy". Non-model data that still fits beside the chunks
// is no error.
TEST(ChunkEvictionTest, NonModelDataOutgrowingTheLastTierNamesTheBudget) {
  auto hierarchy = testing::MakeHierarchy(kChunkBytes, 4 * kChunkBytes, kChunkBytes);
  auto manager = MakeScriptManager(hierarchy, 4, EvictionPolicy::kOptAfterWarmup);
  for (TensorId t = 0; t < 4; ++t) {
    ASSERT_TRUE(manager->Access(t, TierKind::kHost).ok());
    ASSERT_TRUE(manager->Release(t, TensorState::kHold).ok());
  }
  ASSERT_TRUE(manager->ReportNonModelData(TierKind::kHost, 0).ok());
  absl::Status squeezed = manager->ReportNonModelData(TierKind::kHost, kChunkBytes / 2);
  EXPECT_EQ(squeezed.code(), absl::StatusCode::kResourceExhausted) << squeezed;
  EXPECT_THAT(squeezed.message(), ::testing::HasSubstr("(host): budget 16384"));
  EXPECT_THAT(squeezed.message(), ::testing::HasSubstr("non-model data 2048"));
  EXPECT_THAT(squeezed.message(), ::testing::HasSubstr("the last tier, with nowhere to evict"));
  EXPECT_EQ(manager->Stats()[1].chunk_bytes, 4 * kChunkBytes);  // nothing lost
}

}  // namespace
}  // namespace ps
