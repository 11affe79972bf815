#include "chunk/memory_tracer.h"

#include <algorithm>

#include "runtime/status.h"

namespace ps {

MemoryTracer::MemoryTracer(int num_tiers)
    : num_tiers_(num_tiers),
      reported_non_model_(num_tiers, 0),
      current_model_(num_tiers, 0),
      probes_(num_tiers) {
  trace_.push_back(
      MomentRecord{std::vector<int64_t>(num_tiers, 0), std::vector<int64_t>(num_tiers, 0)});
}

void MemoryTracer::SetProbe(int tier, NonModelDataProbe probe) {
  PS_CHECK(tier >= 0 && tier < num_tiers_, "tier index ", tier, " out of range");
  probes_[tier] = std::move(probe);
}

MomentRecord& MemoryTracer::CurrentRecord() {
  // Only called during warm-up, when trace_ grows one record per moment.
  PS_CHECK(moment_ < static_cast<int64_t>(trace_.size()), "moment ", moment_, " has no record");
  return trace_[moment_];
}

void MemoryTracer::Tick() {
  ++moment_;
  // A moment's record starts from the levels at its start: the probes' samples where there are
  // probes, else the last reported level.
  for (int tier = 0; tier < num_tiers_; ++tier) {
    if (probes_[tier]) reported_non_model_[tier] = probes_[tier]();
  }
  if (warming_up_) {
    trace_.push_back(MomentRecord{current_model_, reported_non_model_});
  }
}

void MemoryTracer::ReportNonModelBytes(int tier, int64_t bytes) {
  PS_CHECK(tier >= 0 && tier < num_tiers_, "tier index ", tier, " out of range");
  reported_non_model_[tier] = bytes;
  if (warming_up_) {
    int64_t& peak = CurrentRecord().non_model_bytes[tier];
    peak = std::max(peak, bytes);
  }
}

void MemoryTracer::ObserveModelBytes(int tier, int64_t bytes) {
  current_model_[tier] = bytes;
  if (warming_up_) {
    int64_t& peak = CurrentRecord().model_bytes[tier];
    peak = std::max(peak, bytes);
  }
}

int64_t MemoryTracer::RecordAccess(int64_t chunk, int tier) {
  if (warming_up_) {
    positions_[chunk].push_back(static_cast<int64_t>(accesses_.size()));
    accesses_.push_back(AccessRecord{chunk, moment_, tier});
  }
  return cursor_++;
}

void MemoryTracer::EndIteration() {
  warming_up_ = false;
  ++iteration_;
  moment_ = 0;
  cursor_ = 0;
}

void MemoryTracer::RestartWarmup() {
  PS_CHECK(warming_up_, "RestartWarmup after warm-up ended");
  moment_ = 0;
  cursor_ = 0;
  trace_.assign(1, MomentRecord{current_model_, reported_non_model_});
  accesses_.clear();
  positions_.clear();
}

int64_t MemoryTracer::TracedNonModelBytes(int tier, int64_t moment) const {
  if (warming_up_ || moment >= static_cast<int64_t>(trace_.size())) {
    return reported_non_model_[tier];
  }
  return trace_[moment].non_model_bytes[tier];
}

int64_t MemoryTracer::NonModelBytes(int tier) const {
  return std::max(reported_non_model_[tier], TracedNonModelBytes(tier, moment_));
}

int64_t MemoryTracer::NextUse(int64_t chunk, int64_t position) const {
  auto it = positions_.find(chunk);
  if (it == positions_.end() || it->second.empty()) return kNeverUsedAgain;
  const std::vector<int64_t>& positions = it->second;
  auto next = std::upper_bound(positions.begin(), positions.end(), position);
  if (next != positions.end()) return *next;
  // Read cyclically: the next iteration repeats the sequence.
  return positions.front() + static_cast<int64_t>(accesses_.size());
}

nlohmann::json MemoryTracer::ToJson() const {
  nlohmann::json moments = nlohmann::json::array();
  for (size_t m = 0; m < trace_.size(); ++m) {
    moments.push_back({{"moment", m},
                       {"model_bytes", trace_[m].model_bytes},
                       {"non_model_bytes", trace_[m].non_model_bytes}});
  }
  nlohmann::json accesses = nlohmann::json::array();
  for (const AccessRecord& access : accesses_) {
    accesses.push_back({{"chunk", access.chunk}, {"moment", access.moment}, {"tier", access.tier}});
  }
  return {{"warming_up", warming_up_},
          {"iteration", iteration_},
          {"moment", moment_},
          {"moments", moments},
          {"accesses", accesses}};
}

}  // namespace ps
