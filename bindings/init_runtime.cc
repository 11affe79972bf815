// Python bindings of the runtime layer: tiers, blocks, the copy engine, logging, build info.
#include <torch/extension.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "bindings/init.h"
#include "bindings/status_exceptions.h"
#include "runtime/copy_engine.h"
#include "runtime/device_tier.h"
#include "runtime/fault_injection.h"
#include "runtime/gpu.h"
#include "runtime/host_tier.h"
#include "runtime/logging.h"
#include "runtime/nvme_tier.h"
#include "runtime/strict_device.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

// Tiers are shared between Python and the tensor views of their blocks: a view keeps its tier
// alive and holds a pin on its block (Note [Block pins and validity]).
using TierPtr = std::shared_ptr<Tier>;

py::dict StatToDict(const Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

py::dict StatsToDict(const TierStats& stats) {
  py::dict d;
  d["bytes"] = StatToDict(stats.bytes);
  d["blocks"] = StatToDict(stats.blocks);
  d["reserved_bytes"] = stats.reserved_bytes;
  d["peak_reserved_bytes"] = stats.peak_reserved_bytes;
  d["budget_bytes"] = stats.budget_bytes;
  d["slabs"] = stats.slabs;
  return d;
}

// A Python-side block: the value plus a reference that keeps its tier alive.
struct PyBlock {
  TierPtr tier;
  Block block;
};

const Block& Unwrap(const PyBlock& block, const TierPtr& tier, const char* what) {
  if (block.tier.get() != tier.get()) {
    throw py::value_error(std::string(what) + ": block " + std::to_string(block.block.id) +
                          " belongs to tier '" + block.tier->name() + "', not '" + tier->name() +
                          "'");
  }
  return block.block;
}

at::Tensor BlockTensor(const TierPtr& tier, const PyBlock& py_block, at::ScalarType dtype,
                       int64_t numel) {
  const Block& block = Unwrap(py_block, tier, "tensor");
  const int64_t element_size = c10::elementSize(dtype);
  const int64_t capacity = block.bytes / element_size;
  if (numel < 0) numel = capacity;
  if (numel > capacity) {
    throw py::value_error("tensor: " + std::to_string(numel) + " elements of " +
                          std::to_string(element_size) + " bytes do not fit block " +
                          std::to_string(block.id) + " of " + std::to_string(block.bytes) +
                          " bytes");
  }
  at::Device device(at::kCPU);
  switch (tier->address_space()) {
    case AddressSpace::kHostMemory:
      break;
    case AddressSpace::kDeviceMemory:
      device = at::Device(at::kCUDA);
      break;
    case AddressSpace::kFile:
      throw py::value_error("tensor: blocks of NVMe tier '" + tier->name() +
                            "' are not addressable; copy them to a memory tier first");
  }
  void* data = block.data();
  if (device.is_cuda() && gpu::StrictDevice()) {  // Note [Torch views of device memory]
    data = gpu::WorkPointer(data);
    device = at::Device(at::kCPU);
  }
  ThrowIfError(tier->Pin(block));
  TierPtr keep_alive = tier;
  return torch::from_blob(
      data, {numel}, [keep_alive, block](void*) { keep_alive->Unpin(block); },
      at::TensorOptions().dtype(dtype).device(device));
}

// Note [Fault injection]: an explicit spec wins; None reads PATRICKSTAR_FAULT_INJECT.
std::shared_ptr<FaultInjector> FaultsFrom(const std::optional<std::string>& spec) {
  std::string text;
  if (spec.has_value()) {
    text = *spec;
  } else if (const char* env = std::getenv("PATRICKSTAR_FAULT_INJECT"); env != nullptr) {
    text = env;
    // A test hook acting in a real run must not go unnoticed: say so each time it arms.
    if (!text.empty()) {
      PS_LOG(kWarning,
             "PATRICKSTAR_FAULT_INJECT=%s is set: copies and NVMe IO will fail on purpose (a "
             "test hook); unset it unless you are testing fault handling",
             text);
    }
  }
  return ValueOrThrow(FaultInjector::Parse(text));
}

}  // namespace

void InitRuntime(py::module_& module) {
  module.def(
      "cuda_available", [] { return gpu::DeviceCount() > 0; },
      "True when this build has CUDA and a GPU is usable.");
  module.def(
      "strict_device", [] { return gpu::StrictDevice(); },
      "True when the strict emulated device stands in for CUDA (PATRICKSTAR_STRICT_DEVICE=1): "
      "Note [Strict device] in runtime/strict_device.h.");
  module.def(
      "strict_device_set_kernel_delay",
      [](double microseconds) {
        if (!gpu::StrictDevice()) throw py::value_error("the strict device is off");
        gpu::strict::SetKernelDelay(absl::Microseconds(microseconds));
      },
      py::arg("microseconds"),
      "How long each kernel waits on its strict-device stream before it runs (tests).");
  module.def("build_info", [] {
    py::dict info;
    info["with_cuda"] = gpu::CompiledWithCuda();
    info["cuda_runtime"] = gpu::RuntimeVersion();
    info["device_count"] = gpu::DeviceCount();
    info["cuda_unavailable_reason"] = gpu::UnavailableReason();
    info["strict_device"] = gpu::StrictDevice();
    info["torch_version"] = TORCH_VERSION;
    return info;
  });
  module.def(
      "set_log_level",
      [](const std::string& level) {
        LogLevel parsed;
        if (!ParseLogLevel(level, &parsed)) {
          throw py::value_error("unknown log level '" + level +
                                "': expected debug, info, warning or error");
        }
        SetLogLevel(parsed);
      },
      py::arg("level"));

  py::class_<PyBlock>(module, "Block", "A block of a tier (free it with tier.free(block)).")
      .def_property_readonly("id", [](const PyBlock& b) { return b.block.id; })
      .def_property_readonly("nbytes", [](const PyBlock& b) { return b.block.bytes; })
      .def_property_readonly("address", [](const PyBlock& b) { return b.block.address; })
      .def_property_readonly("tier_name", [](const PyBlock& b) { return b.tier->name(); })
      .def("__repr__", [](const PyBlock& b) {
        return "Block(id=" + std::to_string(b.block.id) +
               ", nbytes=" + std::to_string(b.block.bytes) + ", tier='" + b.tier->name() + "')";
      });

  py::class_<Tier, TierPtr>(module, "Tier", "A memory tier with a budget and a slab pool.")
      .def_property_readonly("name", [](const Tier& t) { return t.name(); })
      .def_property_readonly("kind",
                             [](const Tier& t) { return std::string(TierKindName(t.kind())); })
      .def_property("budget", &Tier::budget_bytes,
                    [](Tier& t, int64_t budget) { ThrowIfError(t.SetBudget(budget)); })
      .def(
          "allocate",
          [](const TierPtr& tier, int64_t nbytes) {
            return PyBlock{tier, ValueOrThrow(tier->Allocate(nbytes))};
          },
          py::arg("nbytes"), "A block of at least nbytes (rounded up to 4096).")
      .def(
          "free",
          [](const TierPtr& tier, const PyBlock& block) {
            ThrowIfError(tier->Free(Unwrap(block, tier, "free")));
          },
          py::arg("block"))
      .def("trim", &Tier::Trim, "Returns fully free slabs to the backing store; returns bytes.")
      .def("stats", [](const Tier& t) { return StatsToDict(t.stats()); })
      .def("reset_peak_stats", &Tier::ResetPeakStats)
      .def(
          "is_valid",
          [](const TierPtr& tier, const PyBlock& block) {
            return ValueOrThrow(tier->IsValid(Unwrap(block, tier, "is_valid")));
          },
          py::arg("block"))
      .def(
          "pin_count",
          [](const TierPtr& tier, const PyBlock& block) {
            return ValueOrThrow(tier->PinCount(Unwrap(block, tier, "pin_count")));
          },
          py::arg("block"))
      .def("tensor", &BlockTensor, py::arg("block"), py::arg("dtype"), py::arg("numel") = -1,
           "A 1-D tensor viewing the block's memory; the block stays pinned while it lives.")
      .def("__repr__", &Tier::DebugString);

  py::class_<HostTier, Tier, std::shared_ptr<HostTier>>(module, "HostTier")
      .def(py::init([](int64_t budget, bool pinned, const std::string& name, int64_t slab_bytes) {
             HostTierOptions options;
             options.tier = Tier::Options{name, budget, slab_bytes};
             options.pinned = pinned;
             return std::make_shared<HostTier>(options);
           }),
           py::arg("budget") = 0, py::arg("pinned") = false, py::arg("name") = "host",
           py::arg("slab_bytes") = 64ll << 20)
      .def_property_readonly("pinned", &HostTier::pinned);

  py::class_<EmulatedDeviceTier, Tier, std::shared_ptr<EmulatedDeviceTier>>(module,
                                                                            "EmulatedDeviceTier")
      .def(py::init([](int64_t budget, const std::string& name, int64_t slab_bytes) {
             return std::make_shared<EmulatedDeviceTier>(
                 EmulatedDeviceTierOptions{Tier::Options{name, budget, slab_bytes}});
           }),
           py::arg("budget") = 0, py::arg("name") = "emulated-device",
           py::arg("slab_bytes") = 64ll << 20);

  py::class_<NvmeTier, Tier, std::shared_ptr<NvmeTier>>(module, "NvmeTier")
      .def(py::init([](const std::string& path, int64_t budget, int queue_depth, int64_t block_size,
                       bool use_io_uring, bool use_direct_io, const std::string& name,
                       int64_t slab_bytes, const std::optional<std::string>& fault_inject,
                       bool verify) {
             NvmeTierOptions options;
             options.tier = Tier::Options{name, budget, slab_bytes};
             options.directory = path;
             options.queue_depth = queue_depth;
             options.io_block_bytes = block_size;
             options.use_io_uring = use_io_uring;
             options.use_direct_io = use_direct_io;
             options.verify_checksums = verify;
             if (std::shared_ptr<FaultInjector> faults = FaultsFrom(fault_inject)) {
               options.fault_injector = NvmeFaultHook(std::move(faults));
             }
             return std::shared_ptr<NvmeTier>(ValueOrThrow(NvmeTier::Create(std::move(options))));
           }),
           py::arg("path"), py::arg("budget") = 0, py::arg("queue_depth") = 32,
           py::arg("block_size") = 1 << 20, py::arg("use_io_uring") = true,
           py::arg("use_direct_io") = true, py::arg("name") = "nvme",
           py::arg("slab_bytes") = 64ll << 20, py::arg("fault_inject") = py::none(),
           py::arg("verify") = true,
           "fault_inject: tests only (Note [Fault injection]); None reads "
           "PATRICKSTAR_FAULT_INJECT. verify: checksums of every write checked on its reads "
           "(Note [NVMe checksums])")
      .def_property_readonly("path", [](const NvmeTier& t) { return t.path(); })
      .def_property_readonly("direct_io", &NvmeTier::direct_io)
      .def_property_readonly("uses_io_uring", &NvmeTier::uses_io_uring)
      .def_property_readonly("fallback_note", [](const NvmeTier& t) { return t.fallback_note(); })
      .def_property_readonly("file_bytes", &NvmeTier::file_bytes)
      .def_property_readonly("verified_reads", &NvmeTier::verified_reads);

  module.def(
      "DeviceTier",
      [](int device, int64_t budget, const std::string& name, int64_t slab_bytes) {
        DeviceTierOptions options;
        options.device = device;
        options.tier = Tier::Options{name, budget, slab_bytes};
        return TierPtr(ValueOrThrow(CreateDeviceTier(std::move(options))));
      },
      py::arg("device") = 0, py::arg("budget") = 0, py::arg("name") = "",
      py::arg("slab_bytes") = 64ll << 20,
      "The CUDA device tier; RuntimeError without a CUDA build or a GPU.");

  py::class_<CopyHandle>(module, "CopyHandle")
      .def(
          "wait",
          [](const CopyHandle& handle) {
            absl::Status status;
            {
              py::gil_scoped_release release;
              status = handle.Wait();
            }
            ThrowIfError(status);
          },
          "Blocks until the copy finished; raises its error.")
      .def("done", &CopyHandle::Done);

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(module, "CopyEngine")
      .def(py::init([](int host_threads, int device,
                       const std::optional<std::string>& fault_inject) {
             return std::make_shared<CopyEngine>(
                 CopyEngine::Options{host_threads, device, FaultsFrom(fault_inject)});
           }),
           py::arg("host_threads") = 2, py::arg("device") = 0,
           py::arg("fault_inject") = py::none(),
           "fault_inject: tests only (Note [Fault injection]); None reads "
           "PATRICKSTAR_FAULT_INJECT")
      .def_property_readonly(
          "faults_injected",
          [](const CopyEngine& engine) {
            return engine.options().faults ? engine.options().faults->injected() : 0;
          },
          "Copies failed by fault injection so far.")
      .def(
          "copy",
          [](CopyEngine& engine, const PyBlock& src, const PyBlock& dst) {
            return ValueOrThrow(engine.Copy(src.block, dst.block));
          },
          py::arg("src"), py::arg("dst"), "Starts an asynchronous copy; returns a CopyHandle.")
      .def(
          "copy_and_wait",
          [](CopyEngine& engine, const PyBlock& src, const PyBlock& dst) {
            absl::Status status;
            {
              py::gil_scoped_release release;
              status = engine.CopyAndWait(src.block, dst.block);
            }
            ThrowIfError(status);
          },
          py::arg("src"), py::arg("dst"))
      .def("wait_all", [](CopyEngine& engine) {
        py::gil_scoped_release release;
        engine.WaitAll();
      });
}

}  // namespace ps::bindings
