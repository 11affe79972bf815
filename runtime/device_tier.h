// The CUDA device tier: cudaMalloc'd slabs on one device. Defined in runtime/cuda/ (CUDA builds)
// or as a stub that reports the missing CUDA build.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/tier.h"

namespace ps {

struct DeviceTierOptions {
  int device = 0;
  Tier::Options tier;  // name defaults to "cuda:<device>"
};

// FailedPrecondition when the build has no CUDA or no such device exists.
absl::StatusOr<std::unique_ptr<Tier>> CreateDeviceTier(DeviceTierOptions options);

}  // namespace ps
