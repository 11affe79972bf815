// The chunk manager's event log for memory profiles: every chunk placement, copy, eviction and
// drop, and a per-tier memory sample at every moment, with steady-clock timestamps. Off by
// default; the profiler (python/patrickstar/profiler.py) enables it, drains it and turns it into
// trace.json / memory.csv / summary.json / report.html.
//
// Note [Event log cost]
// Profiling off must cost nothing measurable, so every recording call starts with one branch on
// `enabled_` and the manager only computes what a record needs (a next-use distance, a tier
// sample) behind `enabled()`. On, a record is a push_back of a plain struct into a vector whose
// capacity is bounded: when full, records are counted in `dropped()` instead of growing without
// end (a long run that nobody drains cannot exhaust memory). Copies are recorded in two halves
// (issued, settled) because only the issuer knows the source tier and only the settler knows how
// long the caller waited; the issue half is kept per chunk until the copy settles.
//
// Note [Event causes]
// Only the manager knows why a copy happened. A copy issued by the prefetcher is kPrefetch; one
// issued while a victim is moved down is kEviction; an explicit MoveChunk is kExplicit; any other
// synchronous copy is an access that found its chunk elsewhere: kAccess, or kOptimizer while the
// engine has set the phase to kOptimizer. The "trigger" of an eviction is the operation that
// needed the room (an access, a budget check at a tick, a gather, an explicit move) together with
// the chunk it was for, kept in a small stack of scopes that the manager opens at its entry points.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "chunk/memory_tracer.h"

namespace ps {

enum class EventType : uint8_t {
  kCopy,      // a payload copied from one tier to another (from_tier -> to_tier)
  kZeroFill,  // a payload created zeroed on to_tier (first use, or the target of a gather)
  kDrop,      // a payload freed because no tensor holds data any more (from_tier -> nowhere)
  kEviction,  // a victim chosen to make room on from_tier; its copy follows as a kCopy event
};

enum class EventCause : uint8_t { kAccess, kPrefetch, kEviction, kOptimizer, kExplicit };

// What the engine is doing; set by the caller, recorded with every event.
enum class EventPhase : uint8_t { kOther, kForward, kBackward, kOptimizer };

// The operation that made an eviction necessary.
enum class EventTrigger : uint8_t { kNone, kAccess, kBudget, kGather, kExplicit, kPrefetch };

absl::string_view EventTypeName(EventType type);
absl::string_view EventCauseName(EventCause cause);
absl::string_view EventPhaseName(EventPhase phase);
absl::string_view EventTriggerName(EventTrigger trigger);
// Accesses from the tracer's cursor until `chunk` is used again (Note [Victim choice]); -1 during
// warm-up or when the recorded sequence never uses it again.
int64_t NextUseDistance(const MemoryTracer& tracer, int64_t chunk);
// Accepts the names above ("other", "forward", "backward", "optimizer"); false if unknown.
bool ParseEventPhase(absl::string_view name, EventPhase* phase);

struct ChunkEvent {
  EventType type = EventType::kCopy;
  EventCause cause = EventCause::kAccess;
  EventPhase phase = EventPhase::kOther;
  EventTrigger trigger = EventTrigger::kNone;  // evictions: what needed the room
  bool ok = true;                              // copies: whether the copy succeeded
  int from_tier = -1;                          // index into the manager's tiers; -1: nowhere
  int to_tier = -1;
  int64_t chunk = -1;
  int64_t bytes = 0;
  int64_t iteration = 0;
  int64_t moment = 0;
  int64_t start_ns = 0;  // copies: issued; others: when it happened
  int64_t end_ns = 0;    // copies: settled (the copy was complete by then); others: = start_ns
  int64_t wait_ns = 0;   // copies: how long the manager blocked waiting for it
  // Evictions: accesses from now until the victim is used again (cyclic, from the warm-up
  // trace); -1 when unknown (warm-up) or never used again.
  int64_t next_use_distance = -1;
  int64_t for_chunk = -1;  // evictions: the chunk the room was for (-1: none, e.g. a budget check)
};

inline constexpr int kMaxEventTiers = 3;  // device, host, NVMe

struct TierSample {
  int64_t chunk_bytes = 0;
  int64_t non_model_bytes = 0;
  int64_t budget_bytes = 0;  // as configured; 0 = unlimited
};

// The state of every tier when a moment closes (at Tick, and at EndIteration).
struct MomentSample {
  int64_t time_ns = 0;
  int64_t iteration = 0;
  int64_t moment = 0;
  bool end_of_iteration = false;
  int num_tiers = 0;
  std::array<TierSample, kMaxEventTiers> tiers{};
};

class EventLog {
 public:
  static constexpr int64_t kDefaultCapacity = 1 << 20;

  // Steady-clock nanoseconds (CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic_ns).
  static int64_t NowNs();

  // Records are stamped with the tracer's iteration and moment (0 and 0 without a tracer).
  explicit EventLog(const MemoryTracer* tracer = nullptr) : tracer_(tracer) {}

  bool enabled() const { return enabled_; }
  // Turns recording on or off; `capacity` bounds the records kept (events and samples each).
  void Enable(bool on, int64_t capacity = kDefaultCapacity);
  EventPhase phase() const { return phase_; }
  void set_phase(EventPhase phase) { phase_ = phase; }
  // Records lost because the log was full since the last Clear().
  int64_t dropped() const { return dropped_; }

  // Opens a trigger scope (Note [Event causes]); nested scopes restore the outer one on close.
  class TriggerScope {
   public:
    TriggerScope(EventLog& log, EventTrigger trigger, int64_t for_chunk);
    ~TriggerScope();
    TriggerScope(const TriggerScope&) = delete;
    TriggerScope& operator=(const TriggerScope&) = delete;

   private:
    EventLog& log_;
    EventTrigger saved_trigger_;
    int64_t saved_chunk_;
  };
  // While open, synchronous copies are recorded with cause kEviction.
  class EvictionScope {
   public:
    explicit EvictionScope(EventLog& log);
    ~EvictionScope();
    EvictionScope(const EvictionScope&) = delete;
    EvictionScope& operator=(const EvictionScope&) = delete;

   private:
    EventLog& log_;
    bool saved_;
  };

  // A copy of `chunk` from `from_tier` to `to_tier` was started.
  void CopyIssued(int64_t chunk, int from_tier, int to_tier, int64_t bytes, bool prefetch);
  // The copy of `chunk` issued last has settled after the caller waited `wait_ns`.
  void CopySettled(int64_t chunk, int64_t wait_ns, bool ok);
  void ZeroFill(int64_t chunk, int tier, int64_t bytes);
  void Drop(int64_t chunk, int tier, int64_t bytes);
  void Eviction(int64_t chunk, int from_tier, int to_tier, int64_t bytes,
                int64_t next_use_distance);
  void Moment(bool end_of_iteration, absl::Span<const TierSample> tiers);

  const std::vector<ChunkEvent>& events() const { return events_; }
  const std::vector<MomentSample>& samples() const { return samples_; }
  // Hands over what was recorded and starts empty (copies still in flight stay pending).
  std::vector<ChunkEvent> DrainEvents();
  std::vector<MomentSample> DrainSamples();
  // Forgets everything, pending copies and the dropped count included.
  void Clear();

 private:
  ChunkEvent Stamp(EventType type) const;
  void Push(const ChunkEvent& event);
  // A zero-fill or drop: a payload appearing on or leaving a tier without a copy.
  void PushPlacement(EventType type, int64_t chunk, int from_tier, int to_tier, int64_t bytes);

  bool enabled_ = false;
  int64_t capacity_ = kDefaultCapacity;
  int64_t dropped_ = 0;
  EventPhase phase_ = EventPhase::kOther;
  const MemoryTracer* tracer_;
  EventTrigger trigger_ = EventTrigger::kNone;
  int64_t trigger_chunk_ = -1;
  bool evicting_ = false;
  std::vector<ChunkEvent> events_;
  std::vector<MomentSample> samples_;
  absl::flat_hash_map<int64_t, ChunkEvent> pending_;  // chunk -> issued copy
};

}  // namespace ps
