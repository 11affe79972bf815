// The memory tracer: moments, per-moment model and non-model bytes from reports and probes,
// the access sequence, and what the trace allows per moment after warm-up.
#include <limits>
#include <vector>

#include "chunk/chunk_manager.h"
#include "chunk/memory_tracer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;
using ::testing::ElementsAre;

constexpr int64_t kChunkBytes = 4096;

TEST(MemoryTracerTest, RecordsPeaksPerMomentAndFreezesAfterWarmup) {
  MemoryTracer tracer(2);
  EXPECT_TRUE(tracer.warming_up());
  tracer.ReportNonModelBytes(0, 100);
  tracer.ReportNonModelBytes(0, 300);  // the peak of moment 0
  tracer.ReportNonModelBytes(0, 200);
  tracer.ObserveModelBytes(1, 4096);
  EXPECT_EQ(tracer.RecordAccess(7, 1), 0);
  tracer.Tick();
  EXPECT_EQ(tracer.moment(), 1);
  EXPECT_EQ(tracer.RecordAccess(8, 0), 1);
  EXPECT_EQ(tracer.RecordAccess(7, 0), 2);
  tracer.ReportNonModelBytes(1, 50);
  tracer.EndIteration();
  EXPECT_FALSE(tracer.warming_up());
  EXPECT_EQ(tracer.moment(), 0);
  EXPECT_EQ(tracer.cursor(), 0);
  ASSERT_EQ(tracer.trace().size(), 2u);
  EXPECT_THAT(tracer.trace()[0].non_model_bytes, ElementsAre(300, 0));
  EXPECT_THAT(tracer.trace()[0].model_bytes, ElementsAre(0, 4096));
  // A new moment starts from the levels the previous one ended with.
  EXPECT_THAT(tracer.trace()[1].non_model_bytes, ElementsAre(200, 50));
  EXPECT_THAT(tracer.trace()[1].model_bytes, ElementsAre(0, 4096));
  ASSERT_EQ(tracer.accesses().size(), 3u);
  EXPECT_EQ(tracer.accesses()[1].chunk, 8);
  EXPECT_EQ(tracer.accesses()[1].moment, 1);
  // Next uses read the sequence cyclically.
  EXPECT_EQ(tracer.NextUse(7, 0), 2);
  EXPECT_EQ(tracer.NextUse(7, 2), 3);  // position 0 of the next iteration
  EXPECT_EQ(tracer.NextUse(8, 1), 4);
  EXPECT_EQ(tracer.NextUse(9, 0), kNeverUsedAgain);
  // After warm-up nothing more is recorded, and the non-model bytes the planner keeps free are
  // the larger of the report and the trace.
  tracer.RecordAccess(9, 0);
  EXPECT_EQ(tracer.accesses().size(), 3u);
  EXPECT_EQ(tracer.NonModelBytes(0), 300);  // moment 0 of the trace beats the report of 200
  tracer.ReportNonModelBytes(0, 1000);
  EXPECT_EQ(tracer.NonModelBytes(0), 1000);
  EXPECT_EQ(tracer.trace()[0].non_model_bytes[0], 300);
}

TEST(MemoryTracerTest, ManagerSamplesProbesAndPlansFromTheTrace) {
  auto hierarchy = testing::MakeHierarchy(8 * kChunkBytes, 0, kChunkBytes);
  auto manager = testing::MakeManager(hierarchy);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(manager->RegisterTensor(Spec("t" + std::to_string(i), {1024})).ok());
  }
  ASSERT_TRUE(manager->BuildChunkLists(1024).ok());
  // Non-model bytes per moment, as an allocator would report them: a spike at moment 3.
  const std::vector<int64_t> activations = {
      0, kChunkBytes, 2 * kChunkBytes, 5 * kChunkBytes, kChunkBytes, 0};
  int64_t moment_seen = 0;
  ASSERT_TRUE(
      manager->SetNonModelDataProbe(TierKind::kDevice, [&] { return activations[moment_seen]; })
          .ok());
  auto run_iteration = [&] {
    moment_seen = 0;
    for (TensorId t = 0; t < 6; ++t) {
      if (t > 0) {
        moment_seen = t;
        ASSERT_TRUE(manager->Tick().ok());
      }
      // Before the access at the spike every tier must already fit.
      const TierChunkStats device = manager->Stats()[0];
      EXPECT_LE(device.reserved_bytes + activations[t], 8 * kChunkBytes) << "moment " << t;
      ASSERT_TRUE(manager->Access(t, TierKind::kDevice).ok());
      ASSERT_TRUE(manager->Release(t, TensorState::kHold).ok());
    }
    ASSERT_TRUE(manager->EndIteration().ok());
  };
  run_iteration();
  const MemoryTracer& tracer = manager->tracer();
  ASSERT_EQ(tracer.trace().size(), 6u);
  for (int m = 0; m < 6; ++m) {
    EXPECT_EQ(tracer.trace()[m].non_model_bytes[0], activations[m]) << m;
    EXPECT_EQ(*manager->ChunkBytesAllowedAt(TierKind::kDevice, m),
              8 * kChunkBytes - activations[m]);
  }
  // Model bytes grew by one chunk per moment, except that the spike held the device to 3 chunks
  // at moment 3 (one evicted to the host), so 5 chunks were there at the last moment.
  EXPECT_EQ(tracer.trace()[2].model_bytes[0], 3 * kChunkBytes);
  EXPECT_EQ(tracer.trace()[3].model_bytes[0], 3 * kChunkBytes);
  EXPECT_EQ(tracer.trace()[5].model_bytes[0], 5 * kChunkBytes);
  EXPECT_EQ(manager->Stats()[0].evictions, 1);
  EXPECT_EQ(*manager->ChunkBytesAllowedAt(TierKind::kHost, 2), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(manager->ChunkBytesAllowedAt(TierKind::kNvme, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  // With the trace known, ticking into the spike makes room before the activations exist: the
  // probe now reports nothing at tick time, yet every moment still fits its traced peak.
  ASSERT_TRUE(manager->SetNonModelDataProbe(TierKind::kDevice, [] { return int64_t{0}; }).ok());
  run_iteration();
  EXPECT_GT(manager->Stats()[0].evictions, 1);
  EXPECT_LE(manager->Stats()[0].peak_chunk_bytes, 8 * kChunkBytes);
}

// Note [The trace forecasts, the report bounds]: a later iteration's moment 1 is another point of
// the model than the warm-up's (an evaluation forward before the first step, fewer modules run):
// the warm-up's activations there are only a forecast, and an access fails only for what is
// reported now.
TEST(MemoryTracerTest, TheTraceKeepsRoomButOnlyTheReportRefusesAnAccess) {
  auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto manager = testing::MakeOneTensorPerChunkManager(hierarchy, 3);
  ASSERT_NE(manager, nullptr);
  ASSERT_TRUE(manager->Tick().ok());
  ASSERT_TRUE(manager->ReportNonModelData(TierKind::kDevice, 2 * kChunkBytes).ok());
  ASSERT_TRUE(manager->Access(0, TierKind::kDevice).ok());
  ASSERT_TRUE(manager->Release(0, TensorState::kHold).ok());
  ASSERT_TRUE(manager->ReportNonModelData(TierKind::kDevice, 0).ok());
  ASSERT_TRUE(manager->EndIteration().ok());

  ASSERT_TRUE(manager->Tick().ok());
  ASSERT_TRUE(manager->ReportNonModelData(TierKind::kDevice, 0).ok());
  // The forecast still moves what can move: chunk 0 leaves the device at the tick.
  EXPECT_EQ(manager->Stats()[0].chunk_bytes, kChunkBytes);
  for (TensorId t = 0; t < 3; ++t) {
    ASSERT_TRUE(manager->Access(t, TierKind::kDevice).ok()) << t;
  }
  EXPECT_EQ(manager->Stats()[0].chunk_bytes, 3 * kChunkBytes);
  const absl::Status squeezed = manager->ReportNonModelData(TierKind::kDevice, kChunkBytes);
  EXPECT_TRUE(absl::IsResourceExhausted(squeezed)) << squeezed;
  EXPECT_THAT(std::string(squeezed.message()),
              ::testing::HasSubstr("minus non-model data 4096 bytes leaves 8192 bytes"));
}

TEST(MemoryTracerTest, RestartWarmupForgetsWhatRanBeforeTheFirstIteration) {
  testing::Hierarchy hierarchy = testing::MakeHierarchy(0, 0, 4096);
  auto manager = testing::MakeOneTensorPerChunkManager(hierarchy, 3);
  ASSERT_NE(manager, nullptr);
  // "Initialization": host accesses of every chunk over two moments.
  for (TensorId t = 0; t < 3; ++t) {
    ASSERT_TRUE(manager->Access(t, TierKind::kHost).ok());
    ASSERT_TRUE(manager->Release(t, TensorState::kHold).ok());
    ASSERT_TRUE(manager->Tick().ok());
  }
  ASSERT_TRUE(manager->RestartWarmup().ok());
  EXPECT_TRUE(manager->tracer().accesses().empty());
  EXPECT_EQ(manager->tracer().moment(), 0);
  EXPECT_EQ(manager->tracer().trace().size(), 1u);
  // The training iteration: only its accesses make the trace.
  ASSERT_TRUE(manager->Access(2, TierKind::kDevice).ok());
  ASSERT_TRUE(manager->Release(2, TensorState::kHold).ok());
  ASSERT_TRUE(manager->EndIteration().ok());
  ASSERT_EQ(manager->tracer().accesses().size(), 1u);
  EXPECT_EQ(manager->tracer().accesses()[0].chunk, 2);
  EXPECT_EQ(manager->tracer().accesses()[0].tier, 0);
  const absl::Status late = manager->RestartWarmup();
  EXPECT_TRUE(absl::IsFailedPrecondition(late)) << late;
}

}  // namespace
}  // namespace ps
