// Fault injection for tests: make chosen or random copies and NVMe IO pieces fail.
//
// Note [Fault injection]
// Reliability tests need a copy or an IO to fail at a moment of their choosing, deep inside a
// training step, in a build that is the one users run. A `FaultInjector` is parsed from a spec
// (the bindings read it from the environment variable PATRICKSTAR_FAULT_INJECT unless a spec is
// passed explicitly) and consulted by the copy engine before each copy (site `copy`) and by
// the NVMe tier before each IO piece (sites `nvme_read`, `nvme_write`). With no spec nothing is
// consulted, so production runs pay one null-pointer test per copy.
//
// Spec: rules separated by ';', each `site[:key=value]...`, site one of copy, nvme_read,
// nvme_write, nvme (both directions), any:
//   after=N    the first N operations at the site pass (default 0)
//   count=K    then K operations fail (default 1; 0 means every later one)
//   p=P        instead of after/count: each operation fails with probability P ...
//   seed=S     ... drawn from a generator seeded with S (default 1), so runs repeat
//   errno=E    the error (default EIO); for NVMe pieces `short=1` makes the IO transfer half
//              its bytes and then stall, which the tier reports as a short transfer
// Example: "nvme_write:after=40:errno=28" fails the 41st NVMe write piece with ENOSPC.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "runtime/nvme_tier.h"

namespace ps {

enum class FaultSite { kCopy, kNvmeRead, kNvmeWrite };

class FaultInjector {
 public:
  // InvalidArgument naming the bad rule for a malformed spec; nullptr for an empty spec.
  static absl::StatusOr<std::shared_ptr<FaultInjector>> Parse(absl::string_view spec);

  // Decides the fate of the next operation at `site`: error 0 means it proceeds.
  IoFault Next(FaultSite site, int64_t bytes);
  // Faults injected so far (all sites).
  int64_t injected() const;
  const std::string& spec() const { return spec_; }

 private:
  struct Rule {
    bool sites[3] = {false, false, false};
    int64_t after = 0;
    int64_t count = 1;  // 0: forever
    double probability = -1;
    int error = 5;  // EIO
    bool short_transfer = false;
    int64_t seen = 0;
    std::mt19937_64 random;
  };
  explicit FaultInjector(std::string spec) : spec_(std::move(spec)) {}

  std::string spec_;
  mutable absl::Mutex mutex_;
  std::vector<Rule> rules_ ABSL_GUARDED_BY(mutex_);
  int64_t injected_ ABSL_GUARDED_BY(mutex_) = 0;
};

// The NVMe tier's per-piece hook over a shared injector.
IoFaultInjector NvmeFaultHook(std::shared_ptr<FaultInjector> injector);

}  // namespace ps
