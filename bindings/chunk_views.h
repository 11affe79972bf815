// Chunk tensors as torch tensors, shared by the chunk manager's bindings (init_chunk.cc), the
// engine's parameter slots (parameter_slots.cc) and the kernels (init_kernels.cc).
#pragma once

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "bindings/status_exceptions.h"
#include "bindings/torch_dtype.h"
#include "chunk/chunk_manager.h"
#include "runtime/gpu.h"
#include "runtime/strict_device.h"

namespace ps::bindings {

// Tier names cross the bindings as TierKindName spells them (runtime/tier.h).
inline TierKind ParseTierKind(const std::string& name) {
  if (const std::optional<TierKind> kind = TierKindFromName(name)) return *kind;
  throw pybind11::value_error("unknown tier '" + name + "': expected 'device', 'host' or 'nvme'");
}

// Note [Torch views of device memory]
// With a GPU, a chunk on the device is handed to torch as a CUDA tensor over the cudaMalloc
// pointer; torch's kernels run on its current stream. On the strict device (Note [Strict device]
// in runtime/strict_device.h) torch is the CPU build: the view is a CPU tensor over the
// device-side alias (gpu::WorkPointer), and since torch's compute then runs on the host at once,
// the stream standing for torch's current one is drained first, which is the order torch's
// kernels on that stream would have had.
inline at::Tensor MemoryTensor(void* data, at::IntArrayRef shape, at::ScalarType dtype,
                               AddressSpace space) {
  if (space == AddressSpace::kDeviceMemory && gpu::StrictDevice()) {
    const int device = gpu::strict::DeviceOf(data);
    if (device >= 0) {
      const gpu::Stream compute = ValueOrThrow(gpu::strict::ComputeStream(device));
      pybind11::gil_scoped_release release;
      ThrowIfError(gpu::SynchronizeStream(compute));
    }
    return torch::from_blob(gpu::WorkPointer(data), shape, at::TensorOptions().dtype(dtype));
  }
  const at::Device device =
      space == AddressSpace::kDeviceMemory ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  return torch::from_blob(data, shape, at::TensorOptions().dtype(dtype).device(device));
}

// A torch tensor over a COMPUTE tensor's bytes, in the tensor's registered shape. It holds no
// lease: it is valid only until the tensor is released (the engine re-creates views on every
// access).
inline at::Tensor TorchView(const TensorView& view) {
  return MemoryTensor(reinterpret_cast<void*>(static_cast<uintptr_t>(view.address)), view.shape,
                      ToScalarType(view.dtype), view.address_space);
}

// Note [Gradient stores on the compute stream]
// With a GPU the gradient store is torch's copy_ (or add_) on its current stream, and it may not
// have run when the engine releases the gradient chunk: an eviction or a reduce-scatter would
// then copy the chunk out before the gradient landed. So after enqueueing it, the store makes
// the copy engine's streams wait for the compute stream (CopyEngine::OrderAfter, an event), and
// the chunk can be released at once. On the strict device the store is emulated device work on
// the stream that stands for torch's current one, so a missing wait reads stale bytes there.
// The compute stream: torch's current stream on `device` with a GPU (device-neutral c10 calls,
// so a CPU build of LibTorch compiles it), or the strict device's stand-in.
inline gpu::Stream ComputeStream(int device) {
  if (gpu::StrictDevice()) return ValueOrThrow(gpu::strict::ComputeStream(device));
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  const c10::Stream stream = guard.getStream(c10::Device(c10::DeviceType::CUDA, device));
  return gpu::Stream{stream.native_handle(), device};
}

// Note [Gradient copies on the calling thread]
// The engine's gradient hook copies each gradient autograd made into its chunk while backward
// is still running. torch's copy_ splits a large copy over its intra-op threads; when another
// process keeps a core busy, that hand-off waits for it: on 2 cores with one busy, the small
// GPT's 15 MB of gradients took 19 ms a step through copy_ and 3 ms as one memcpy (on an idle
// machine both take about 1.6 ms). The caller has checked that both are contiguous CPU tensors of
// the same dtype and size.
inline void CopyOnCallingThread(const at::Tensor& src, const at::Tensor& dst) {
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  pybind11::gil_scoped_release release;
  if (bytes > 0) std::memcpy(dst.data_ptr(), src.data_ptr(), bytes);
}

}  // namespace ps::bindings
