// The strict emulated device: CUDA's rules on a CPU-only machine (PATRICKSTAR_STRICT_DEVICE=1).
//
// Note [Strict device]
// The project's GPU code calls runtime/gpu.h. With the strict device on, every one of those calls
// lands here instead of in cudart, so the code above (DeviceTier, CopyEngine's device routes, the
// bindings' stream and event handling) is the code a GPU runs. Only this layer is emulated:
//   - device memory is a memfd mapped twice: the address handed out (the "device pointer") is
//     mapped PROT_NONE, so any host read or write faults at once (a SIGSEGV handler names the
//     allocation, the offset and the call's backtrace), and a second read-write mapping, reached
//     only through WorkPointer(), stands for the device's own view of its memory. Copies,
//     memsets and the work enqueued with LaunchWork use it; views handed to torch for compute
//     go through gpu::WorkPointer() (the identity on a real GPU);
//   - each stream is a worker thread running its queue in order, late: kernels (memsets and
//     LaunchWork) are held back by PATRICKSTAR_STRICT_DEVICE_DELAY_US (default 200) while
//     copies are not, the order in which a missing wait between a kernel and a later copy
//     reads stale bytes. Work becomes visible to the host and to other streams only through
//     events, StreamWaitEvent and the synchronize calls, with CUDA's semantics: a wait or
//     query refers to the event's latest record at the time of the call, so an event
//     re-recorded while a wait on it is pending does not release (or stall) that wait;
//   - a block freed while queued work still touches it is an error (CheckIdle, called by
//     Tier::Free through DeviceTier), and so is a kernel touching another device's memory;
//   - PATRICKSTAR_STRICT_DEVICE_COUNT devices (default 8, so local_rank != 0 takes the same
//     path as on a multi-GPU node) of PATRICKSTAR_STRICT_DEVICE_MEMORY bytes each (default 16
//     GiB): cudaMalloc past it is ResourceExhausted, as on a GPU.
// The project's device kernels run as LaunchWork of the CPU kernels (kernels/internal/
// strict_kernels.h). What it cannot check: kernel speed and the CUDA kernels' own code, NCCL's
// transport, and torch's own CUDA work (torch here is
// the CPU build: its compute on a device view runs on the host, after the stream that stands
// for torch's current stream, ComputeStream(), has drained).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/gpu.h"

namespace ps::gpu::strict {

// True when PATRICKSTAR_STRICT_DEVICE=1 (read once).
bool Enabled();

// The emulated counterparts of runtime/gpu.h (same contracts).
int DeviceCount();
absl::StatusOr<void*> HostAllocPinned(int64_t bytes);
void HostFreePinned(void* pointer);
absl::StatusOr<void*> DeviceMalloc(int device, int64_t bytes);
void DeviceFree(int device, void* pointer);
absl::StatusOr<Stream> CreateStream(int device);
void DestroyStream(Stream stream);
absl::Status SynchronizeStream(Stream stream);
absl::StatusOr<Event> CreateEvent(int device);
void DestroyEvent(Event event);
absl::Status RecordEvent(Event event, Stream stream);
absl::Status SynchronizeEvent(Event event);
absl::StatusOr<bool> QueryEvent(Event event);
absl::Status StreamWaitEvent(Stream stream, Event event);
absl::Status CopyAsync(void* dst, const void* src, int64_t bytes, Stream stream);
absl::Status MemsetAsync(void* dst, int value, int64_t bytes, Stream stream);
absl::Status SynchronizeDevice(int device);
void* WorkPointer(const void* pointer);
absl::Status CheckIdle(const void* pointer, int64_t bytes);

// A byte range a piece of emulated work reads or writes (device pointers or host pointers).
struct MemoryRange {
  const void* pointer = nullptr;
  int64_t bytes = 0;
};

// Enqueues `work` on `stream` as a kernel: it runs on the stream's worker after the delay, and
// must reach device memory only through WorkPointer(). `touched` lists what it reads or writes:
// CheckIdle refuses to free those ranges until it ran, and a range on another device than the
// stream's is an illegal address (FailedPrecondition here, as cudaErrorIllegalAddress would be).
absl::Status LaunchWork(Stream stream, std::vector<MemoryRange> touched,
                        std::function<void()> work);

// The stream that stands for torch's current stream on `device` (torch here runs on the host).
absl::StatusOr<Stream> ComputeStream(int device);

// The device whose memory holds `pointer`, or -1 for host memory.
int DeviceOf(const void* pointer);

// How long each kernel waits on its stream before it runs (tests raise it so a missing wait
// reads stale bytes every time).
void SetKernelDelay(absl::Duration delay);
absl::Duration KernelDelay();

}  // namespace ps::gpu::strict
