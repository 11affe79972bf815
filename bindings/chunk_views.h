// Chunk tensors as torch tensors, shared by the chunk manager's bindings (init_chunk.cc) and the
// engine's parameter slots (parameter_slots.cc).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "bindings/torch_dtype.h"
#include "chunk/chunk_manager.h"

namespace ps::bindings {

inline TierKind ParseTierKind(const std::string& name) {
  if (name == "device") return TierKind::kDevice;
  if (name == "host") return TierKind::kHost;
  if (name == "nvme") return TierKind::kNvme;
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

}  // namespace ps::bindings
