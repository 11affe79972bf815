// DeviceTier: slabs of cudaMalloc'd memory on one device. It calls only runtime/gpu.h, so it is
// built with or without CUDA: the strict emulated device runs it on a CPU-only machine.
#include "runtime/device_tier.h"

#include "absl/strings/str_cat.h"
#include "runtime/gpu.h"
#include "runtime/status.h"

namespace ps {
namespace {

class DeviceTier final : public Tier {
 public:
  DeviceTier(int device, Tier::Options options)
      : Tier(TierKind::kDevice, AddressSpace::kDeviceMemory, std::move(options),
             /*blocks_start_valid=*/true),
        device_(device) {}
  ~DeviceTier() override { ReleaseAllRegions(); }

 protected:
  absl::StatusOr<uint64_t> ReserveRegion(int64_t bytes) override {
    PS_ASSIGN_OR_RETURN(void* pointer, gpu::DeviceMalloc(device_, bytes));
    return reinterpret_cast<uintptr_t>(pointer);
  }
  void ReleaseRegion(uint64_t base, int64_t) override {
    gpu::DeviceFree(device_, reinterpret_cast<void*>(static_cast<uintptr_t>(base)));
  }
  absl::Status CheckBlockIdle(uint64_t address, int64_t bytes) const override {
    return gpu::CheckIdle(reinterpret_cast<const void*>(static_cast<uintptr_t>(address)), bytes);
  }

 private:
  const int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tier>> CreateDeviceTier(DeviceTierOptions options) {
  if (gpu::DeviceCount() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the CUDA device tier: ", gpu::UnavailableReason()));
  }
  if (options.device < 0 || options.device >= gpu::DeviceCount()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", options.device, " does not exist (", gpu::DeviceCount(), " present)"));
  }
  if (options.tier.name.empty()) options.tier.name = absl::StrCat("cuda:", options.device);
  return std::unique_ptr<Tier>(new DeviceTier(options.device, std::move(options.tier)));
}

}  // namespace ps
