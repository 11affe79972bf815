// The GPU runtime over the CUDA runtime API.
#include <cuda_runtime.h>

#include <mutex>

#include "absl/strings/str_cat.h"
#include "runtime/gpu.h"
#include "runtime/status.h"
#include "runtime/strict_device.h"

namespace ps::gpu {
namespace {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver ||
      error == cudaErrorInvalidDevice) {
    return absl::FailedPreconditionError(message);
  }
  return absl::InternalError(message);
}

struct Probe {
  int count = 0;
  std::string reason;
};

const Probe& GetProbe() {
  static const Probe probe = [] {
    Probe p;
    const cudaError_t error = cudaGetDeviceCount(&p.count);
    if (error != cudaSuccess) {
      cudaGetLastError();
      p.count = 0;
      p.reason = absl::StrCat("no usable CUDA device: ", cudaGetErrorName(error), " (",
                              cudaGetErrorString(error), ")");
    } else if (p.count == 0) {
      p.reason = "no CUDA device found";
    }
    return p;
  }();
  return probe;
}

absl::Status RequireDevice(int device) {
  const Probe& probe = GetProbe();
  if (probe.count == 0) return absl::FailedPreconditionError(probe.reason);
  if (device < 0 || device >= probe.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist (", probe.count, " present)"));
  }
  return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

}  // namespace

bool CompiledWithCuda() { return true; }
int DeviceCount() {
  if (strict::Enabled()) return strict::DeviceCount();
  return GetProbe().count;
}
bool StrictDevice() { return strict::Enabled(); }

std::string UnavailableReason() { return strict::Enabled() ? "" : GetProbe().reason; }

std::string RuntimeVersion() {
  if (strict::Enabled()) return "strict emulated device";
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return "unknown";
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

absl::StatusOr<void*> HostAllocPinned(int64_t bytes) {
  if (strict::Enabled()) return strict::HostAllocPinned(bytes);
  if (GetProbe().count == 0) return absl::FailedPreconditionError(GetProbe().reason);
  void* pointer = nullptr;
  PS_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable),
                                absl::StrCat("cudaHostAlloc(", bytes, " bytes)")));
  return pointer;
}

void HostFreePinned(void* pointer) {
  if (strict::Enabled()) return strict::HostFreePinned(pointer);
  if (pointer != nullptr) cudaFreeHost(pointer);
}

absl::StatusOr<void*> DeviceMalloc(int device, int64_t bytes) {
  if (strict::Enabled()) return strict::DeviceMalloc(device, bytes);
  PS_RETURN_IF_ERROR(RequireDevice(device));
  void* pointer = nullptr;
  PS_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&pointer, bytes),
                                absl::StrCat("cudaMalloc(", bytes, " bytes) on device ", device)));
  return pointer;
}

void DeviceFree(int device, void* pointer) {
  if (strict::Enabled()) return strict::DeviceFree(device, pointer);
  if (pointer == nullptr) return;
  cudaSetDevice(device);
  cudaFree(pointer);
}

absl::StatusOr<Stream> CreateStream(int device) {
  if (strict::Enabled()) return strict::CreateStream(device);
  PS_RETURN_IF_ERROR(RequireDevice(device));
  cudaStream_t stream = nullptr;
  PS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                "cudaStreamCreateWithFlags"));
  return Stream{stream, device};
}

void DestroyStream(Stream stream) {
  if (strict::Enabled()) return strict::DestroyStream(stream);
  if (stream.handle != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream.handle));
}

absl::Status SynchronizeStream(Stream stream) {
  if (strict::Enabled()) return strict::SynchronizeStream(stream);
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)),
                    "cudaStreamSynchronize");
}

absl::StatusOr<Event> CreateEvent(int device) {
  if (strict::Enabled()) return strict::CreateEvent(device);
  PS_RETURN_IF_ERROR(RequireDevice(device));
  cudaEvent_t event = nullptr;
  PS_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  return Event{event, device};
}

void DestroyEvent(Event event) {
  if (strict::Enabled()) return strict::DestroyEvent(event);
  if (event.handle != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event.handle));
}

absl::Status RecordEvent(Event event, Stream stream) {
  if (strict::Enabled()) return strict::RecordEvent(event, stream);
  return CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(event.handle),
                                    static_cast<cudaStream_t>(stream.handle)),
                    "cudaEventRecord");
}

absl::Status SynchronizeEvent(Event event) {
  if (strict::Enabled()) return strict::SynchronizeEvent(event);
  return CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(event.handle)),
                    "cudaEventSynchronize");
}

absl::StatusOr<bool> QueryEvent(Event event) {
  if (strict::Enabled()) return strict::QueryEvent(event);
  const cudaError_t error = cudaEventQuery(static_cast<cudaEvent_t>(event.handle));
  if (error == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  PS_RETURN_IF_ERROR(CudaStatus(error, "cudaEventQuery"));
  return true;
}

absl::Status StreamWaitEvent(Stream stream, Event event) {
  if (strict::Enabled()) return strict::StreamWaitEvent(stream, event);
  return CudaStatus(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle),
                                        static_cast<cudaEvent_t>(event.handle), 0),
                    "cudaStreamWaitEvent");
}

absl::Status CopyAsync(void* dst, const void* src, int64_t bytes, Stream stream) {
  if (strict::Enabled()) return strict::CopyAsync(dst, src, bytes, stream);
  cudaSetDevice(stream.device);
  return CudaStatus(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.handle)),
      absl::StrCat("cudaMemcpyAsync(", bytes, " bytes)"));
}

absl::Status MemsetAsync(void* dst, int value, int64_t bytes, Stream stream) {
  if (strict::Enabled()) return strict::MemsetAsync(dst, value, bytes, stream);
  cudaSetDevice(stream.device);
  return CudaStatus(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream.handle)),
                    absl::StrCat("cudaMemsetAsync(", bytes, " bytes)"));
}

absl::Status SynchronizeDevice(int device) {
  if (strict::Enabled()) return strict::SynchronizeDevice(device);
  PS_RETURN_IF_ERROR(RequireDevice(device));
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void* WorkPointer(const void* pointer) {
  return strict::Enabled() ? strict::WorkPointer(pointer) : const_cast<void*>(pointer);
}

absl::Status CheckIdle(const void* pointer, int64_t bytes) {
  return strict::Enabled() ? strict::CheckIdle(pointer, bytes) : absl::OkStatus();
}

}  // namespace ps::gpu
