// Chunk tensors as torch tensors, shared by the chunk manager's bindings (init_chunk.cc), the
// engine's parameter slots (parameter_slots.cc) and the kernels (init_kernels.cc).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "bindings/torch_dtype.h"
#include "chunk/chunk_manager.h"

namespace ps::bindings {

// Tier names cross the bindings as TierKindName spells them (runtime/tier.h).
inline TierKind ParseTierKind(const std::string& name) {
  if (const std::optional<TierKind> kind = TierKindFromName(name)) return *kind;
  throw pybind11::value_error("unknown tier '" + name + "': expected 'device', 'host' or 'nvme'");
}

// A torch tensor over a COMPUTE tensor's bytes, in the tensor's registered shape. It holds no
// lease: it is valid only until the tensor is released (the engine re-creates views on every
// access).
inline at::Tensor TorchView(const TensorView& view) {
  const at::Device device = view.address_space == AddressSpace::kDeviceMemory
                                ? at::Device(at::kCUDA)
                                : at::Device(at::kCPU);
  return torch::from_blob(reinterpret_cast<void*>(static_cast<uintptr_t>(view.address)), view.shape,
                          at::TensorOptions().dtype(ToScalarType(view.dtype)).device(device));
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
