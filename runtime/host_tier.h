// Host memory tiers: HostTier (pageable via mimalloc, or pinned via cudaHostAlloc) and
// EmulatedDeviceTier (host memory posing as a device with its own budget, so placement and
// eviction are testable and usable on machines with no GPU).
#pragma once

#include <memory>

#include "runtime/tier.h"

namespace ps {

struct HostTierOptions {
  Tier::Options tier;  // name defaults to "host"
  // Page-locked memory (needed for async GPU copies). Falls back to pageable memory, with a
  // logged note, when CUDA is not built or no GPU is present.
  bool pinned = false;
};

class HostTier final : public Tier {
 public:
  explicit HostTier(HostTierOptions options);
  ~HostTier() override;
  // Whether slabs really are page-locked (false after a fallback).
  bool pinned() const { return pinned_; }

 protected:
  absl::StatusOr<uint64_t> ReserveRegion(int64_t bytes) override;
  void ReleaseRegion(uint64_t base, int64_t bytes) override;

 private:
  bool pinned_;
};

struct EmulatedDeviceTierOptions {
  Tier::Options tier;  // name defaults to "emulated-device"
};

class EmulatedDeviceTier final : public Tier {
 public:
  explicit EmulatedDeviceTier(EmulatedDeviceTierOptions options);
  ~EmulatedDeviceTier() override;

 protected:
  absl::StatusOr<uint64_t> ReserveRegion(int64_t bytes) override;
  void ReleaseRegion(uint64_t base, int64_t bytes) override;
};

}  // namespace ps
