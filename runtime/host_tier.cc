#include "runtime/host_tier.h"

#include "absl/strings/str_cat.h"
#include "runtime/gpu.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"

namespace ps {
namespace {

Tier::Options WithDefaultName(Tier::Options options, const char* name) {
  if (options.name.empty()) options.name = name;
  return options;
}

absl::StatusOr<uint64_t> AllocateAligned(const std::string& tier_name, int64_t bytes) {
  void* pointer = AlignedHostAlloc(bytes, kBlockAlignment);
  if (pointer == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tier '", tier_name, "': host allocation of ", FormatBytes(bytes), " failed"));
  }
  return reinterpret_cast<uintptr_t>(pointer);
}

bool DecidePinned(bool requested, const std::string& name) {
  if (!requested) return false;
  if (gpu::DeviceCount() > 0) return true;
  PS_LOG(kInfo,
         "tier '%s': pinned host memory requested but unavailable (%s); using pageable "
         "memory",
         name, gpu::UnavailableReason());
  return false;
}

}  // namespace

HostTier::HostTier(HostTierOptions options)
    : Tier(TierKind::kHost, AddressSpace::kHostMemory, WithDefaultName(options.tier, "host"),
           /*blocks_start_valid=*/true),
      pinned_(DecidePinned(options.pinned, WithDefaultName(options.tier, "host").name)) {}

HostTier::~HostTier() { ReleaseAllRegions(); }

absl::StatusOr<uint64_t> HostTier::ReserveRegion(int64_t bytes) {
  if (pinned_) {
    absl::StatusOr<void*> pointer = gpu::HostAllocPinned(bytes);
    if (!pointer.ok()) return pointer.status();
    return reinterpret_cast<uintptr_t>(*pointer);
  }
  return AllocateAligned(name(), bytes);
}

void HostTier::ReleaseRegion(uint64_t base, int64_t) {
  void* pointer = reinterpret_cast<void*>(static_cast<uintptr_t>(base));
  if (pinned_) {
    gpu::HostFreePinned(pointer);
  } else {
    AlignedHostFree(pointer);
  }
}

EmulatedDeviceTier::EmulatedDeviceTier(EmulatedDeviceTierOptions options)
    : Tier(TierKind::kDevice, AddressSpace::kHostMemory,
           WithDefaultName(options.tier, "emulated-device"), /*blocks_start_valid=*/true) {}

EmulatedDeviceTier::~EmulatedDeviceTier() { ReleaseAllRegions(); }

absl::StatusOr<uint64_t> EmulatedDeviceTier::ReserveRegion(int64_t bytes) {
  return AllocateAligned(name(), bytes);
}

void EmulatedDeviceTier::ReleaseRegion(uint64_t base, int64_t) {
  AlignedHostFree(reinterpret_cast<void*>(static_cast<uintptr_t>(base)));
}

}  // namespace ps
