// Data-parallel collectives in Python: the c10d ProcessGroup back end of ps::Communicator (the
// core never sees torch, so it lives here), the factories of the direct NCCL and shared-memory
// back ends, and GroupCollectives over a ChunkManager.
//
// Note [c10d back end]
// The process group is looked up by its name in torch's registry (`group.group_name` in Python,
// c10d::resolve_process_group here), so no pybind11 type crosses between torch's extension and
// ours. Every collective runs on one worker thread in issue order (Note [Group collectives]) and
// waits for its c10d Work with the communicator's timeout, so a dead peer frees the thread with
// an error instead of holding it forever. gloo has no average: kAvg is a sum scaled by
// 1 / world_size. Reduce-scatter has three algorithms (`reduce_scatter=`): "native" (c10d's
// reduce_scatter: gloo runs it as a reduction of the whole group), "ring" (world_size - 1
// exchanges of one chunk with the neighbours over send/recv: each rank sends and receives
// (world_size - 1) chunks, half of what an all-reduce moves) and "allreduce" (all-reduce of the
// whole group, keep the own chunk). tools/bench/collectives.py measures them.
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bindings/init.h"
#include "bindings/py_chunk_manager.h"
#include "bindings/status_exceptions.h"
#include "bindings/torch_dtype.h"
#include "chunk/group_collectives.h"
#include "runtime/communicator.h"
#include "runtime/shm_communicator.h"
#include "runtime/status.h"
#include "runtime/thread_pool.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

enum class ReduceScatterAlgorithm { kNative, kRing, kAllReduce };

class ProcessGroupCommunicator : public Communicator {
 public:
  ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                           ReduceScatterAlgorithm algorithm, absl::Duration timeout)
      : group_(std::move(group)),
        algorithm_(algorithm),
        timeout_(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))),
        backend_(group_->getBackendName()),
        worker_(1, "ps-c10d") {}

  int rank() const override { return group_->getRank(); }
  int world_size() const override { return group_->getSize(); }
  std::string backend() const override { return backend_; }
  AddressSpace address_space() const override {
    return backend_ == "nccl" ? AddressSpace::kDeviceMemory : AddressSpace::kHostMemory;
  }

  CollectiveHandle AllGather(absl::Span<void* const> buffers, int64_t count, DType dtype,
                             std::string label) override {
    std::vector<void*> b(buffers.begin(), buffers.end());
    return Issue(CollectiveType::kAllGather, b, count, dtype, 0, std::move(label), [=, this] {
      std::vector<at::Tensor> input{Input(b[rank()], count, dtype)};
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int r = 0; r < world_size(); ++r) {
        // Our own slot gets a scratch tensor: c10d copies the input there.
        outputs[0].push_back(r == rank() ? Scratch(count, dtype) : Output(b[r], count, dtype));
      }
      Wait(group_->allgather(outputs, input));
    });
  }

  CollectiveHandle ReduceScatter(absl::Span<void* const> buffers, int64_t count, DType dtype,
                                 ReduceOp op, std::string label) override {
    std::vector<void*> b(buffers.begin(), buffers.end());
    return Issue(CollectiveType::kReduceScatter, b, count, dtype, 0, std::move(label), [=, this] {
      const int world = world_size();
      const int me = rank();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world; ++r) parts.push_back(Input(b[r], count, dtype));
      at::Tensor result;
      switch (algorithm_) {
        case ReduceScatterAlgorithm::kNative: {
          std::vector<at::Tensor> output{Scratch(count, dtype)};
          std::vector<std::vector<at::Tensor>> inputs{parts};
          Wait(group_->reduce_scatter(output, inputs));
          result = output[0];
          break;
        }
        case ReduceScatterAlgorithm::kAllReduce: {
          std::vector<at::Tensor> flat{at::cat(parts)};
          Wait(group_->allreduce(flat));
          result = flat[0].narrow(0, me * count, count);
          break;
        }
        case ReduceScatterAlgorithm::kRing: {
          // Step s: send segment (me - s - 1) to the next rank, receive segment (me - s - 2)
          // from the previous one and add it to ours; after world - 1 steps segment `me` holds
          // every rank's contribution. Segments other than ours are partial sums afterwards
          // (allowed by Note [Group collectives]); null ones got a scratch in Input().
          at::Tensor incoming = Scratch(count, dtype);
          const int next = (me + 1) % world;
          const int previous = (me + world - 1) % world;
          for (int s = 0; s + 1 < world; ++s) {
            std::vector<at::Tensor> send{parts[((me - s - 1) % world + world) % world]};
            std::vector<at::Tensor> recv{incoming};
            auto sent = group_->send(send, next, /*tag=*/0);
            auto received = group_->recv(recv, previous, /*tag=*/0);
            Wait(received);
            Wait(sent);
            parts[((me - s - 2) % world + 2 * world) % world].add_(incoming);
          }
          result = parts[me];
          break;
        }
      }
      if (op == ReduceOp::kAvg) result.div_(world);
      if (b[me] != nullptr && result.data_ptr() != b[me]) Output(b[me], count, dtype).copy_(result);
    });
  }

  CollectiveHandle AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                             std::string label) override {
    return Issue(CollectiveType::kAllReduce, {buffer}, count, dtype, 0, std::move(label),
                 [=, this] {
                   std::vector<at::Tensor> tensors{Output(buffer, count, dtype)};
                   Wait(group_->allreduce(tensors));
                   if (op == ReduceOp::kAvg) tensors[0].div_(world_size());
                 });
  }

  CollectiveHandle Broadcast(void* buffer, int64_t count, DType dtype, int root,
                             std::string label) override {
    return Issue(CollectiveType::kBroadcast, {buffer}, count, dtype, root, std::move(label),
                 [=, this] {
                   std::vector<at::Tensor> tensors{root == rank() ? Input(buffer, count, dtype)
                                                                  : Output(buffer, count, dtype)};
                   c10d::BroadcastOptions options;
                   options.rootRank = root;
                   Wait(group_->broadcast(tensors, options));
                 });
  }

  CollectiveHandle Reduce(void* buffer, int64_t count, DType dtype, ReduceOp op, int root,
                          std::string label) override {
    return Issue(CollectiveType::kReduce, {buffer}, count, dtype, root, std::move(label),
                 [=, this] {
                   std::vector<at::Tensor> tensors{Input(buffer, count, dtype)};
                   c10d::ReduceOptions options;
                   options.rootRank = root;
                   Wait(group_->reduce(tensors, options));
                   if (root == rank() && op == ReduceOp::kAvg) tensors[0].div_(world_size());
                 });
  }

 private:
  template <typename F>
  CollectiveHandle Issue(CollectiveType type, std::vector<void*> buffers, int64_t count,
                         DType dtype, int root, std::string label, F&& body) {
    CollectiveDescription description{
        type, static_cast<int64_t>(buffers.size()), count, dtype, std::move(label), backend_};
    const bool group = type == CollectiveType::kAllGather || type == CollectiveType::kReduceScatter;
    // Null single buffers are allowed (Note [Group collectives]); Input/Output give scratch.
    std::vector<void*> checked = buffers;
    if (!group && checked[0] == nullptr) checked[0] = this;
    absl::Status valid = ValidateCollective(*this, type, checked, count, root);
    if (!valid.ok()) return CollectiveHandle::Failed(std::move(description), valid);
    auto state = std::make_shared<CollectiveState>(std::move(description));
    worker_.Schedule([state, body = std::forward<F>(body)]() mutable {
      try {
        body();
        state->Finish(absl::OkStatus());
      } catch (const std::exception& error) {
        const std::string what = error.what();
        const bool timed_out =
            what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
        state->Finish(timed_out ? absl::DeadlineExceededError(what) : absl::UnavailableError(what));
      }
    });
    return CollectiveHandle(state);
  }

  at::TensorOptions Options(DType dtype) const {
    return at::TensorOptions()
        .dtype(ToScalarType(dtype))
        .device(address_space() == AddressSpace::kDeviceMemory ? at::Device(at::kCUDA)
                                                               : at::Device(at::kCPU));
  }
  at::Tensor Scratch(int64_t count, DType dtype) const {
    return at::empty({count}, Options(dtype));
  }
  // A buffer read by the collective: zeros when null.
  at::Tensor Input(void* data, int64_t count, DType dtype) const {
    return data == nullptr ? at::zeros({count}, Options(dtype))
                           : torch::from_blob(data, {count}, Options(dtype));
  }
  // A buffer written by the collective: a discarded scratch when null.
  at::Tensor Output(void* data, int64_t count, DType dtype) const {
    return data == nullptr ? Scratch(count, dtype)
                           : torch::from_blob(data, {count}, Options(dtype));
  }
  void Wait(const c10::intrusive_ptr<c10d::Work>& work) const { work->wait(timeout_); }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  const ReduceScatterAlgorithm algorithm_;
  const std::chrono::milliseconds timeout_;
  const std::string backend_;
  ThreadPool worker_;  // last: joined first, while the rest is alive
};

ReduceOp ParseReduceOp(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg") return ReduceOp::kAvg;
  throw py::value_error("reduce op must be 'sum' or 'avg', got '" + name + "'");
}

TierKind ParseCollectiveTier(const std::string& name) {
  const std::optional<TierKind> kind = TierKindFromName(name);
  if (kind == TierKind::kDevice || kind == TierKind::kHost) return *kind;
  throw py::value_error("collective tier must be 'device' or 'host', got '" + name + "'");
}

absl::Duration Seconds(double seconds) {
  if (!(seconds > 0)) throw py::value_error("timeout must be positive seconds");
  return absl::Seconds(seconds);
}

// The buffer of an optional tensor, checked against the others' size and dtype.
void* BufferOf(const py::handle& item, int64_t* count, std::optional<DType>* dtype,
               const Communicator& communicator, const char* what) {
  if (item.is_none()) return nullptr;
  at::Tensor tensor = item.cast<at::Tensor>();
  if (!tensor.is_contiguous()) {
    throw py::value_error(std::string(what) + ": tensors must be contiguous");
  }
  const bool on_device = tensor.is_cuda();
  if (on_device != (communicator.address_space() == AddressSpace::kDeviceMemory)) {
    throw py::value_error(std::string(what) + ": the " + communicator.backend() +
                          " communicator needs " + (on_device ? "CPU" : "CUDA") + " tensors");
  }
  const DType type = DTypeFromTorch(tensor.scalar_type());
  if (*count >= 0 && tensor.numel() != *count) {
    throw py::value_error(absl::StrCat(what, ": tensors of ", *count, " and ", tensor.numel(),
                                       " elements; a group's buffers must have equal sizes"));
  }
  if (dtype->has_value() && **dtype != type) {
    throw py::value_error(std::string(what) + ": tensors of different dtypes");
  }
  *count = tensor.numel();
  *dtype = type;
  return tensor.data_ptr();
}

struct Buffers {
  std::vector<void*> pointers;
  int64_t count = -1;
  DType dtype = DType::kFloat32;
};

Buffers BuffersOf(const py::sequence& tensors, const Communicator& communicator, const char* what) {
  Buffers result;
  std::optional<DType> dtype;
  for (const py::handle& item : tensors) {
    result.pointers.push_back(BufferOf(item, &result.count, &dtype, communicator, what));
  }
  if (!dtype.has_value()) throw py::value_error(std::string(what) + ": every tensor is None");
  result.dtype = *dtype;
  return result;
}

// GroupCollectives bound to the manager it drives; calls take the manager's lock.
//
// Note [Closing the collectives before the manager]
// GroupCollectives pins chunks and lets the communicator write into their buffers, through a
// raw pointer to the ChunkManager. The Python object can outlive the engine: a traceback of a
// failed collective holds the frames that hold it, and is freed at interpreter exit, after
// engine.destroy() closed the manager; its destructor then unpinned chunks of a freed manager
// (a segfault at exit after a collective timeout). So close() destroys it now, under the
// manager's lock, and DataParallel.close() calls it before the manager closes; later calls
// raise. Should the manager be closed first anyway, the GroupCollectives is leaked rather than
// allowed to touch freed memory.
struct PyGroupCollectives {
  PyChunkManager* manager;  // kept alive by py::keep_alive
  std::shared_ptr<Communicator> communicator;
  std::unique_ptr<GroupCollectives> collectives;

  PyGroupCollectives() = default;
  PyGroupCollectives(const PyGroupCollectives&) = delete;
  PyGroupCollectives& operator=(const PyGroupCollectives&) = delete;
  ~PyGroupCollectives() { Close(); }

  template <typename F>
  auto Run(F&& f) {
    return manager->Run([&](ChunkManager&) {
      if (collectives == nullptr) {
        throw std::runtime_error("these chunk-group collectives were closed (model.destroy())");
      }
      return f(*collectives);
    });
  }

  void Close() {
    if (collectives == nullptr) return;
    if (!manager->RunIfOpen([&](ChunkManager&) { collectives.reset(); })) {
      static_cast<void>(collectives.release());  // Note [Closing the collectives ...]
    }
  }
};

}  // namespace

void InitComm(py::module_& module) {
  py::enum_<ReduceOp>(module, "ReduceOp").value("SUM", ReduceOp::kSum).value("AVG", ReduceOp::kAvg);

  py::class_<CollectiveHandle>(module, "CollectiveHandle")
      .def(
          "wait",
          [](const CollectiveHandle& handle, double timeout_s) {
            const absl::Duration timeout = Seconds(timeout_s);
            absl::Status status;
            {
              py::gil_scoped_release release;
              status = handle.Wait(timeout);
            }
            ThrowIfError(status);
          },
          py::arg("timeout_s"),
          "Waits for the collective; TimeoutError naming it when it does not finish in time.")
      .def_property_readonly("done", &CollectiveHandle::done)
      .def("__repr__", &CollectiveHandle::ToString);

  py::class_<Communicator, std::shared_ptr<Communicator>>(
      module, "Communicator",
      "Collectives on chunk groups (runtime/communicator.h); buffers are torch tensors of one "
      "size and dtype, None where a rank has none (zeros in, discarded out). Every call is "
      "queued and returns a CollectiveHandle; the tensors must stay alive until it is done.")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("backend", &Communicator::backend)
      .def(
          "all_gather",
          [](Communicator& self, const py::sequence& tensors, const std::string& label) {
            Buffers b = BuffersOf(tensors, self, "all_gather");
            return self.AllGather(b.pointers, b.count, b.dtype, label);
          },
          py::arg("tensors"), py::arg("label") = "")
      .def(
          "reduce_scatter",
          [](Communicator& self, const py::sequence& tensors, const std::string& op,
             const std::string& label) {
            Buffers b = BuffersOf(tensors, self, "reduce_scatter");
            return self.ReduceScatter(b.pointers, b.count, b.dtype, ParseReduceOp(op), label);
          },
          py::arg("tensors"), py::arg("op") = "avg", py::arg("label") = "")
      .def(
          "all_reduce",
          [](Communicator& self, const py::object& tensor, const std::string& op,
             const std::string& label) {
            Buffers b = BuffersOf(py::make_tuple(tensor), self, "all_reduce");
            return self.AllReduce(b.pointers[0], b.count, b.dtype, ParseReduceOp(op), label);
          },
          py::arg("tensor"), py::arg("op") = "sum", py::arg("label") = "")
      .def(
          "broadcast",
          [](Communicator& self, const py::object& tensor, int root, const std::string& label) {
            Buffers b = BuffersOf(py::make_tuple(tensor), self, "broadcast");
            return self.Broadcast(b.pointers[0], b.count, b.dtype, root, label);
          },
          py::arg("tensor"), py::arg("root"), py::arg("label") = "")
      .def(
          "reduce",
          [](Communicator& self, const py::object& tensor, int root, const std::string& op,
             const std::string& label) {
            Buffers b = BuffersOf(py::make_tuple(tensor), self, "reduce");
            return self.Reduce(b.pointers[0], b.count, b.dtype, ParseReduceOp(op), root, label);
          },
          py::arg("tensor"), py::arg("root"), py::arg("op") = "sum", py::arg("label") = "");

  module.def(
      "process_group_communicator",
      [](const std::string& group_name, const std::string& reduce_scatter,
         double timeout_s) -> std::shared_ptr<Communicator> {
        ReduceScatterAlgorithm algorithm;
        if (reduce_scatter == "native") {
          algorithm = ReduceScatterAlgorithm::kNative;
        } else if (reduce_scatter == "ring") {
          algorithm = ReduceScatterAlgorithm::kRing;
        } else if (reduce_scatter == "allreduce") {
          algorithm = ReduceScatterAlgorithm::kAllReduce;
        } else {
          throw py::value_error("reduce_scatter must be 'native', 'ring' or 'allreduce', got '" +
                                reduce_scatter + "'");
        }
        c10::intrusive_ptr<c10d::ProcessGroup> group;
        try {
          group = c10d::resolve_process_group(group_name);
        } catch (const std::exception& error) {
          throw py::value_error("no torch.distributed process group named '" + group_name +
                                "': " + error.what());
        }
        return std::make_shared<ProcessGroupCommunicator>(std::move(group), algorithm,
                                                          Seconds(timeout_s));
      },
      py::arg("group_name"), py::arg("reduce_scatter") = "ring", py::arg("timeout_s") = 300.0,
      "A Communicator over the torch.distributed process group of that name "
      "(`group.group_name`): gloo on CPU, NCCL when torch has it (Note [c10d back end]).");

  module.def(
      "shm_communicator",
      [](const std::string& name, int rank, int world_size, double timeout_s,
         int64_t slot_bytes) -> std::shared_ptr<Communicator> {
        ShmCommunicatorOptions options;
        options.name = name;
        options.rank = rank;
        options.world_size = world_size;
        options.timeout = Seconds(timeout_s);
        options.slot_bytes = slot_bytes;
        absl::StatusOr<std::unique_ptr<Communicator>> made;
        {
          py::gil_scoped_release release;  // waits for every rank to attach
          made = CreateShmCommunicator(options);
        }
        return std::shared_ptr<Communicator>(ValueOrThrow(std::move(made)));
      },
      py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("timeout_s") = 300.0,
      py::arg("slot_bytes") = 4 << 20,
      "A Communicator for ranks on this host over a POSIX shared-memory segment "
      "(runtime/shm_communicator.h): `name` (\"/ps-...\") is made by rank 0 and shared, new for "
      "each communicator; returns once every rank attached, TimeoutError if one does not within "
      "`timeout_s`, which also bounds how long a collective waits for a peer.");

  module.def("nccl_available", &NcclAvailable, "Whether this build has the direct NCCL back end.");
  module.def(
      "nccl_unique_id", [] { return py::bytes(ValueOrThrow(NcclUniqueId())); },
      "A new ncclUniqueId (rank 0 makes it and shares it with the others).");
  module.def(
      "nccl_communicator",
      [](int rank, int world_size, int device, const py::bytes& unique_id) {
        std::shared_ptr<Communicator> communicator =
            ValueOrThrow(CreateNcclCommunicator(rank, world_size, device, std::string(unique_id)));
        return communicator;
      },
      py::arg("rank"), py::arg("world_size"), py::arg("device"), py::arg("unique_id"),
      "The direct NCCL back end (runtime/cuda/): its own stream, one ncclGroupStart/End per "
      "group call.");

  py::class_<PyGroupCollectives>(module, "GroupCollectives",
                                 "Collectives on whole chunk groups of a ChunkManager "
                                 "(chunk/group_collectives.h).")
      .def(py::init([](PyChunkManager& manager, std::shared_ptr<Communicator> communicator,
                       const std::string& tier, double timeout_s, bool memory_saving,
                       const std::string& gradient_op, bool gradients_in_place,
                       std::optional<std::string> compute_tier, bool started_in_compute_tier) {
             GroupCollectiveOptions options;
             options.tier = ParseCollectiveTier(tier);
             options.timeout = Seconds(timeout_s);
             options.memory_saving = memory_saving;
             options.gradient_op = ParseReduceOp(gradient_op);
             options.gradients_in_place = gradients_in_place;
             if (compute_tier) options.compute_tier = ParseCollectiveTier(*compute_tier);
             options.started_in_compute_tier = started_in_compute_tier;
             auto result = std::make_unique<PyGroupCollectives>();
             result->manager = &manager;
             result->communicator = communicator;
             result->collectives = ValueOrThrow(manager.Run([&](ChunkManager& m) {
               return GroupCollectives::Create(&m, communicator.get(), options);
             }));
             return result;
           }),
           py::arg("manager"), py::arg("communicator"), py::arg("tier") = "host",
           py::arg("timeout_s") = 300.0, py::arg("memory_saving") = false,
           py::arg("gradient_op") = "avg", py::arg("gradients_in_place") = false,
           py::arg("compute_tier") = py::none(), py::arg("started_in_compute_tier") = false,
           py::keep_alive<1, 2>())
      .def("close", &PyGroupCollectives::Close,
           "Waits for started gathers, unpins their chunks and lets go of the manager now; "
           "later calls raise (Note [Closing the collectives before the manager]).")
      .def(
          "groups",
          [](PyGroupCollectives& self, ChunkKind kind) {
            return self.Run([&](GroupCollectives& c) { return c.Groups(kind); });
          },
          py::arg("kind"))
      .def(
          "group_of",
          [](PyGroupCollectives& self, TensorId tensor) {
            return ValueOrThrow(self.Run([&](GroupCollectives& c) { return c.GroupOf(tensor); }));
          },
          py::arg("tensor"))
      .def(
          "gather",
          [](PyGroupCollectives& self, ChunkId group) {
            return ValueOrThrow(self.Run([&](GroupCollectives& c) { return c.Gather(group); }));
          },
          py::arg("group"))
      .def(
          "start_gather",
          [](PyGroupCollectives& self, ChunkId group) {
            return ValueOrThrow(
                self.Run([&](GroupCollectives& c) { return c.StartGather(group); }));
          },
          py::arg("group"),
          "Issues the group's gather and returns at once, the group pinned until the next "
          "gather() of it, finish_gathers() or release_all() (Note [Started gathers]).")
      .def("finish_gathers",
           [](PyGroupCollectives& self) {
             ThrowIfError(self.Run([](GroupCollectives& c) { return c.FinishGathers(); }));
           })
      .def_property_readonly(
          "pending_gathers",
          [](PyGroupCollectives& self) {
            return self.Run([](GroupCollectives& c) { return c.pending_gathers(); });
          })
      .def_property_readonly(
          "gathers_started",
          [](PyGroupCollectives& self) {
            return self.Run([](GroupCollectives& c) { return c.gathers_started(); });
          })
      .def_property_readonly(
          "gathers_declined",
          [](PyGroupCollectives& self) {
            return self.Run([](GroupCollectives& c) { return c.gathers_declined(); });
          })
      .def(
          "release_all",
          [](PyGroupCollectives& self, ChunkKind kind) {
            ThrowIfError(self.Run([&](GroupCollectives& c) { return c.ReleaseAll(kind); }));
          },
          py::arg("kind"))
      .def(
          "release",
          [](PyGroupCollectives& self, ChunkId group) {
            return ValueOrThrow(self.Run([&](GroupCollectives& c) { return c.Release(group); }));
          },
          py::arg("group"),
          "Releases one compute-param group (local, no collective); False while one of its "
          "tensors is in use (Note [Releasing one group]).")
      .def(
          "start_reduce_scatter",
          [](PyGroupCollectives& self, ChunkId group, std::optional<std::string> op) {
            std::optional<ReduceOp> reduce_op;
            if (op.has_value()) reduce_op = ParseReduceOp(*op);
            ThrowIfError(self.Run(
                [&](GroupCollectives& c) { return c.StartReduceScatter(group, reduce_op); }));
          },
          py::arg("group"), py::arg("op") = py::none(),
          "Starts the reduce-scatter of a gradient group; `op` (\"sum\" or \"avg\") overrides "
          "the collectives' gradient_op for it (Note [Sharded accumulation]).")
      .def("finish_reduce_scatters",
           [](PyGroupCollectives& self) {
             ThrowIfError(self.Run([](GroupCollectives& c) { return c.FinishReduceScatters(); }));
           })
      .def("finish_completed_reduce_scatters",
           [](PyGroupCollectives& self) {
             return ValueOrThrow(self.Run(
                 [](GroupCollectives& c) { return c.FinishCompletedReduceScatters(); }));
           },
           "Finishes the started reduce-scatters that are already done, oldest first, without "
           "waiting; returns how many.")
      .def(
          "finish_reduce_scatters_issued_everywhere",
          [](PyGroupCollectives& self, std::shared_ptr<Communicator> watched, double bound_s) {
            const absl::Duration bound = Seconds(bound_s);
            const ReduceScatterWait wait = ValueOrThrow(self.Run([&](GroupCollectives& c) {
              return c.FinishReduceScattersIssuedEverywhere(watched.get(), bound);
            }));
            return py::make_tuple(wait.finished, wait.gave_up);
          },
          py::arg("watched"), py::arg("bound_s"),
          "Finishes the started reduce-scatters, oldest first, waiting for each once every rank "
          "issued it; stops when the back end cannot tell, when a rank yet to issue it went "
          "ahead on `watched` (None: never), or after bound_s (Note [Waiting for "
          "reduce-scatters every rank issued]). Returns (finished, gave_up).")
      .def_property_readonly(
          "issued_by_rank",
          [](PyGroupCollectives& self) { return self.communicator->IssuedByRank(); },
          "Calls each rank issued on the communicator, as far as it can tell (empty: it cannot; "
          "Note [Issued everywhere]).")
      .def_property_readonly(
          "pending_reduce_scatters",
          [](PyGroupCollectives& self) {
            return self.Run([](GroupCollectives& c) { return c.pending_reduce_scatters(); });
          })
      .def_property_readonly(
          "collectives_issued",
          [](PyGroupCollectives& self) {
            return self.Run([](GroupCollectives& c) { return c.collectives_issued(); });
          })
      .def_property_readonly("bytes_communicated", [](PyGroupCollectives& self) {
        return self.Run([](GroupCollectives& c) { return c.bytes_communicated(); });
      });
}

}  // namespace ps::bindings
