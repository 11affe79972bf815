#include "chunk/event_log.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace ps {

absl::string_view EventTypeName(EventType type) {
  switch (type) {
    case EventType::kCopy:
      return "copy";
    case EventType::kZeroFill:
      return "zero_fill";
    case EventType::kDrop:
      return "drop";
    case EventType::kEviction:
      return "eviction";
  }
  return "unknown";
}

absl::string_view EventCauseName(EventCause cause) {
  switch (cause) {
    case EventCause::kAccess:
      return "access";
    case EventCause::kPrefetch:
      return "prefetch";
    case EventCause::kEviction:
      return "eviction";
    case EventCause::kOptimizer:
      return "optimizer";
    case EventCause::kExplicit:
      return "explicit";
  }
  return "unknown";
}

absl::string_view EventPhaseName(EventPhase phase) {
  switch (phase) {
    case EventPhase::kOther:
      return "other";
    case EventPhase::kForward:
      return "forward";
    case EventPhase::kBackward:
      return "backward";
    case EventPhase::kOptimizer:
      return "optimizer";
  }
  return "unknown";
}

absl::string_view EventTriggerName(EventTrigger trigger) {
  switch (trigger) {
    case EventTrigger::kNone:
      return "none";
    case EventTrigger::kAccess:
      return "access";
    case EventTrigger::kBudget:
      return "budget";
    case EventTrigger::kGather:
      return "gather";
    case EventTrigger::kExplicit:
      return "explicit";
    case EventTrigger::kPrefetch:
      return "prefetch";
  }
  return "unknown";
}

bool ParseEventPhase(absl::string_view name, EventPhase* phase) {
  for (EventPhase candidate : {EventPhase::kOther, EventPhase::kForward, EventPhase::kBackward,
                               EventPhase::kOptimizer}) {
    if (name == EventPhaseName(candidate)) {
      *phase = candidate;
      return true;
    }
  }
  return false;
}

int64_t NextUseDistance(const MemoryTracer& tracer, int64_t chunk) {
  if (tracer.warming_up() || tracer.accesses().empty()) return -1;
  const int64_t now = tracer.cursor() - 1;
  const int64_t next = tracer.NextUse(chunk, now);
  return next == kNeverUsedAgain ? -1 : next - now;
}

int64_t EventLog::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void EventLog::Enable(bool on, int64_t capacity) {
  enabled_ = on;
  capacity_ = std::max<int64_t>(capacity, 1);
  if (!on) pending_.clear();
}

EventLog::TriggerScope::TriggerScope(EventLog& log, EventTrigger trigger, int64_t for_chunk)
    : log_(log), saved_trigger_(log.trigger_), saved_chunk_(log.trigger_chunk_) {
  log_.trigger_ = trigger;
  log_.trigger_chunk_ = for_chunk;
}

EventLog::TriggerScope::~TriggerScope() {
  log_.trigger_ = saved_trigger_;
  log_.trigger_chunk_ = saved_chunk_;
}

EventLog::EvictionScope::EvictionScope(EventLog& log) : log_(log), saved_(log.evicting_) {
  log_.evicting_ = true;
}

EventLog::EvictionScope::~EvictionScope() { log_.evicting_ = saved_; }

ChunkEvent EventLog::Stamp(EventType type) const {
  ChunkEvent event;
  event.type = type;
  event.phase = phase_;
  if (tracer_ != nullptr) {
    event.iteration = tracer_->iteration();
    event.moment = tracer_->moment();
  }
  event.start_ns = event.end_ns = NowNs();
  return event;
}

void EventLog::Push(const ChunkEvent& event) {
  if (static_cast<int64_t>(events_.size()) >= capacity_) {
    ++dropped_;
    return;
  }
  events_.push_back(event);
}

void EventLog::CopyIssued(int64_t chunk, int from_tier, int to_tier, int64_t bytes,
                          bool prefetch) {
  if (!enabled_) return;
  ChunkEvent event = Stamp(EventType::kCopy);
  event.chunk = chunk;
  event.from_tier = from_tier;
  event.to_tier = to_tier;
  event.bytes = bytes;
  if (prefetch) {
    event.cause = EventCause::kPrefetch;
  } else if (evicting_) {
    event.cause = EventCause::kEviction;
  } else if (trigger_ == EventTrigger::kExplicit) {
    event.cause = EventCause::kExplicit;
  } else if (phase_ == EventPhase::kOptimizer) {
    event.cause = EventCause::kOptimizer;
  } else {
    event.cause = EventCause::kAccess;
  }
  pending_[chunk] = event;
}

void EventLog::CopySettled(int64_t chunk, int64_t wait_ns, bool ok) {
  if (!enabled_) return;
  auto it = pending_.find(chunk);
  if (it == pending_.end()) return;  // issued before the log was enabled
  ChunkEvent event = it->second;
  pending_.erase(it);
  event.end_ns = NowNs();
  event.wait_ns = wait_ns;
  event.ok = ok;
  Push(event);
}

void EventLog::PushPlacement(EventType type, int64_t chunk, int from_tier, int to_tier,
                             int64_t bytes) {
  ChunkEvent event = Stamp(type);
  event.cause = phase_ == EventPhase::kOptimizer ? EventCause::kOptimizer : EventCause::kAccess;
  event.chunk = chunk;
  event.from_tier = from_tier;
  event.to_tier = to_tier;
  event.bytes = bytes;
  Push(event);
}

void EventLog::ZeroFill(int64_t chunk, int tier, int64_t bytes) {
  if (enabled_) PushPlacement(EventType::kZeroFill, chunk, -1, tier, bytes);
}

void EventLog::Drop(int64_t chunk, int tier, int64_t bytes) {
  if (enabled_) PushPlacement(EventType::kDrop, chunk, tier, -1, bytes);
}

void EventLog::Eviction(int64_t chunk, int from_tier, int to_tier, int64_t bytes,
                        int64_t next_use_distance) {
  if (!enabled_) return;
  ChunkEvent event = Stamp(EventType::kEviction);
  event.cause = EventCause::kEviction;
  event.trigger = trigger_;
  event.for_chunk = trigger_chunk_;
  event.chunk = chunk;
  event.from_tier = from_tier;
  event.to_tier = to_tier;
  event.bytes = bytes;
  event.next_use_distance = next_use_distance;
  Push(event);
}

void EventLog::Moment(bool end_of_iteration, absl::Span<const TierSample> tiers) {
  if (!enabled_) return;
  if (static_cast<int64_t>(samples_.size()) >= capacity_) {
    ++dropped_;
    return;
  }
  MomentSample sample;
  sample.time_ns = NowNs();
  if (tracer_ != nullptr) {
    sample.iteration = tracer_->iteration();
    sample.moment = tracer_->moment();
  }
  sample.end_of_iteration = end_of_iteration;
  sample.num_tiers = static_cast<int>(std::min<size_t>(tiers.size(), kMaxEventTiers));
  std::copy_n(tiers.begin(), sample.num_tiers, sample.tiers.begin());
  samples_.push_back(sample);
}

std::vector<ChunkEvent> EventLog::DrainEvents() {
  std::vector<ChunkEvent> drained;
  drained.swap(events_);
  return drained;
}

std::vector<MomentSample> EventLog::DrainSamples() {
  std::vector<MomentSample> drained;
  drained.swap(samples_);
  return drained;
}

void EventLog::Clear() {
  events_.clear();
  samples_.clear();
  pending_.clear();
  dropped_ = 0;
}

}  // namespace ps
