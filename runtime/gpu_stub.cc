// The GPU runtime of a build without CUDA: the strict emulated device when it is on (Note
// [Strict device] in runtime/strict_device.h), otherwise every call says CUDA is not built.
#include "absl/status/status.h"
#include "runtime/gpu.h"
#include "runtime/strict_device.h"

namespace ps::gpu {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError(
      "PatrickStar-C++ was built without CUDA (PS_WITH_CUDA=OFF or no nvcc at configure time)");
}
}  // namespace

bool CompiledWithCuda() { return false; }
bool StrictDevice() { return strict::Enabled(); }
int DeviceCount() { return strict::Enabled() ? strict::DeviceCount() : 0; }
std::string UnavailableReason() {
  return strict::Enabled() ? "" : std::string(NotBuilt().message());
}
std::string RuntimeVersion() { return strict::Enabled() ? "strict emulated device" : "none"; }
absl::StatusOr<void*> HostAllocPinned(int64_t bytes) {
  if (strict::Enabled()) return strict::HostAllocPinned(bytes);
  return NotBuilt();
}
void HostFreePinned(void* pointer) {
  if (strict::Enabled()) strict::HostFreePinned(pointer);
}
absl::StatusOr<void*> DeviceMalloc(int device, int64_t bytes) {
  if (strict::Enabled()) return strict::DeviceMalloc(device, bytes);
  return NotBuilt();
}
void DeviceFree(int device, void* pointer) {
  if (strict::Enabled()) strict::DeviceFree(device, pointer);
}
absl::StatusOr<Stream> CreateStream(int device) {
  if (strict::Enabled()) return strict::CreateStream(device);
  return NotBuilt();
}
void DestroyStream(Stream stream) {
  if (strict::Enabled()) strict::DestroyStream(stream);
}
absl::Status SynchronizeStream(Stream stream) {
  return strict::Enabled() ? strict::SynchronizeStream(stream) : NotBuilt();
}
absl::StatusOr<Event> CreateEvent(int device) {
  if (strict::Enabled()) return strict::CreateEvent(device);
  return NotBuilt();
}
void DestroyEvent(Event event) {
  if (strict::Enabled()) strict::DestroyEvent(event);
}
absl::Status RecordEvent(Event event, Stream stream) {
  return strict::Enabled() ? strict::RecordEvent(event, stream) : NotBuilt();
}
absl::Status SynchronizeEvent(Event event) {
  return strict::Enabled() ? strict::SynchronizeEvent(event) : NotBuilt();
}
absl::StatusOr<bool> QueryEvent(Event event) {
  if (strict::Enabled()) return strict::QueryEvent(event);
  return NotBuilt();
}
absl::Status StreamWaitEvent(Stream stream, Event event) {
  return strict::Enabled() ? strict::StreamWaitEvent(stream, event) : NotBuilt();
}
absl::Status CopyAsync(void* dst, const void* src, int64_t bytes, Stream stream) {
  return strict::Enabled() ? strict::CopyAsync(dst, src, bytes, stream) : NotBuilt();
}
absl::Status MemsetAsync(void* dst, int value, int64_t bytes, Stream stream) {
  return strict::Enabled() ? strict::MemsetAsync(dst, value, bytes, stream) : NotBuilt();
}
absl::Status SynchronizeDevice(int device) {
  return strict::Enabled() ? strict::SynchronizeDevice(device) : NotBuilt();
}
void* WorkPointer(const void* pointer) {
  return strict::Enabled() ? strict::WorkPointer(pointer) : const_cast<void*>(pointer);
}
absl::Status CheckIdle(const void* pointer, int64_t bytes) {
  return strict::Enabled() ? strict::CheckIdle(pointer, bytes) : absl::OkStatus();
}

}  // namespace ps::gpu
