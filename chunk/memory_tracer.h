// The memory tracer: a moment counter, per-moment model and non-model bytes per tier, and the
// sequence of chunk accesses, recorded during the warm-up iteration and replayed afterwards.
//
// Note [Moments and the warm-up trace]
// The engine calls Tick() at every module pre/post forward/backward hook, so moment m of one
// iteration is the same point of the model as moment m of the next. During the first (warm-up)
// iteration the tracer records, per moment, the peak chunk bytes and the peak non-model bytes
// (activations, temporaries: what the caller reports or the probes return) of every tier, and
// every chunk access in order. EndIteration() freezes that record. Afterwards:
//   * NonModelBytes(tier) is the larger of the latest report and the warm-up peak at the current
//     moment, so the planner keeps room for activations before they are allocated;
//   * NextUse(chunk, position) answers "when is this chunk needed next" for OPT eviction, with the
//     sequence read cyclically (the next iteration repeats it);
//   * the accesses of the next K moments are what the prefetcher brings in ahead of time.
// A later iteration that runs longer than the warm-up one falls back to the reported numbers.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "nlohmann/json.hpp"

namespace ps {

using NonModelDataProbe = std::function<int64_t()>;

struct MomentRecord {
  std::vector<int64_t> model_bytes;      // peak chunk bytes per tier during the moment
  std::vector<int64_t> non_model_bytes;  // peak non-model bytes per tier during the moment
};

struct AccessRecord {
  int64_t chunk = 0;
  int64_t moment = 0;
  int tier = 0;  // index into the manager's tier list
};

inline constexpr int64_t kNeverUsedAgain = std::numeric_limits<int64_t>::max();

class MemoryTracer {
 public:
  explicit MemoryTracer(int num_tiers);

  bool warming_up() const { return warming_up_; }
  int64_t moment() const { return moment_; }
  int64_t iteration() const { return iteration_; }
  // Accesses made so far in the current iteration (the position of the next one).
  int64_t cursor() const { return cursor_; }

  void SetProbe(int tier, NonModelDataProbe probe);
  // Closes the current moment and opens the next; samples the probes into the new moment.
  void Tick();
  // Sets the non-model bytes of `tier` as of now.
  void ReportNonModelBytes(int tier, int64_t bytes);
  // The chunk bytes `tier` holds as of now (the manager calls this on every change).
  void ObserveModelBytes(int tier, int64_t bytes);
  // Records an access (during warm-up) and advances the cursor; returns its position.
  int64_t RecordAccess(int64_t chunk, int tier);
  // Ends the iteration; the first call ends warm-up and freezes the trace.
  void EndIteration();
  // During warm-up: forgets the moments and accesses recorded so far, so that what ran before
  // the first training iteration (initialization, loading a checkpoint) is not replayed as if
  // it were part of every iteration.
  void RestartWarmup();

  // Non-model bytes the planner must leave free on `tier` now (see the Note).
  int64_t NonModelBytes(int tier) const;
  // Non-model bytes on `tier` as last reported (or probed): what is there now, without the
  // trace's forecast (Note [The trace forecasts, the report bounds] in chunk_manager_placement.cc).
  int64_t ReportedNonModelBytes(int tier) const { return reported_non_model_[tier]; }
  // Warm-up peak of non-model bytes on `tier` at `moment`; the latest report when unknown.
  int64_t TracedNonModelBytes(int tier, int64_t moment) const;
  // Position of the next access of `chunk` after `position` (cyclic); kNeverUsedAgain if none.
  int64_t NextUse(int64_t chunk, int64_t position) const;

  const std::vector<MomentRecord>& trace() const { return trace_; }
  const std::vector<AccessRecord>& accesses() const { return accesses_; }
  nlohmann::json ToJson() const;

 private:
  MomentRecord& CurrentRecord();

  const int num_tiers_;
  bool warming_up_ = true;
  int64_t moment_ = 0;
  int64_t iteration_ = 0;
  int64_t cursor_ = 0;
  std::vector<int64_t> reported_non_model_;
  std::vector<int64_t> current_model_;
  std::vector<NonModelDataProbe> probes_;
  std::vector<MomentRecord> trace_;
  std::vector<AccessRecord> accesses_;
  absl::flat_hash_map<int64_t, std::vector<int64_t>> positions_;  // chunk -> sorted positions
};

}  // namespace ps
