// Shared helpers of the chunk_*_test.cc binaries: tiers, a temporary NVMe directory, and a
// manager factory.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chunk/chunk_manager.h"
#include "gtest/gtest.h"
#include "runtime/copy_engine.h"
#include "runtime/device_tier.h"
#include "runtime/gpu.h"
#include "runtime/host_tier.h"
#include "runtime/nvme_tier.h"
#include "test_util.h"  // TempDir

namespace ps::testing {

// One-block slabs keep the reservation equal to the blocks in use, so budgets are exact.
inline Tier::Options TierOptions(const std::string& name, int64_t budget, int64_t slab_bytes) {
  return Tier::Options{name, budget, slab_bytes};
}

// Where a test reads or writes a tensor it accessed, as compute would: the view's address, or on
// the strict device (PATRICKSTAR_STRICT_DEVICE=1) its device-side alias.
inline void* ComputePointer(const TensorView& view) {
  return gpu::WorkPointer(reinterpret_cast<const void*>(static_cast<uintptr_t>(view.address)));
}

struct Hierarchy {
  // The CUDA device tier on the strict device (Note [Strict device]); otherwise emulated.
  std::shared_ptr<Tier> device;
  std::shared_ptr<HostTier> host;
  std::shared_ptr<NvmeTier> nvme;
  std::shared_ptr<CopyEngine> engine = std::make_shared<CopyEngine>();

  std::vector<std::shared_ptr<Tier>> tiers() const {
    std::vector<std::shared_ptr<Tier>> list;
    if (device) list.push_back(device);
    if (host) list.push_back(host);
    if (nvme) list.push_back(nvme);
    return list;
  }
};

// `device_in_host_memory` keeps the EmulatedDeviceTier even on the strict device, for tests of
// what a host-memory device tier allows (a host communicator reducing on it in place).
inline Hierarchy MakeHierarchy(int64_t device_budget, int64_t host_budget, int64_t slab_bytes,
                               const std::string* nvme_directory = nullptr,
                               bool device_in_host_memory = false) {
  Hierarchy hierarchy;
  if (gpu::StrictDevice() && !device_in_host_memory) {
    auto device =
        CreateDeviceTier(DeviceTierOptions{0, TierOptions("device", device_budget, slab_bytes)});
    EXPECT_TRUE(device.ok()) << device.status();
    if (device.ok()) hierarchy.device = std::shared_ptr<Tier>(std::move(*device));
  } else {
    hierarchy.device = std::make_shared<EmulatedDeviceTier>(
        EmulatedDeviceTierOptions{TierOptions("device", device_budget, slab_bytes)});
  }
  HostTierOptions host_options;
  host_options.tier = TierOptions("host", host_budget, slab_bytes);
  host_options.pinned = gpu::StrictDevice();  // as the engine asks for with a GPU
  hierarchy.host = std::make_shared<HostTier>(host_options);
  if (nvme_directory != nullptr) {
    NvmeTierOptions nvme_options;
    nvme_options.tier = TierOptions("nvme", 0, slab_bytes);
    nvme_options.directory = *nvme_directory;
    auto nvme = NvmeTier::Create(std::move(nvme_options));
    EXPECT_TRUE(nvme.ok()) << nvme.status();
    if (nvme.ok()) hierarchy.nvme = std::shared_ptr<NvmeTier>(std::move(*nvme));
  }
  return hierarchy;
}

inline std::unique_ptr<ChunkManager> MakeManager(const Hierarchy& hierarchy,
                                                 ChunkManagerOptions options = {}) {
  options.tiers = hierarchy.tiers();
  options.copy_engine = hierarchy.engine;
  auto manager = ChunkManager::Create(std::move(options));
  EXPECT_TRUE(manager.ok()) << manager.status();
  return manager.ok() ? std::move(*manager) : nullptr;
}

// A manager over `hierarchy` with `chunks` chunks of 1024 fp32 elements, tensor i alone in chunk
// i (tensor ids = chunk ids), for scripted access sequences.
inline std::unique_ptr<ChunkManager> MakeOneTensorPerChunkManager(
    const Hierarchy& hierarchy, int chunks, ChunkManagerOptions options = {}) {
  auto manager = MakeManager(hierarchy, std::move(options));
  if (manager == nullptr) return nullptr;
  for (int i = 0; i < chunks; ++i) {
    EXPECT_TRUE(manager
                    ->RegisterTensor(TensorSpec{"chunk" + std::to_string(i), {1024},
                                                ChunkKind::kComputeParam, DType::kFloat32})
                    .ok());
  }
  EXPECT_TRUE(manager->BuildChunkLists(1024).ok());
  EXPECT_EQ(manager->num_chunks(), chunks);
  return manager;
}

inline TensorSpec Spec(const std::string& name, std::vector<int64_t> shape,
                       ChunkKind kind = ChunkKind::kComputeParam, DType dtype = DType::kFloat32) {
  return TensorSpec{name, std::move(shape), kind, dtype};
}

}  // namespace ps::testing
