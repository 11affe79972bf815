// patrickstar._C.ParameterSlots: the engine's per-module hot path (python/patrickstar/engine.py).
//
// Note [Parameter slots]
// Before a module runs, the engine accesses each parameter it owns and points the parameter's
// .data at the chunk view; after, it releases them and points .data at an empty placeholder. A
// parameter used by several modules (tied weights, a module called twice) is accessed once per
// use and released when its last user is done, so each slot keeps an access count: the chunk
// tensor is accessed on 0 -> 1 and released on 1 -> 0. Done per parameter in Python this cost
// three binding calls, a dict and a view per access; a small GPT's step spent more time here
// than in its optimizer. Here one call covers a module. The slots also know which chunk
// addresses are parameter views right now (SavedIndex), so that autograd's saved tensors of a
// parameter are re-created from the chunk in backward instead of pinning a view of memory that
// may have moved (Note [Saved views of parameters] in saved_views.py).
//
// Errors leave the counts consistent: a count rises only once its access succeeded, so a failed
// access (a budget that cannot hold the chunk) leaves nothing to release.
//
// Note [Writes to a released parameter]
// Between uses a parameter's .data is the empty placeholder, so a write the user makes then
// (nn.init.normal_(p), p.mul_() under no_grad, p.data = t) lands in the placeholder, and the
// next access would point .data at the chunk as if nothing happened: the change lost without a
// word. Torch bumps a tensor's version counter on every in-place write, and set_data keeps the
// parameter's own counter, so each released slot remembers its version and whether .data is
// still the placeholder; an access (or CheckUnchanged, for the reads of state_dict) that finds
// either changed raises, naming the parameter, before it changes any count. It reports each
// change once: the slot is reset to the placeholder, the chunk keeps the old values. Writes
// through p.data.normal_() go to a fresh alias with its own counter and are not seen (they
// write zero elements).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "bindings/chunk_views.h"
#include "bindings/init.h"
#include "bindings/py_chunk_manager.h"
#include "bindings/status_exceptions.h"
#include "chunk/chunk_manager.h"
#include "chunk/tensor_state.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

class ParameterSlots {
 public:
  ParameterSlots(py::object manager, std::vector<at::Tensor> params,
                 std::vector<TensorId> compute_ids, std::vector<std::optional<TensorId>> grad_ids,
                 const std::string& tier, at::Tensor placeholder, std::vector<std::string> names)
      : manager_object_(std::move(manager)),
        manager_(manager_object_.cast<PyChunkManager*>()),
        params_(std::move(params)),
        compute_ids_(std::move(compute_ids)),
        grad_ids_(std::move(grad_ids)),
        tier_(ParseTierKind(tier)),
        placeholder_(std::move(placeholder)),
        names_(std::move(names)),
        counts_(params_.size(), 0),
        addresses_(params_.size(), 0) {
    if (compute_ids_.size() != params_.size() || grad_ids_.size() != params_.size() ||
        (!names_.empty() && names_.size() != params_.size())) {
      throw py::value_error("ParameterSlots: " + std::to_string(params_.size()) +
                            " parameters but " + std::to_string(compute_ids_.size()) +
                            " compute ids, " + std::to_string(grad_ids_.size()) +
                            " grad ids and " + std::to_string(names_.size()) + " names");
    }
    released_versions_.reserve(params_.size());
    for (size_t index = 0; index < params_.size(); ++index) {
      params_[index].set_data(placeholder_);
      released_versions_.push_back(params_[index]._version());
    }
  }

  // Called with each tensor id before it is accessed (data parallelism gathers remote groups).
  void set_before_access(py::object callback) { before_access_ = std::move(callback); }

  void Access(const std::vector<int64_t>& indices) {
    CheckUnchanged(indices);
    for (int64_t index : indices) {
      if (counts_[index] > 0) {
        counts_[index] += 1;
        continue;
      }
      const TensorId id = compute_ids_[index];
      NotifyBeforeAccess(id);
      const TensorView view =
          ValueOrThrow(manager_->Run([&](ChunkManager& m) { return m.Access(id, tier_); }));
      const at::Tensor tensor = TorchView(view);
      on_device_ = on_device_ || view.address_space == AddressSpace::kDeviceMemory;
      params_[index].set_data(tensor);
      counts_[index] = 1;
      // The address torch sees (Note [Torch views of device memory]), which SavedIndex compares.
      const auto address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(tensor.data_ptr()));
      addresses_[index] = view.numel > 0 ? address : 0;
      if (view.numel > 0) index_of_address_[address] = index;
    }
  }

  void Release(const std::vector<int64_t>& indices, TensorState state) {
    bool ordered = false;
    for (int64_t index : indices) {
      CheckIndex(index);
      if (counts_[index] == 0) continue;  // never accessed, or released by ReleaseAll
      if (--counts_[index] > 0) continue;
      if (!ordered) ordered = OrderCopiesAfterCompute();
      ReleaseSlot(index, state);
    }
  }

  // Releases every accessed parameter whatever its count (end of forward without backward, end of
  // backward). Visits all slots even when one fails; raises the first error.
  void ReleaseAll(TensorState state) {
    std::exception_ptr first_error;
    bool ordered = false;
    for (size_t index = 0; index < counts_.size(); ++index) {
      if (counts_[index] == 0) continue;
      counts_[index] = 0;
      if (!ordered) ordered = OrderCopiesAfterCompute();
      try {
        ReleaseSlot(static_cast<int64_t>(index), state);
      } catch (...) {
        if (first_error == nullptr) first_error = std::current_exception();
      }
    }
    if (first_error != nullptr) std::rethrow_exception(first_error);
  }

  // Raises if a released parameter among `indices` was written or reassigned since its release
  // (Note [Writes to a released parameter]).
  void CheckUnchanged(const std::vector<int64_t>& indices) {
    for (int64_t index : indices) {
      CheckIndex(index);
      if (counts_[index] > 0 || !ChangedWhileReleased(index)) continue;
      const bool reassigned = !SharesPlaceholder(index);
      const std::string converted = reassigned ? ConversionOf(params_[index]) : "";
      ResetToPlaceholder(index);  // reported once; the chunk keeps the values it had
      if (!converted.empty()) {
        throw std::runtime_error(
            "parameter " + Name(index) + " was " + converted +
            " on the module (module.half() / .bfloat16() / .double() / .to(...) / .cuda()), "
            "which converts each parameter's data: between uses that is an empty placeholder, "
            "and the values live in chunks, so nothing was converted. The training precision "
            "is the config's ('bf16': {'enabled': true} or 'fp16': {...}; fp32 by default) and "
            "the engine places the chunks on its device itself; for a converted copy of the "
            "weights, convert model.state_dict() or a copy.deepcopy(model.module)");
      }
      throw std::runtime_error(
          "parameter " + Name(index) + " was " +
          (reassigned ? "assigned new data (p.data = ...)"
                      : "written in place (nn.init.*_(p), p.mul_() / p.copy_() under no_grad)") +
          " while it was not in use: between uses a PatrickStar parameter holds an empty "
          "placeholder and its values live in chunks, so the change was not applied (the chunk "
          "keeps the old values). Change weights inside `with model.summon_full_params():`, "
          "with model.apply(fn) on the engine, model.load_state_dict(...), or inside "
          "model_func before initialize() returns");
    }
  }

  // Waits until the gradient stores queued on the compute stream have run (Note [Gradient stores
  // on the compute stream]): before gradient chunks are freed without anything having read
  // them (optimizer.zero_grad() with no step), whose device blocks a queued store still uses.
  void WaitForGradientStores() {
    if (!on_device_) return;
    const gpu::Stream compute = ComputeStream(Device());
    py::gil_scoped_release release;
    ThrowIfError(gpu::SynchronizeStream(compute));
  }

  // Points a released parameter's .data back at the placeholder (after the engine lent it a full
  // copy of its values, model.apply).
  void RestorePlaceholder(int64_t index) {
    CheckIndex(index);
    if (counts_[index] > 0) {
      throw py::value_error("RestorePlaceholder: parameter " + Name(index) + " is in use");
    }
    ResetToPlaceholder(index);
  }

  int64_t AccessCount(int64_t index) const {
    CheckIndex(index);
    return counts_[index];
  }

  // The index of the parameter whose chunk view `tensor` shares storage with, or -1.
  int64_t SavedIndex(const at::Tensor& tensor) const {
    // The device type suffices: chunk views of one engine live on one device, and a host and a
    // device address never coincide (CUDA's unified addressing).
    if (index_of_address_.empty() || !tensor.defined() || tensor.layout() != at::kStrided ||
        !tensor.has_storage() || tensor.device().type() != placeholder_.device().type()) {
      return -1;
    }
    const auto address = reinterpret_cast<uintptr_t>(tensor.storage().data());
    const auto found = index_of_address_.find(static_cast<uint64_t>(address));
    return found == index_of_address_.end() ? -1 : found->second;
  }

  // Writes (or with `accumulate`, adds) a gradient autograd made into the parameter's gradient
  // chunk tensor.
  void StoreGrad(int64_t index, const at::Tensor& grad, bool accumulate) {
    CheckIndex(index);
    if (!grad_ids_[index].has_value()) {
      throw py::value_error("parameter " + std::to_string(index) +
                            " has no gradient tensor (requires_grad=False at initialize)");
    }
    const TensorId id = *grad_ids_[index];
    NotifyBeforeAccess(id);
    const TensorView chunk_view =
        ValueOrThrow(manager_->Run([&](ChunkManager& m) { return m.Access(id, tier_); }));
    try {
      if (!grad.sizes().equals(at::IntArrayRef(chunk_view.shape))) {
        throw py::value_error("gradient of parameter " + std::to_string(index) + " has shape " +
                              c10::str(grad.sizes()) + ", the parameter " +
                              c10::str(at::IntArrayRef(chunk_view.shape)));
      }
      if (chunk_view.address_space == AddressSpace::kDeviceMemory) {
        StoreOnComputeStream(chunk_view, grad, accumulate);
      } else {
        StoreWithTorch(TorchView(chunk_view), grad, accumulate);
      }
    } catch (...) {
      // The gradient chunk keeps what it had; the caller's error is the one that matters.
      (void)manager_->Run([&](ChunkManager& m) { return m.Release(id, TensorState::kHold); });
      throw;
    }
    ThrowIfError(manager_->Run([&](ChunkManager& m) { return m.Release(id, TensorState::kHold); }));
  }

 private:
  static void StoreWithTorch(at::Tensor view, const at::Tensor& grad, bool accumulate) {
    at::NoGradGuard no_grad;
    if (accumulate) {
      view.add_(grad.to(view.scalar_type()));
    } else if (view.device().is_cpu() && grad.device().is_cpu() &&
               grad.scalar_type() == view.scalar_type() && grad.is_contiguous()) {
      CopyOnCallingThread(grad, view);  // Note [Gradient copies on the calling thread]
    } else {
      view.copy_(grad);
    }
  }

  // Note [Gradient stores on the compute stream] in chunk_views.h. Also before a parameter is
  // released on the device: a kernel still queued on the compute stream may read it when the
  // block is evicted, dropped and reused by an upload. Returns whether it ordered anything.
  bool OrderCopiesAfterCompute() {
    if (!on_device_) return false;
    CopyEngine* copies = manager_->Run([](ChunkManager& m) { return &m.copy_engine(); });
    const gpu::Stream compute = ComputeStream(copies->options().device);
    py::gil_scoped_release release;
    ThrowIfError(copies->OrderAfter(compute));
    return true;
  }

  void StoreOnComputeStream(const TensorView& chunk_view, const at::Tensor& grad, bool accumulate) {
    const gpu::Stream compute = ComputeStream(Device());
    void* data = reinterpret_cast<void*>(static_cast<uintptr_t>(chunk_view.address));
    if (gpu::StrictDevice()) {
      // torch is the CPU build here: the store is emulated device work, late, on the stand-in
      // for torch's current stream; `source` keeps the gradient alive until it ran (what
      // torch's caching allocator does for a kernel on the allocating stream).
      const at::Tensor source = grad.detach().contiguous();
      const std::vector<int64_t> shape = chunk_view.shape;
      const at::ScalarType dtype = ToScalarType(chunk_view.dtype);
      const int64_t bytes = chunk_view.numel * static_cast<int64_t>(c10::elementSize(dtype));
      ThrowIfError(gpu::strict::LaunchWork(
          compute, {{data, bytes}, {source.data_ptr(), static_cast<int64_t>(source.nbytes())}},
          [data, shape, dtype, source, accumulate] {
            at::Tensor view =
                torch::from_blob(gpu::WorkPointer(data), shape, at::TensorOptions().dtype(dtype));
            at::NoGradGuard no_grad;
            if (accumulate) {
              view.add_(source.to(dtype));
            } else {
              view.copy_(source);
            }
          }));
    } else {
      StoreWithTorch(TorchView(chunk_view), grad, accumulate);  // on torch's current stream
    }
    on_device_ = true;
    (void)OrderCopiesAfterCompute();
  }

  void CheckIndex(int64_t index) const {
    if (index < 0 || index >= static_cast<int64_t>(counts_.size())) {
      throw py::index_error("parameter index " + std::to_string(index) + " out of range [0, " +
                            std::to_string(counts_.size()) + ")");
    }
  }

  int Device() const {
    return manager_->Run([](ChunkManager& m) { return m.copy_engine().options().device; });
  }

  std::string Name(int64_t index) const {
    return names_.empty() ? std::to_string(index) : "'" + names_[index] + "'";
  }

  bool SharesPlaceholder(int64_t index) const {
    return params_[index].unsafeGetTensorImpl()->storage().unsafeGetStorageImpl() ==
           placeholder_.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl();
  }

  // What `module.half()`-style conversions leave (an empty tensor of another dtype or device in
  // place of the placeholder), in words; "" for any other reassignment.
  std::string ConversionOf(const at::Tensor& param) const {
    if (param.numel() != 0) return "";
    if (param.scalar_type() != placeholder_.scalar_type()) {
      return std::string("converted to ") + c10::toString(param.scalar_type());
    }
    if (param.device() != placeholder_.device()) return "moved to " + param.device().str();
    return "";
  }

  bool ChangedWhileReleased(int64_t index) const {
    return params_[index]._version() != released_versions_[index] || !SharesPlaceholder(index);
  }

  void ResetToPlaceholder(int64_t index) {
    params_[index].set_data(placeholder_);
    released_versions_[index] = params_[index]._version();
  }

  void NotifyBeforeAccess(TensorId id) {
    if (!before_access_.is_none()) before_access_(id);
  }

  void ReleaseSlot(int64_t index, TensorState state) {
    if (addresses_[index] != 0) index_of_address_.erase(addresses_[index]);
    addresses_[index] = 0;
    ResetToPlaceholder(index);
    const TensorId id = compute_ids_[index];
    ThrowIfError(manager_->Run([&](ChunkManager& m) { return m.Release(id, state); }));
  }

  py::object manager_object_;  // keeps the manager alive as long as the slots
  PyChunkManager* manager_;
  std::vector<at::Tensor> params_;  // the user's nn.Parameter objects (same TensorImpl)
  std::vector<TensorId> compute_ids_;
  std::vector<std::optional<TensorId>> grad_ids_;
  TierKind tier_;
  at::Tensor placeholder_;  // empty, the compute dtype and device: .data while released
  std::vector<std::string> names_;  // for errors; empty: parameters are named by index
  std::vector<int64_t> counts_;
  // Each parameter's version counter when it was last released (Note [Writes to a released
  // parameter]).
  std::vector<int64_t> released_versions_;
  std::vector<uint64_t> addresses_;  // each accessed parameter's view address (0: none)
  absl::flat_hash_map<uint64_t, int64_t> index_of_address_;  // chunk view address -> index
  py::object before_access_ = py::none();
  bool on_device_ = false;  // some chunk was accessed in device memory (ordering is needed)
};

}  // namespace

void InitParameterSlots(py::module_& module) {
  py::class_<ParameterSlots>(module, "ParameterSlots",
                             "The engine's parameters in their chunks: Note [Parameter slots].")
      .def(py::init<py::object, std::vector<at::Tensor>, std::vector<TensorId>,
                    std::vector<std::optional<TensorId>>, const std::string&, at::Tensor,
                    std::vector<std::string>>(),
           py::arg("manager"), py::arg("params"), py::arg("compute_ids"), py::arg("grad_ids"),
           py::arg("tier"), py::arg("placeholder"), py::arg("names") = std::vector<std::string>{})
      .def("set_before_access", &ParameterSlots::set_before_access, py::arg("callback"))
      .def("access", &ParameterSlots::Access, py::arg("indices"),
           "Accesses each parameter (counted) and points its .data at the chunk view.")
      .def("release", &ParameterSlots::Release, py::arg("indices"), py::arg("state"),
           "Drops one access of each; the last one releases the chunk tensor to `state`.")
      .def("release_all", &ParameterSlots::ReleaseAll, py::arg("state"))
      .def("check_unchanged", &ParameterSlots::CheckUnchanged, py::arg("indices"),
           "Raises if a released parameter was written or reassigned since its release.")
      .def("restore_placeholder", &ParameterSlots::RestorePlaceholder, py::arg("index"))
      .def("wait_for_gradient_stores", &ParameterSlots::WaitForGradientStores)
      .def("access_count", &ParameterSlots::AccessCount, py::arg("index"))
      .def("saved_index", &ParameterSlots::SavedIndex, py::arg("tensor"),
           "Index of the parameter whose chunk view the tensor is a view of, or -1.")
      .def("store_grad", &ParameterSlots::StoreGrad, py::arg("index"), py::arg("grad"),
           py::arg("accumulate"));
}

}  // namespace ps::bindings
