// The GPU runtime of a build without CUDA: every call says so.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/device_tier.h"
#include "runtime/gpu.h"

namespace ps::gpu {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError(
      "PatrickStar-C++ was built without CUDA (PS_WITH_CUDA=OFF or no nvcc at configure time)");
}
}  // namespace

bool CompiledWithCuda() { return false; }
int DeviceCount() { return 0; }
std::string UnavailableReason() { return std::string(NotBuilt().message()); }
std::string RuntimeVersion() { return "none"; }
absl::StatusOr<void*> HostAllocPinned(int64_t) { return NotBuilt(); }
void HostFreePinned(void*) {}
absl::StatusOr<void*> DeviceMalloc(int, int64_t) { return NotBuilt(); }
void DeviceFree(int, void*) {}
absl::StatusOr<Stream> CreateStream(int) { return NotBuilt(); }
void DestroyStream(Stream) {}
absl::Status SynchronizeStream(Stream) { return NotBuilt(); }
absl::StatusOr<Event> CreateEvent(int) { return NotBuilt(); }
void DestroyEvent(Event) {}
absl::Status RecordEvent(Event, Stream) { return NotBuilt(); }
absl::Status SynchronizeEvent(Event) { return NotBuilt(); }
absl::StatusOr<bool> QueryEvent(Event) { return NotBuilt(); }
absl::Status StreamWaitEvent(Stream, Event) { return NotBuilt(); }
absl::Status CopyAsync(void*, const void*, int64_t, Stream) { return NotBuilt(); }
absl::Status MemsetAsync(void*, int, int64_t, Stream) { return NotBuilt(); }

}  // namespace ps::gpu

namespace ps {
absl::StatusOr<std::unique_ptr<Tier>> CreateDeviceTier(DeviceTierOptions) {
  return absl::FailedPreconditionError(
      absl::StrCat("cannot create the CUDA device tier: ", gpu::UnavailableReason()));
}
}  // namespace ps
