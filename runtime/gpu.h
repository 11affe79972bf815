// The device-neutral face of the GPU runtime. Declared here without any CUDA header; defined in
// runtime/cuda/gpu_cuda.cc when the build has CUDA and in runtime/gpu_stub.cc when it has not.
//
// Note [GPU presence]
// A CUDA build may run where no GPU (or no driver) exists, as CI does. Every entry point answers
// that case with FailedPrecondition naming the reason instead of aborting, DeviceCount() returns
// 0, and tests that need a GPU skip with UnavailableReason().
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ps::gpu {

bool CompiledWithCuda();
// True when the strict emulated device stands in for CUDA (Note [Strict device] in
// runtime/strict_device.h): every call below then reaches the emulation instead of cudart.
bool StrictDevice();
// Number of usable devices; 0 without a driver or GPU.
int DeviceCount();
// Why DeviceCount() is 0 (empty when a device is present).
std::string UnavailableReason();
// CUDA runtime version as "major.minor", or "none".
std::string RuntimeVersion();

absl::StatusOr<void*> HostAllocPinned(int64_t bytes);
void HostFreePinned(void* pointer);

absl::StatusOr<void*> DeviceMalloc(int device, int64_t bytes);
void DeviceFree(int device, void* pointer);

// Opaque handles to a cudaStream_t / cudaEvent_t.
struct Stream {
  void* handle = nullptr;
  int device = 0;
};
struct Event {
  void* handle = nullptr;
  int device = 0;
};

// A non-blocking stream (does not synchronize with the legacy default stream).
absl::StatusOr<Stream> CreateStream(int device);
void DestroyStream(Stream stream);
absl::Status SynchronizeStream(Stream stream);

absl::StatusOr<Event> CreateEvent(int device);
void DestroyEvent(Event event);
absl::Status RecordEvent(Event event, Stream stream);
absl::Status SynchronizeEvent(Event event);
// True once the work before the record point is done.
absl::StatusOr<bool> QueryEvent(Event event);
absl::Status StreamWaitEvent(Stream stream, Event event);

// Enqueues a copy of `bytes` on `stream`; host memory should be pinned for it to be async.
absl::Status CopyAsync(void* dst, const void* src, int64_t bytes, Stream stream);
absl::Status MemsetAsync(void* dst, int value, int64_t bytes, Stream stream);

// Waits for all work on `device` (cudaDeviceSynchronize).
absl::Status SynchronizeDevice(int device);

// The address at which device work (a kernel, torch compute on a view) reaches `pointer`: the
// pointer itself on a real GPU; the strict device's read-write alias of its device memory.
void* WorkPointer(const void* pointer);

// OK unless work still queued on some stream reads or writes [pointer, pointer + bytes): a block
// about to be reused. Only the strict device can tell; on a real GPU this is always OK.
absl::Status CheckIdle(const void* pointer, int64_t bytes);

}  // namespace ps::gpu
