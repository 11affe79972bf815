// The profiling event log (chunk/event_log.h): off by default, bounded, clearable; and, driven by
// the chunk manager, events that agree with its statistics: every copy with its cause (access,
// prefetch, eviction, optimizer, explicit), every eviction with its victim, trigger and next-use
// distance (checked against Belady's choices worked out by hand), a sample per moment.
#include "chunk/event_log.h"

#include <map>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {


constexpr int64_t kChunkBytes = 4096;

TEST(EventLogTest, OffByDefaultRecordsNothing) {
  EventLog log;
  EXPECT_FALSE(log.enabled());
  log.CopyIssued(1, 0, 1, 64, /*prefetch=*/false);
  log.CopySettled(1, 5, true);
  log.ZeroFill(2, 0, 64);
  log.Drop(2, 0, 64);
  log.Eviction(3, 0, 1, 64, 7);
  const TierSample tier{1, 2, 3};
  log.Moment(false, {&tier, 1});
  EXPECT_TRUE(log.events().empty());
  EXPECT_TRUE(log.samples().empty());
  EXPECT_EQ(log.dropped(), 0);
}

TEST(EventLogTest, CopyHalvesJoinIntoOneEventWithOrderedTimes) {
  EventLog log;
  log.Enable(true);
  log.CopySettled(9, 1, true);  // issued before the log was on: ignored
  log.CopyIssued(4, 1, 0, 4096, /*prefetch=*/true);
  log.CopyIssued(5, 1, 0, 8192, /*prefetch=*/false);
  log.CopySettled(5, 10, true);
  log.CopySettled(4, 20, false);
  ASSERT_EQ(log.events().size(), 2u);
  const ChunkEvent& first = log.events()[0];
  EXPECT_EQ(first.type, EventType::kCopy);
  EXPECT_EQ(first.chunk, 5);
  EXPECT_EQ(first.cause, EventCause::kAccess);
  EXPECT_EQ(first.bytes, 8192);
  EXPECT_EQ(first.wait_ns, 10);
  EXPECT_LE(first.start_ns, first.end_ns);
  const ChunkEvent& second = log.events()[1];
  EXPECT_EQ(second.chunk, 4);
  EXPECT_EQ(second.cause, EventCause::kPrefetch);
  EXPECT_EQ(second.from_tier, 1);
  EXPECT_EQ(second.to_tier, 0);
  EXPECT_FALSE(second.ok);
  EXPECT_LE(first.end_ns, second.end_ns);
}

TEST(EventLogTest, CausesFollowScopesAndPhase) {
  EventLog log;
  log.Enable(true);
  auto cause_of_copy = [&](int64_t chunk) {
    log.CopyIssued(chunk, 0, 1, 64, false);
    log.CopySettled(chunk, 0, true);
    return log.events().back().cause;
  };
  EXPECT_EQ(cause_of_copy(0), EventCause::kAccess);
  log.set_phase(EventPhase::kOptimizer);
  EXPECT_EQ(cause_of_copy(1), EventCause::kOptimizer);
  {
    EventLog::TriggerScope trigger(log, EventTrigger::kExplicit, 2);
    EXPECT_EQ(cause_of_copy(2), EventCause::kExplicit);
    {
      EventLog::TriggerScope inner(log, EventTrigger::kAccess, 3);
      EventLog::EvictionScope evicting(log);
      EXPECT_EQ(cause_of_copy(3), EventCause::kEviction);
      log.Eviction(4, 0, 1, 64, 2);
      EXPECT_EQ(log.events().back().trigger, EventTrigger::kAccess);
      EXPECT_EQ(log.events().back().for_chunk, 3);
      EXPECT_EQ(log.events().back().phase, EventPhase::kOptimizer);
    }
    // The outer scope is back.
    EXPECT_EQ(cause_of_copy(5), EventCause::kExplicit);
    log.Eviction(6, 0, 1, 64, 2);
    EXPECT_EQ(log.events().back().trigger, EventTrigger::kExplicit);
    EXPECT_EQ(log.events().back().for_chunk, 2);
  }
  log.Eviction(7, 0, 1, 64, -1);
  EXPECT_EQ(log.events().back().trigger, EventTrigger::kNone);
  EXPECT_EQ(log.events().back().for_chunk, -1);
}

TEST(EventLogTest, BoundedDrainableClearable) {
  EventLog log;
  log.Enable(true, /*capacity=*/3);
  for (int i = 0; i < 5; ++i) log.ZeroFill(i, 0, 64);
  EXPECT_EQ(log.events().size(), 3u);
  EXPECT_EQ(log.dropped(), 2);
  std::vector<ChunkEvent> drained = log.DrainEvents();
  EXPECT_EQ(drained.size(), 3u);
  EXPECT_EQ(drained[2].chunk, 2);
  EXPECT_TRUE(log.events().empty());
  log.ZeroFill(9, 0, 64);  // room again after draining
  EXPECT_EQ(log.events().size(), 1u);
  log.CopyIssued(1, 0, 1, 64, false);
  log.Clear();
  EXPECT_TRUE(log.events().empty());
  EXPECT_EQ(log.dropped(), 0);
  log.CopySettled(1, 0, true);  // its issue was cleared
  EXPECT_TRUE(log.events().empty());
}

TEST(EventLogTest, PhaseNamesRoundTrip) {
  for (EventPhase phase : {EventPhase::kOther, EventPhase::kForward, EventPhase::kBackward,
                           EventPhase::kOptimizer}) {
    EventPhase parsed = EventPhase::kOther;
    ASSERT_TRUE(ParseEventPhase(EventPhaseName(phase), &parsed));
    EXPECT_EQ(parsed, phase);
  }
  EventPhase unchanged = EventPhase::kBackward;
  EXPECT_FALSE(ParseEventPhase("optimiser", &unchanged));
  EXPECT_EQ(unchanged, EventPhase::kBackward);
}

// ---- Driven by the chunk manager -------------------------------------------------------------

std::unique_ptr<ChunkManager> MakeManager(const testing::Hierarchy& hierarchy, int chunks,
                                          int prefetch_moments = 0) {
  ChunkManagerOptions options;
  options.prefetch_moments = prefetch_moments;
  return testing::MakeOneTensorPerChunkManager(hierarchy, chunks, options);
}

void RunIteration(ChunkManager& manager, const std::vector<ChunkId>& sequence) {
  for (ChunkId chunk : sequence) {
    ASSERT_TRUE(manager.Access(chunk, TierKind::kDevice).ok());
    ASSERT_TRUE(manager.Release(chunk, TensorState::kHold).ok());
    ASSERT_TRUE(manager.Tick().ok());
  }
  ASSERT_TRUE(manager.EndIteration().ok());
}

constexpr ChunkId A = 0, B = 1, C = 2, D = 3, E = 4;
const std::vector<ChunkId> kScript = {A, B, C, D, A, B, E, A, B, C, D, E};

TEST(EventLogManagerTest, DisabledManagerLogsNothing) {
  auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto manager = MakeManager(hierarchy, 5);
  RunIteration(*manager, kScript);
  RunIteration(*manager, kScript);
  EXPECT_GT(manager->Stats()[0].evictions, 0);
  EXPECT_TRUE(manager->events().events().empty());
  EXPECT_TRUE(manager->events().samples().empty());
}

TEST(EventLogManagerTest, EvictionsCarryVictimTriggerAndNextUseDistance) {
  auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto manager = MakeManager(hierarchy, 5);
  manager->events().Enable(true);
  RunIteration(*manager, kScript);  // warm-up: LRU, distances unknown
  for (const ChunkEvent& event : manager->events().events()) {
    if (event.type == EventType::kEviction) {
      EXPECT_EQ(event.next_use_distance, -1);
    }
  }
  manager->events().Clear();
  RunIteration(*manager, kScript);
  // OPT from {C, D, E} (chunk_eviction_test.cc): victims at positions 0, 1, 4, 6, 9, 10 are E,
  // A, D, C, B, C, next used at 6, 4, 10, 9, 13 (next iteration), 14.
  std::vector<std::pair<ChunkId, int64_t>> evictions;  // (victim, next-use distance)
  std::vector<ChunkId> for_chunks;
  std::vector<const ChunkEvent*> copies;
  for (const ChunkEvent& event : manager->events().events()) {
    if (event.type == EventType::kEviction) {
      evictions.emplace_back(event.chunk, event.next_use_distance);
      for_chunks.push_back(event.for_chunk);
      EXPECT_EQ(event.trigger, EventTrigger::kAccess);
      EXPECT_EQ(event.from_tier, 0);
      EXPECT_EQ(event.to_tier, 1);
      EXPECT_EQ(event.iteration, 1);
    } else if (event.type == EventType::kCopy) {
      copies.push_back(&event);
    }
  }
  EXPECT_EQ(evictions, (std::vector<std::pair<ChunkId, int64_t>>{
                           {E, 6}, {A, 3}, {D, 6}, {C, 3}, {B, 4}, {C, 4}}));
  // The accesses that needed the room: positions 0, 1, 4, 6, 9, 10 of the script.
  EXPECT_EQ(for_chunks, (std::vector<ChunkId>{A, B, A, E, C, D}));
  // Each eviction moves its victim down (cause eviction), then the access brings its chunk up.
  ASSERT_EQ(copies.size(), 12u);
  for (size_t i = 0; i < copies.size(); i += 2) {
    EXPECT_EQ(copies[i]->cause, EventCause::kEviction);
    EXPECT_EQ(copies[i]->chunk, evictions[i / 2].first);
    EXPECT_EQ(copies[i]->from_tier, 0);
    EXPECT_EQ(copies[i + 1]->cause, EventCause::kAccess);
    EXPECT_EQ(copies[i + 1]->chunk, for_chunks[i / 2]);
    EXPECT_EQ(copies[i + 1]->to_tier, 0);
    EXPECT_EQ(copies[i + 1]->bytes, kChunkBytes);
  }
}

TEST(EventLogManagerTest, CopiedBytesAndSamplesMatchStatistics) {
  auto hierarchy = testing::MakeHierarchy(3 * kChunkBytes, 0, kChunkBytes);
  auto manager = MakeManager(hierarchy, 5);
  manager->events().Enable(true);
  RunIteration(*manager, kScript);
  RunIteration(*manager, kScript);
  std::map<int, int64_t> bytes_in, bytes_out;
  int64_t evictions = 0, zero_fills = 0;
  for (const ChunkEvent& event : manager->events().events()) {
    if (event.type == EventType::kCopy) {
      bytes_in[event.to_tier] += event.bytes;
      bytes_out[event.from_tier] += event.bytes;
      EXPECT_TRUE(event.ok);
      EXPECT_LE(event.start_ns, event.end_ns);
      EXPECT_GE(event.wait_ns, 0);
    }
    evictions += event.type == EventType::kEviction && event.from_tier == 0;
    zero_fills += event.type == EventType::kZeroFill;
  }
  const std::vector<TierChunkStats> stats = manager->Stats();
  EXPECT_EQ(bytes_in[0], stats[0].bytes_in);
  EXPECT_EQ(bytes_out[0], stats[0].bytes_out);
  EXPECT_EQ(bytes_in[1], stats[1].bytes_in);
  EXPECT_EQ(evictions, stats[0].evictions);
  EXPECT_EQ(zero_fills, stats[0].zero_fills + stats[1].zero_fills);
  // One sample per tick and one per end of iteration, stamped with the moment they close.
  const std::vector<MomentSample>& samples = manager->events().samples();
  ASSERT_EQ(samples.size(), 2 * (kScript.size() + 1));
  for (size_t i = 0; i < samples.size(); ++i) {
    const MomentSample& sample = samples[i];
    const size_t in_iteration = i % (kScript.size() + 1);
    EXPECT_EQ(sample.iteration, static_cast<int64_t>(i / (kScript.size() + 1)));
    EXPECT_EQ(sample.moment, static_cast<int64_t>(in_iteration));
    EXPECT_EQ(sample.end_of_iteration, in_iteration == kScript.size());
    ASSERT_EQ(sample.num_tiers, 2);
    EXPECT_EQ(sample.tiers[0].budget_bytes, 3 * kChunkBytes);
    EXPECT_LE(sample.tiers[0].chunk_bytes, 3 * kChunkBytes);
    if (i > 0) {
      EXPECT_LE(samples[i - 1].time_ns, sample.time_ns);
    }
  }
  EXPECT_EQ(samples.back().tiers[0].chunk_bytes, stats[0].chunk_bytes);
  EXPECT_EQ(samples.back().tiers[1].chunk_bytes, stats[1].chunk_bytes);
}

TEST(EventLogManagerTest, PrefetchOptimizerExplicitAndDropCauses) {
  auto hierarchy = testing::MakeHierarchy(0, 0, kChunkBytes);
  auto manager = MakeManager(hierarchy, 3, /*prefetch_moments=*/2);
  manager->events().Enable(true);
  // Warm-up on the device; then move everything to the host so the next iteration's accesses
  // are prefetched back.
  RunIteration(*manager, {A, B, C});
  for (ChunkId chunk : {A, B, C}) ASSERT_TRUE(manager->MoveChunk(chunk, TierKind::kHost).ok());
  RunIteration(*manager, {A, B, C});
  std::map<EventCause, int> causes;
  for (const ChunkEvent& event : manager->events().events()) {
    if (event.type == EventType::kCopy) causes[event.cause] += 1;
  }
  EXPECT_EQ(causes[EventCause::kExplicit], 3);
  EXPECT_GE(causes[EventCause::kPrefetch], 1);
  EXPECT_EQ(causes[EventCause::kPrefetch] + causes[EventCause::kAccess], 3);
  EXPECT_EQ(causes[EventCause::kPrefetch], manager->Stats()[0].prefetch_issued);

  // The optimizer phase: an access that moves a chunk is an optimizer move; freeing drops it.
  manager->events().Clear();
  manager->events().set_phase(EventPhase::kOptimizer);
  ASSERT_TRUE(manager->Access(A, TierKind::kHost).ok());
  ASSERT_TRUE(manager->Release(A, TensorState::kFree).ok());
  const std::vector<ChunkEvent> events = manager->events().DrainEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].type, EventType::kCopy);
  EXPECT_EQ(events[0].cause, EventCause::kOptimizer);
  EXPECT_EQ(events[0].phase, EventPhase::kOptimizer);
  EXPECT_EQ(events[1].type, EventType::kDrop);
  EXPECT_EQ(events[1].chunk, A);
  EXPECT_EQ(events[1].from_tier, 1);
  EXPECT_EQ(events[1].bytes, kChunkBytes);
}

}  // namespace
}  // namespace ps
