// Chunk packing: first-fit order, oversize tensors, padding, chunk-size search, layout hash.
#include "chunk/chunk_layout.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<TensorSpec> Vectors(const std::vector<int64_t>& sizes) {
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < sizes.size(); ++i)
    specs.push_back(Spec("t" + std::to_string(i), {sizes[i]}));
  return specs;
}

TEST(ChunkLayoutTest, FirstFitFillsTheFirstChunkWithRoomInRegistrationOrder) {
  // 6 -> c0; 3 -> c0 (9); 5 -> c1; 1 -> c0 (10, full); 4 -> c1 (9); 2 -> c2.
  const std::vector<TensorSpec> specs = Vectors({6, 3, 5, 1, 4, 2});
  auto plan = PlanLayout(specs, 10, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->lists.size(), 1u);
  const std::vector<PlannedChunk>& chunks = plan->lists[0].chunks;
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_THAT(chunks[0].tensors, ElementsAre(0, 1, 3));
  EXPECT_THAT(chunks[0].offsets, ElementsAre(0, 6, 9));
  EXPECT_THAT(chunks[1].tensors, ElementsAre(2, 4));
  EXPECT_THAT(chunks[1].offsets, ElementsAre(0, 5));
  EXPECT_THAT(chunks[2].tensors, ElementsAre(5));
  EXPECT_EQ(plan->wasted_bytes, (0 + 1 + 8) * 4);
  EXPECT_TRUE(plan->oversize_tensors.empty());
}

TEST(ChunkLayoutTest, OversizeTensorGetsAChunkOfItsOwnAndIsReported) {
  const std::vector<TensorSpec> specs = Vectors({4, 25, 5});
  auto plan = PlanLayout(specs, 10, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<PlannedChunk>& chunks = plan->lists[0].chunks;
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_THAT(chunks[0].tensors, ElementsAre(0, 2));
  EXPECT_FALSE(chunks[0].oversize);
  EXPECT_THAT(chunks[1].tensors, ElementsAre(1));
  EXPECT_TRUE(chunks[1].oversize);
  EXPECT_EQ(chunks[1].capacity_elements, 25);
  EXPECT_THAT(plan->oversize_tensors, ElementsAre(1));
  EXPECT_EQ(plan->wasted_bytes, 1 * 4);  // only the regular chunk's free element
}

// Note [Oversize groups]: with 2 ranks each oversize tensor starts a group of its own, padded
// with an empty chunk of its size; the holder alternates; the padding before the first one takes
// a later small tensor by first-fit.
TEST(ChunkLayoutTest, OversizeTensorsGetPaddedGroupsOfTheirOwnUnderDataParallelism) {
  const std::vector<TensorSpec> specs = Vectors({4, 25, 5, 30, 3});
  auto plan = PlanLayout(specs, 10, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<PlannedChunk>& chunks = plan->lists[0].chunks;
  ASSERT_EQ(chunks.size(), 6u);
  EXPECT_THAT(chunks[0].tensors, ElementsAre(0, 2));
  EXPECT_THAT(chunks[1].tensors, ElementsAre(4));  // was padding, took t4
  EXPECT_FALSE(chunks[1].padding);
  EXPECT_EQ(chunks[1].capacity_elements, 10);
  // Group 1: t1 on rank 0, an empty 25-element chunk on rank 1.
  EXPECT_THAT(chunks[2].tensors, ElementsAre(1));
  EXPECT_FALSE(chunks[2].padding);
  EXPECT_TRUE(chunks[3].tensors.empty());
  EXPECT_TRUE(chunks[3].padding);
  EXPECT_EQ(chunks[2].capacity_elements, 25);
  EXPECT_EQ(chunks[3].capacity_elements, 25);
  // Group 2: t3 on rank 1 this time.
  EXPECT_TRUE(chunks[4].tensors.empty());
  EXPECT_TRUE(chunks[4].padding);
  EXPECT_THAT(chunks[5].tensors, ElementsAre(3));
  EXPECT_EQ(chunks[4].capacity_elements, 30);
  EXPECT_EQ(chunks[5].capacity_elements, 30);
  for (int c = 2; c < 6; ++c) EXPECT_TRUE(chunks[c].oversize) << c;
  EXPECT_THAT(plan->oversize_tensors, ElementsAre(1, 3));
  EXPECT_EQ(plan->wasted_bytes, (1 + 7) * 4);  // padding never gets a payload
  // A world of one keeps one chunk per oversize tensor, no padding.
  auto single = PlanLayout(specs, 10, 1);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->lists[0].chunks.size(), 4u);
}

TEST(ChunkLayoutTest, ListsArePerKindAndPaddedToTheWorldSize) {
  std::vector<TensorSpec> specs = {
      Spec("w", {8}, ChunkKind::kComputeParam, DType::kFloat16),
      Spec("w.master", {8}, ChunkKind::kMasterParam, DType::kFloat32),
      Spec("v", {8}, ChunkKind::kComputeParam, DType::kFloat16),
      Spec("u", {8}, ChunkKind::kComputeParam, DType::kFloat16),
  };
  auto plan = PlanLayout(specs, 8, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->lists.size(), 2u);
  EXPECT_EQ(plan->lists[0].kind, ChunkKind::kComputeParam);
  EXPECT_EQ(plan->lists[0].dtype, DType::kFloat16);
  ASSERT_EQ(plan->lists[0].chunks.size(), 4u);  // 3 full + 1 padding
  EXPECT_TRUE(plan->lists[0].chunks[3].padding);
  EXPECT_EQ(plan->lists[1].kind, ChunkKind::kMasterParam);
  ASSERT_EQ(plan->lists[1].chunks.size(), 4u);  // 1 full + 3 padding
  // Padding never gets a payload (no rank has a tensor there to gather or keep): no waste.
  EXPECT_EQ(plan->wasted_bytes, 0);
}

TEST(ChunkLayoutTest, ScaleListsMirrorTheChunksOfTheirMomentsOnEveryRank) {
  // 8-bit moments (uint8) packed first-fit with chunks of 10 elements over 2 ranks: m0 (6) and
  // m2 (4) share chunk 0, m1 (5) is chunk 1, m3 (25) is an oversize group of its own (its
  // holder is member 0, the chunks 2 and 3). Their scales, registered in the same order with
  // other sizes, follow the moments chunk by chunk (Note [Scale lists mirror their moments]),
  // so a rank that owns a moment owns its scales.
  std::vector<TensorSpec> specs;
  const std::vector<int64_t> moments = {6, 5, 4, 25};
  const std::vector<int64_t> scales = {2, 1, 3, 7};
  for (size_t i = 0; i < moments.size(); ++i) {
    specs.push_back(Spec("m" + std::to_string(i), {moments[i]}, ChunkKind::kMomentum,
                         DType::kUInt8));
  }
  for (size_t i = 0; i < scales.size(); ++i) {
    specs.push_back(Spec("s" + std::to_string(i), {scales[i]}, ChunkKind::kMomentumScale,
                         DType::kFloat32));
  }
  auto plan = PlanLayout(specs, 10, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->lists.size(), 2u);
  const PlannedList& moment_list = plan->lists[0];
  const PlannedList& scale_list = plan->lists[1];
  EXPECT_EQ(moment_list.dtype, DType::kUInt8);
  EXPECT_EQ(scale_list.kind, ChunkKind::kMomentumScale);
  ASSERT_EQ(moment_list.chunks.size(), 4u);
  ASSERT_EQ(scale_list.chunks.size(), moment_list.chunks.size());
  EXPECT_THAT(moment_list.chunks[0].tensors, ElementsAre(0, 2));
  EXPECT_THAT(scale_list.chunks[0].tensors, ElementsAre(4, 6));
  EXPECT_THAT(scale_list.chunks[0].offsets, ElementsAre(0, 2));
  EXPECT_THAT(scale_list.chunks[1].tensors, ElementsAre(5));
  EXPECT_THAT(moment_list.chunks[2].tensors, ElementsAre(3));
  EXPECT_THAT(scale_list.chunks[2].tensors, ElementsAre(7));
  EXPECT_TRUE(scale_list.chunks[3].padding);
  EXPECT_TRUE(scale_list.chunks[3].tensors.empty());
  for (const PlannedChunk& chunk : scale_list.chunks) EXPECT_EQ(chunk.capacity_elements, 7);
}

TEST(ChunkLayoutTest, AScaleListWithoutOneTensorPerMomentIsAnError) {
  std::vector<TensorSpec> specs = {
      Spec("m0", {6}, ChunkKind::kVariance, DType::kUInt8),
      Spec("m1", {6}, ChunkKind::kVariance, DType::kUInt8),
      Spec("s0", {1}, ChunkKind::kVarianceScale, DType::kFloat32),
  };
  auto plan = PlanLayout(specs, 10, 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("variance_scale has 1 tensors but variance has 2"));
  specs.erase(specs.begin(), specs.begin() + 2);
  plan = PlanLayout(specs, 10, 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("need variance tensors"));
}

TEST(ChunkLayoutTest, BadInputIsAnErrorNamingTheTensor) {
  std::vector<TensorSpec> mixed = {Spec("a", {4}, ChunkKind::kMomentum, DType::kFloat32),
                                   Spec("b", {4}, ChunkKind::kMomentum, DType::kBFloat16)};
  auto plan = PlanLayout(mixed, 8, 1);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("'b'"));
  EXPECT_THAT(plan.status().message(), HasSubstr("bfloat16"));

  auto empty = PlanLayout({Spec("e", {3, 0})}, 8, 1);
  ASSERT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("'e'"));

  EXPECT_EQ(PlanLayout(Vectors({1}), 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanLayout(Vectors({1}), 8, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NumElements({2, -1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NumElements({int64_t{1} << 40, int64_t{1} << 40}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChunkLayoutTest, SearchFindsTheKnownOptimum) {
  // Four tensors of 30 elements: sizes 40, 50, 70, 80 waste 10/20/40/50 per chunk, 90 and 100
  // leave a lonely tensor, only 60 (two tensors per chunk) and 120 (all four) waste nothing;
  // 120 is outside the range, so 60 is the unique optimum.
  const std::vector<TensorSpec> specs = Vectors({30, 30, 30, 30});
  auto result = SearchChunkSize(specs, ChunkSizeSearch{40, 100, 10}, 1);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->candidates, 7);
  EXPECT_EQ(result->plan.chunk_elements, 60);
  EXPECT_EQ(result->plan.wasted_bytes, 0);
  for (int64_t size = 40; size <= 100; size += 10) {
    if (size == 60) continue;
    auto other = PlanLayout(specs, size, 1);
    ASSERT_TRUE(other.ok());
    EXPECT_GT(other->wasted_bytes, 0) << "size " << size;
  }
}

TEST(ChunkLayoutTest, SearchCountsOnlyChunksWithTensorsAndBreaksTiesTowardsSmallChunks) {
  // 3 tensors of 10 in a world of 2: size 10 -> 3 chunks + 1 padding (no waste: padding never
  // gets a payload); 20 -> 2 chunks, 10 elements free (40 bytes); 30 -> 1 chunk + 1 padding
  // (0); 15 -> 3 chunks of 5 free + 1 padding (60). 10 puts two tensors on rank 0 and one on
  // rank 1; 30 all three on rank 0.
  const std::vector<TensorSpec> specs = Vectors({10, 10, 10});
  auto result = SearchChunkSize(specs, ChunkSizeSearch{10, 30, 5}, 2);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.chunk_elements, 10);
  EXPECT_EQ(result->plan.wasted_bytes, 0);
  auto twenty = PlanLayout(specs, 20, 2);
  ASSERT_TRUE(twenty.ok());
  EXPECT_EQ(twenty->wasted_bytes, 40);
  // Size 30 wastes nothing either, but one rank would own all three tensors.
  auto thirty = PlanLayout(specs, 30, 2);
  ASSERT_TRUE(thirty.ok());
  EXPECT_EQ(thirty->wasted_bytes, 0);
  EXPECT_EQ(thirty->largest_rank_bytes, 30 * 4);
  EXPECT_EQ(result->plan.largest_rank_bytes, 20 * 4);
  EXPECT_EQ(result->plan.largest_group_bytes, 20 * 4);
  EXPECT_EQ(EstimatedRankPeak(result->plan), 20 * 4 + 2 * 20 * 4);
  EXPECT_EQ(EstimatedRankPeak(*thirty), 30 * 4 + 2 * 30 * 4);
  EXPECT_EQ(SearchChunkSize(specs, ChunkSizeSearch{30, 10, 5}, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SearchChunkSize(specs, ChunkSizeSearch{10, 30, 0}, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChunkLayoutTest, SearchTriesPowersOfTwoOfTheFloorBelowItsRange) {
  // Note [Chunk-size search]: two large tensors (oversize groups, one per rank) and four small
  // ones in a world of 2. From 100 elements up the small ones share one chunk on rank 0 (400
  // bytes more there); chunks of 25 (floor 25: 25, 50) put two on each rank's padding.
  std::vector<int64_t> sizes = {400, 25, 400, 25, 25, 25};
  const std::vector<TensorSpec> specs = Vectors(sizes);
  auto without = SearchChunkSize(specs, ChunkSizeSearch{100, 400, 100}, 2);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->candidates, 4);
  auto with = SearchChunkSize(specs, ChunkSizeSearch{100, 400, 100, 25}, 2);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_EQ(with->candidates, 6);  // 25, 50, then 100 ... 400
  EXPECT_LT(with->plan.chunk_elements, 100);
  EXPECT_LT(with->plan.largest_rank_bytes, without->plan.largest_rank_bytes);
  EXPECT_EQ(with->plan.largest_rank_bytes, (400 + 50) * 4);
  EXPECT_EQ(SearchChunkSize(specs, ChunkSizeSearch{100, 400, 100, -1}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ChunkLayoutTest, HashIsDeterministicAndSeesOrderNamesShapesAndWorldSize) {
  const std::vector<TensorSpec> specs = {Spec("a", {2, 3}), Spec("b", {4}), Spec("c", {5})};
  auto plan = PlanLayout(specs, 8, 2);
  auto again = PlanLayout(specs, 8, 2);
  ASSERT_TRUE(plan.ok() && again.ok());
  const uint64_t hash = LayoutHash(*plan, specs);
  EXPECT_EQ(hash, LayoutHash(*again, specs));

  const std::vector<TensorSpec> reordered = {Spec("b", {4}), Spec("a", {2, 3}), Spec("c", {5})};
  EXPECT_NE(hash, LayoutHash(*PlanLayout(reordered, 8, 2), reordered));
  const std::vector<TensorSpec> renamed = {Spec("a", {2, 3}), Spec("B", {4}), Spec("c", {5})};
  EXPECT_NE(hash, LayoutHash(*PlanLayout(renamed, 8, 2), renamed));
  const std::vector<TensorSpec> reshaped = {Spec("a", {3, 2}), Spec("b", {4}), Spec("c", {5})};
  EXPECT_NE(hash, LayoutHash(*PlanLayout(reshaped, 8, 2), reshaped));
  EXPECT_NE(hash, LayoutHash(*PlanLayout(specs, 8, 1), specs));
  EXPECT_NE(hash, LayoutHash(*PlanLayout(specs, 16, 2), specs));
}

TEST(ChunkLayoutTest, ManagerBuildsListsAndReportsTheChoice) {
  auto hierarchy = testing::MakeHierarchy(0, 0, 4096);
  auto manager = testing::MakeManager(hierarchy);
  ASSERT_NE(manager, nullptr);
  ASSERT_TRUE(manager->RegisterTensor(Spec("small", {100})).ok());
  ASSERT_TRUE(manager->RegisterTensor(Spec("embedding", {50, 100})).ok());
  ASSERT_TRUE(manager->RegisterTensor(Spec("other", {1000})).ok());
  EXPECT_EQ(manager->RegisterTensor(Spec("small", {3})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager->RegisterTensor(Spec("empty", {0})).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto report = manager->BuildChunkLists(2048);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->oversize_tensors, ElementsAre("embedding"));
  EXPECT_EQ(report->num_chunks, 2);
  EXPECT_EQ(report->wasted_bytes, (2048 - 1100) * 4);
  auto other = manager->FindTensor("other");
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*manager->tensor(*other))->offset, 100);
  EXPECT_EQ((*manager->tensor(*other))->chunk, 0);
  EXPECT_EQ(manager->RegisterTensor(Spec("late", {1})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager->BuildChunkLists(2048).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager->FindTensor("nope").status().code(), absl::StatusCode::kNotFound);

  auto searched_manager = testing::MakeManager(hierarchy);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(searched_manager->RegisterTensor(Spec("t" + std::to_string(i), {30})).ok());
  }
  auto searched = searched_manager->BuildChunkListsSearched(ChunkSizeSearch{40, 100, 10});
  ASSERT_TRUE(searched.ok()) << searched.status();
  EXPECT_EQ(searched->chunk_elements, 60);
  EXPECT_EQ(searched->candidates, 7);
  EXPECT_EQ(searched->wasted_bytes, 0);
}

}  // namespace
}  // namespace ps
