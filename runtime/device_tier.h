// The CUDA device tier: cudaMalloc'd slabs on one device, through runtime/gpu.h (so the strict
// emulated device runs it too: Note [Strict device] in runtime/strict_device.h).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/tier.h"

namespace ps {

struct DeviceTierOptions {
  int device = 0;
  Tier::Options tier;  // name defaults to "cuda:<device>"
};

// FailedPrecondition when no device is usable (no CUDA build or GPU, and no strict device);
// InvalidArgument when `device` does not exist.
absl::StatusOr<std::unique_ptr<Tier>> CreateDeviceTier(DeviceTierOptions options);

}  // namespace ps
