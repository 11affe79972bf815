// Python bindings of the chunk layer (chunk/): a thin layer over ChunkManager. Tiers and the copy
// engine are the shared_ptr objects of init_runtime.cc; statuses become exceptions
// (status_exceptions.h). Richer structures (statistics, trace, layout) cross as JSON text.
#include <torch/extension.h>

#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/synchronization/mutex.h"
#include "bindings/chunk_views.h"
#include "bindings/init.h"
#include "bindings/py_chunk_manager.h"
#include "bindings/status_exceptions.h"
#include "bindings/torch_dtype.h"
#include "chunk/chunk_kind.h"
#include "chunk/chunk_manager.h"
#include "chunk/event_log.h"
#include "chunk/tensor_state.h"
#include "kernels/cast.h"
#include "runtime/status.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

py::dict ViewToDict(const TensorView& view) {
  py::dict d;
  d["address"] = view.address;
  d["tier"] = view.tier_name;
  d["tier_kind"] = std::string(TierKindName(view.tier_kind));
  d["device_memory"] = view.address_space == AddressSpace::kDeviceMemory;
  d["dtype"] = std::string(DTypeName(view.dtype));
  d["numel"] = view.numel;
  d["shape"] = view.shape;
  return d;
}

py::dict LayoutToDict(const LayoutReport& report) {
  py::dict d;
  d["chunk_elements"] = report.chunk_elements;
  d["wasted_bytes"] = report.wasted_bytes;
  d["candidates"] = report.candidates;
  d["num_chunks"] = report.num_chunks;
  d["oversize_tensors"] = report.oversize_tensors;
  d["layout_hash"] = report.layout_hash;
  return d;
}

// Adds d[name] = [field(r) for r in records]: the drained log crosses as columns, one list per
// field (numpy-friendly: np.asarray(d["bytes"])).
template <typename Record, typename Field>
void AddColumn(py::dict& d, const char* name, const std::vector<Record>& records, Field field) {
  py::list values;
  for (const Record& record : records) values.append(field(record));
  d[name] = values;
}

py::dict EventsToColumns(const std::vector<ChunkEvent>& events) {
  py::dict d;
  using E = const ChunkEvent&;
  AddColumn(d, "type", events, [](E e) { return std::string(EventTypeName(e.type)); });
  AddColumn(d, "cause", events, [](E e) { return std::string(EventCauseName(e.cause)); });
  AddColumn(d, "phase", events, [](E e) { return std::string(EventPhaseName(e.phase)); });
  AddColumn(d, "trigger", events, [](E e) { return std::string(EventTriggerName(e.trigger)); });
  AddColumn(d, "ok", events, [](E e) { return e.ok; });
  AddColumn(d, "from_tier", events, [](E e) { return e.from_tier; });
  AddColumn(d, "to_tier", events, [](E e) { return e.to_tier; });
  AddColumn(d, "chunk", events, [](E e) { return e.chunk; });
  AddColumn(d, "bytes", events, [](E e) { return e.bytes; });
  AddColumn(d, "iteration", events, [](E e) { return e.iteration; });
  AddColumn(d, "moment", events, [](E e) { return e.moment; });
  AddColumn(d, "start_ns", events, [](E e) { return e.start_ns; });
  AddColumn(d, "end_ns", events, [](E e) { return e.end_ns; });
  AddColumn(d, "wait_ns", events, [](E e) { return e.wait_ns; });
  AddColumn(d, "next_use_distance", events, [](E e) { return e.next_use_distance; });
  AddColumn(d, "for_chunk", events, [](E e) { return e.for_chunk; });
  return d;
}

// Moment samples as columns; the per-tier fields hold a list with one entry per tier.
py::dict SamplesToColumns(const std::vector<MomentSample>& samples) {
  py::dict d;
  using S = const MomentSample&;
  AddColumn(d, "time_ns", samples, [](S s) { return s.time_ns; });
  AddColumn(d, "iteration", samples, [](S s) { return s.iteration; });
  AddColumn(d, "moment", samples, [](S s) { return s.moment; });
  AddColumn(d, "end_of_iteration", samples, [](S s) { return s.end_of_iteration; });
  for (auto [name, member] : {std::pair{"chunk_bytes", &TierSample::chunk_bytes},
                              std::pair{"non_model_bytes", &TierSample::non_model_bytes},
                              std::pair{"budget_bytes", &TierSample::budget_bytes}}) {
    AddColumn(d, name, samples, [member](S s) {
      py::list tiers;
      for (int t = 0; t < s.num_tiers; ++t) tiers.append(s.tiers[t].*member);
      return tiers;
    });
  }
  return d;
}

// Binds `Kind` as a Python enum whose value names are `name(kind)` upper-cased (Note [One name
// per kind]).
template <typename Kind>
void BindKindEnum(py::module_& module, const char* python_name, std::vector<Kind> kinds,
                  absl::string_view (*name)(Kind)) {
  py::enum_<Kind> bound(module, python_name);
  for (Kind kind : kinds) {
    const std::string upper = absl::AsciiStrToUpper(name(kind));
    bound.value(upper.c_str(), kind);
  }
}

}  // namespace

void InitChunk(py::module_& module) {
  module.def("steady_clock_ns", &EventLog::NowNs,
             "The event log's clock (steady, ns; the clock of time.monotonic_ns on Linux).");

  // Note [One name per kind]
  // A chunk kind and a tier kind have one spelling each, the C++ one (ChunkKindName,
  // TierKindName): it is what layouts, stats and tier arguments carry, and the bound values'
  // names are that spelling upper-cased, so Python turns either into the other with
  // `kind.name.lower()` / `ChunkKind.__members__[name.upper()]` (patrickstar/vocabulary.py)
  // and keeps no table of its own.
  BindKindEnum<ChunkKind>(module, "ChunkKind",
                          {ChunkKind::kComputeParam, ChunkKind::kMasterParam,
                           ChunkKind::kMomentum, ChunkKind::kVariance, ChunkKind::kGradient,
                           ChunkKind::kMomentumScale, ChunkKind::kVarianceScale,
                           ChunkKind::kParamCompensation},
                          ChunkKindName);
  BindKindEnum<TierKind>(module, "TierKind",
                         {std::begin(kAllTierKinds), std::end(kAllTierKinds)}, TierKindName);

  py::enum_<TensorState>(module, "TensorState")
      .value("FREE", TensorState::kFree)
      .value("COMPUTE", TensorState::kCompute)
      .value("HOLD", TensorState::kHold)
      .value("HOLD_AFTER_FWD", TensorState::kHoldAfterFwd)
      .value("HOLD_AFTER_BWD", TensorState::kHoldAfterBwd)
      .value("RELEASED", TensorState::kReleased);

  using M = ChunkManager;
  py::class_<PyChunkManager>(module, "ChunkManager",
                             "Chunks of registered tensors placed across tiers (chunk/).")
      .def(py::init([](std::vector<std::shared_ptr<Tier>> tiers,
                       std::shared_ptr<CopyEngine> copy_engine, int world_size, int rank,
                       int prefetch_moments, const std::string& eviction_policy) {
             ChunkManagerOptions options;
             options.tiers = std::move(tiers);
             options.copy_engine = std::move(copy_engine);
             options.world_size = world_size;
             options.rank = rank;
             options.prefetch_moments = prefetch_moments;
             if (eviction_policy == "opt") {
               options.eviction_policy = EvictionPolicy::kOptAfterWarmup;
             } else if (eviction_policy == "lru") {
               options.eviction_policy = EvictionPolicy::kLru;
             } else {
               throw py::value_error("eviction_policy must be 'opt' or 'lru', got '" +
                                     eviction_policy + "'");
             }
             return std::make_unique<PyChunkManager>(
                 ValueOrThrow(ChunkManager::Create(std::move(options))));
           }),
           py::arg("tiers"), py::arg("copy_engine"), py::arg("world_size") = 1, py::arg("rank") = 0,
           py::arg("prefetch_moments") = 0, py::arg("eviction_policy") = "opt",
           "tiers: fastest first (device, host, nvme), one of each kind at most.")
      .def("close", &PyChunkManager::Close,
           "Frees every chunk now; later calls raise RuntimeError.")
      .def(
          "register_tensor",
          [](PyChunkManager& self, const std::string& name, std::vector<int64_t> shape,
             ChunkKind kind, const std::string& dtype) {
            const DType parsed = ValueOrThrow(ParseDType(dtype));
            return ValueOrThrow(self.Run([&](M& m) {
              return m.RegisterTensor(TensorSpec{name, std::move(shape), kind, parsed});
            }));
          },
          py::arg("name"), py::arg("shape"), py::arg("kind"), py::arg("dtype"),
          "Registers a tensor; returns its id.")
      .def(
          "build_chunk_lists",
          [](PyChunkManager& self, int64_t chunk_elements) {
            return LayoutToDict(
                ValueOrThrow(self.Run([&](M& m) { return m.BuildChunkLists(chunk_elements); })));
          },
          py::arg("chunk_elements"))
      .def(
          "search_chunk_lists",
          [](PyChunkManager& self, int64_t min_elements, int64_t max_elements,
             int64_t step_elements, int64_t floor_elements) {
            return LayoutToDict(ValueOrThrow(self.Run([&](M& m) {
              return m.BuildChunkListsSearched(
                  ChunkSizeSearch{min_elements, max_elements, step_elements, floor_elements});
            })));
          },
          py::arg("min_elements"), py::arg("max_elements"), py::arg("step_elements"),
          py::arg("floor_elements") = 0,
          "Builds the lists with the candidate chunk size of the smallest estimated per-rank "
          "peak (Note [Chunk-size search]): min, min + step, ... <= max, and with "
          "floor_elements > 0 also floor, 2 floor, 4 floor, ... below min.")
      .def(
          "access",
          [](PyChunkManager& self, TensorId tensor, const std::string& tier) {
            const TierKind kind = ParseTierKind(tier);
            return ViewToDict(ValueOrThrow(self.Run([&](M& m) { return m.Access(tensor, kind); })));
          },
          py::arg("tensor"), py::arg("tier") = "device",
          "Brings the tensor's chunk to the tier, marks it COMPUTE; returns its address info.")
      .def(
          "release",
          [](PyChunkManager& self, TensorId tensor, TensorState state) {
            ThrowIfError(self.Run([&](M& m) { return m.Release(tensor, state); }));
          },
          py::arg("tensor"), py::arg("state"))
      .def(
          "set_tensor_state",
          [](PyChunkManager& self, TensorId tensor, TensorState state) {
            ThrowIfError(self.Run([&](M& m) { return m.SetTensorState(tensor, state); }));
          },
          py::arg("tensor"), py::arg("state"))
      .def(
          "view",
          [](PyChunkManager& self, TensorId tensor) {
            return ViewToDict(ValueOrThrow(self.Run([&](M& m) { return m.View(tensor); })));
          },
          py::arg("tensor"), "Address info of a COMPUTE tensor.")
      .def(
          "access_tensor",
          [](PyChunkManager& self, TensorId tensor, const std::string& tier) {
            const TierKind kind = ParseTierKind(tier);
            return TorchView(ValueOrThrow(self.Run([&](M& m) { return m.Access(tensor, kind); })));
          },
          py::arg("tensor"), py::arg("tier") = "device",
          "access() returning the torch view (torch_view()) in one call.")
      .def(
          "torch_view",
          [](PyChunkManager& self, TensorId tensor) {
            return TorchView(ValueOrThrow(self.Run([&](M& m) { return m.View(tensor); })));
          },
          py::arg("tensor"),
          "A torch tensor over a COMPUTE tensor's bytes; valid only until it is released.")
      .def(
          "move_chunk",
          [](PyChunkManager& self, ChunkId chunk, const std::string& tier) {
            const TierKind kind = ParseTierKind(tier);
            ThrowIfError(self.Run([&](M& m) { return m.MoveChunk(chunk, kind); }));
          },
          py::arg("chunk"), py::arg("tier"))
      .def(
          "start_move",
          [](PyChunkManager& self, ChunkId chunk, const std::string& tier) {
            const TierKind kind = ParseTierKind(tier);
            return ValueOrThrow(self.Run([&](M& m) { return m.StartMove(chunk, kind); }));
          },
          py::arg("chunk"), py::arg("tier"),
          "Starts moving the chunk to the tier without waiting; False when there was nothing to "
          "start (pinned, no payload, already there or moving).")
      .def(
          "chunk_tier",
          [](PyChunkManager& self, ChunkId chunk) -> std::optional<std::string> {
            const std::optional<TierKind> kind =
                ValueOrThrow(self.Run([&](M& m) { return m.ChunkTier(chunk); }));
            if (!kind.has_value()) return std::nullopt;
            return std::string(TierKindName(*kind));
          },
          py::arg("chunk"), "'device', 'host' or 'nvme': where the chunk's payload is; None "
          "without one.")
      .def(
          "chunk_tiers",
          [](PyChunkManager& self, const std::vector<ChunkId>& chunks) {
            std::vector<std::optional<std::string>> names;
            names.reserve(chunks.size());
            ThrowIfError(self.Run([&](M& m) -> absl::Status {
              for (ChunkId chunk : chunks) {
                PS_ASSIGN_OR_RETURN(const std::optional<TierKind> kind, m.ChunkTier(chunk));
                names.push_back(kind.has_value()
                                    ? std::optional<std::string>(TierKindName(*kind))
                                    : std::nullopt);
              }
              return absl::OkStatus();
            }));
            return names;
          },
          py::arg("chunks"), "chunk_tier() of each chunk, in one call.")
      .def(
          "access_tensors",
          [](PyChunkManager& self, const std::vector<TensorId>& tensors,
             const std::vector<std::string>& tiers) {
            if (tiers.size() != tensors.size()) {
              throw py::value_error("access_tensors: " + std::to_string(tensors.size()) +
                                    " tensors but " + std::to_string(tiers.size()) + " tiers");
            }
            std::vector<TierKind> kinds;
            for (const std::string& tier : tiers) kinds.push_back(ParseTierKind(tier));
            std::vector<TensorView> views;
            ThrowIfError(self.Run([&](M& m) -> absl::Status {
              for (size_t i = 0; i < tensors.size(); ++i) {
                absl::StatusOr<TensorView> view = m.Access(tensors[i], kinds[i]);
                if (!view.ok()) {  // all or nothing: give back what this call accessed
                  for (size_t j = 0; j < views.size(); ++j) {
                    (void)m.Release(tensors[j], TensorState::kHold);
                  }
                  return view.status();
                }
                views.push_back(*std::move(view));
              }
              return absl::OkStatus();
            }));
            std::vector<at::Tensor> result;
            result.reserve(views.size());
            for (const TensorView& view : views) result.push_back(TorchView(view));
            return result;
          },
          py::arg("tensors"), py::arg("tiers"),
          "access_tensor() of each tensor on its tier, all or none (a failure releases the "
          "ones accessed to HOLD).")
      .def(
          "release_tensors",
          [](PyChunkManager& self, const std::vector<TensorId>& tensors, TensorState state) {
            ThrowIfError(self.Run([&](M& m) -> absl::Status {
              absl::Status first = absl::OkStatus();
              for (TensorId tensor : tensors) first.Update(m.Release(tensor, state));
              return first;
            }));
          },
          py::arg("tensors"), py::arg("state"),
          "release() of each tensor; all are tried, the first error is raised.")
      .def(
          "tick",
          [](PyChunkManager& self, std::optional<std::string> non_model_tier,
             int64_t non_model_bytes) {
            // The engine reports its non-model data at every moment: one call, one lock.
            std::optional<TierKind> kind;
            if (non_model_tier.has_value()) kind = ParseTierKind(*non_model_tier);
            ThrowIfError(self.Run([&](M& m) -> absl::Status {
              if (kind.has_value()) PS_RETURN_IF_ERROR(m.ReportNonModelData(*kind, non_model_bytes));
              return m.Tick();
            }));
          },
          py::arg("non_model_tier") = py::none(), py::arg("non_model_bytes") = 0,
          "Ends the current moment; with non_model_tier, first reports the non-model bytes there "
          "(report_non_model_data).")
      .def(
          "report_non_model_data",
          [](PyChunkManager& self, const std::string& tier, int64_t nbytes) {
            const TierKind kind = ParseTierKind(tier);
            ThrowIfError(self.Run([&](M& m) { return m.ReportNonModelData(kind, nbytes); }));
          },
          py::arg("tier"), py::arg("nbytes"))
      .def("restart_warmup",
           [](PyChunkManager& self) {
             ThrowIfError(self.Run([](M& m) { return m.RestartWarmup(); }));
           })
      .def("end_iteration",
           [](PyChunkManager& self) {
             ThrowIfError(self.Run([](M& m) { return m.EndIteration(); }));
           })
      .def(
          "find_tensor",
          [](PyChunkManager& self, const std::string& name) {
            return ValueOrThrow(self.Run([&](M& m) { return m.FindTensor(name); }));
          },
          py::arg("name"))
      .def(
          "tensor_info",
          [](PyChunkManager& self, TensorId tensor) {
            const TensorInfo info = ValueOrThrow(self.Run([&](M& m) -> absl::StatusOr<TensorInfo> {
              PS_ASSIGN_OR_RETURN(const TensorInfo* found, m.tensor(tensor));
              return *found;
            }));
            py::dict d;
            d["name"] = info.name;
            d["shape"] = info.shape;
            d["numel"] = info.numel;
            d["kind"] = info.kind;
            d["dtype"] = std::string(DTypeName(info.dtype));
            d["chunk"] = info.chunk;
            d["offset"] = info.offset;
            d["state"] = info.state;
            return d;
          },
          py::arg("tensor"))
      .def(
          "chunk_tensors",
          [](PyChunkManager& self, ChunkId chunk) {
            return ValueOrThrow(self.Run([&](M& m) -> absl::StatusOr<std::vector<TensorId>> {
              PS_ASSIGN_OR_RETURN(const Chunk* found, m.chunk(chunk));
              return found->tensors();
            }));
          },
          py::arg("chunk"))
      .def(
          "chunks_of_kind",
          [](PyChunkManager& self, ChunkKind kind) {
            return self.Run([&](M& m) { return m.ChunksOfKind(kind); });
          },
          py::arg("kind"))
      .def(
          "is_local",
          [](PyChunkManager& self, ChunkId chunk) {
            return ValueOrThrow(self.Run([&](M& m) -> absl::StatusOr<bool> {
              PS_RETURN_IF_ERROR(m.chunk(chunk).status());
              return m.IsLocal(chunk);
            }));
          },
          py::arg("chunk"))
      .def(
          "plan_gather",
          [](PyChunkManager& self, TensorId tensor) {
            const GatherPlan plan =
                ValueOrThrow(self.Run([&](M& m) { return m.PlanGather(tensor); }));
            py::dict d;
            d["kind"] = plan.kind;
            d["group"] = plan.group;
            d["chunks"] = plan.chunks;
            d["local_chunk"] = plan.local_chunk;
            d["to_receive"] = plan.to_receive;
            d["needs_gather"] = plan.needs_gather;
            return d;
          },
          py::arg("tensor"))
      .def("releasable_groups",
           [](PyChunkManager& self) { return self.Run([](M& m) { return m.ReleasableGroups(); }); })
      .def(
          "release_group",
          [](PyChunkManager& self, ChunkId chunk) {
            ThrowIfError(self.Run([&](M& m) { return m.ReleaseGroup(chunk); }));
          },
          py::arg("chunk"))
      .def(
          "materialize_gathered",
          [](PyChunkManager& self, ChunkId chunk, const std::string& tier, py::function fill) {
            const TierKind kind = ParseTierKind(tier);
            // The Python error, if any, is carried around the core (which never sees exceptions)
            // and raised again here.
            std::exception_ptr raised;
            absl::Status status = self.RunHoldingGil([&](M& m) {
              return m.MaterializeGathered(
                  chunk, kind, [&](void* data, int64_t bytes) -> absl::Status {
                    try {
                      const bool on_device =
                          kind == TierKind::kDevice &&
                          m.tier(0).address_space() == AddressSpace::kDeviceMemory;
                      fill(MemoryTensor(
                          data, {bytes}, at::kByte,
                          on_device ? AddressSpace::kDeviceMemory : AddressSpace::kHostMemory));
                      return absl::OkStatus();
                    } catch (...) {
                      raised = std::current_exception();
                      return absl::AbortedError("the fill callback raised");
                    }
                  });
            });
            if (raised) std::rethrow_exception(raised);
            ThrowIfError(status);
          },
          py::arg("chunk"), py::arg("tier"), py::arg("fill"),
          "Places a payload for a remote chunk of a released group and calls fill(bytes), a "
          "uint8 tensor over it, for the collective to write into; its tensors become HOLD. fill "
          "must not call this manager (it runs under the manager's lock).")
      .def(
          "complete_gather",
          [](PyChunkManager& self, ChunkId chunk) {
            ThrowIfError(self.Run([&](M& m) { return m.CompleteGather(chunk); }));
          },
          py::arg("chunk"))
      .def(
          "set_remake_sources",
          [](PyChunkManager& self, const std::vector<std::pair<TensorId, TensorId>>& pairs) {
            return ValueOrThrow(self.Run([&](M& m) {
              return m.SetRemakeSources(pairs, &kernels::CastFloatTo16AsUpdate);
            }));
          },
          py::arg("pairs"),
          "Declares (compute tensor, master tensor) pairs: this rank's compute chunks whose "
          "tensors all have a master are dropped with their group and made again from the "
          "masters (Note [Compute chunks re-made from the master]). Returns how many chunks.")
      .def(
          "remakeable",
          [](PyChunkManager& self, ChunkId chunk) {
            return self.Run([&](M& m) { return m.Remakeable(chunk); });
          },
          py::arg("chunk"))
      .def(
          "remake",
          [](PyChunkManager& self, ChunkId chunk) {
            return ValueOrThrow(self.Run([&](M& m) { return m.Remake(chunk); }));
          },
          py::arg("chunk"))
      .def_property_readonly(
          "remakes",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.remakes(); }); })
      .def_property_readonly(
          "num_tensors",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.num_tensors(); }); })
      .def_property_readonly(
          "num_chunks",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.num_chunks(); }); })
      .def_property_readonly(
          "layout_hash",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.layout_hash(); }); })
      .def_property_readonly(
          "world_size",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.world_size(); }); })
      .def_property_readonly("warming_up",
                             [](PyChunkManager& self) {
                               return self.Run([](M& m) { return m.tracer().warming_up(); });
                             })
      .def_property_readonly(
          "moment",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.tracer().moment(); }); })
      .def_property_readonly("iteration",
                             [](PyChunkManager& self) {
                               return self.Run([](M& m) { return m.tracer().iteration(); });
                             })
      .def(
          "enable_events",
          [](PyChunkManager& self, bool enabled, int64_t capacity) {
            if (capacity <= 0) {
              throw py::value_error("enable_events: capacity must be > 0, got " +
                                    std::to_string(capacity));
            }
            self.Run([&](M& m) { m.events().Enable(enabled, capacity); });
          },
          py::arg("enabled") = true, py::arg("capacity") = EventLog::kDefaultCapacity,
          "Turns the profiling event log on or off (off by default); at most `capacity` events "
          "and as many moment samples are kept until drained, the rest counted as dropped.")
      .def(
          "set_event_phase",
          [](PyChunkManager& self, const std::string& name) {
            EventPhase phase = EventPhase::kOther;
            if (!ParseEventPhase(name, &phase)) {
              throw py::value_error("set_event_phase: unknown phase '" + name +
                                    "': expected 'other', 'forward', 'backward' or 'optimizer'");
            }
            self.Run([&](M& m) { m.events().set_phase(phase); });
          },
          py::arg("phase"),
          "The phase stamped on events; synchronous moves in 'optimizer' have cause optimizer.")
      .def(
          "drain_events",
          [](PyChunkManager& self) {
            return EventsToColumns(self.Run([](M& m) { return m.events().DrainEvents(); }));
          },
          "Recorded chunk events as a dict of equal-length lists (one per field).")
      .def(
          "drain_moment_samples",
          [](PyChunkManager& self) {
            return SamplesToColumns(self.Run([](M& m) { return m.events().DrainSamples(); }));
          },
          "Recorded per-moment tier samples as a dict of equal-length lists.")
      .def("clear_events", [](PyChunkManager& self) { self.Run([](M& m) { m.events().Clear(); }); })
      .def_property_readonly(
          "events_dropped",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.events().dropped(); }); })
      .def(
          "tier_stats_json",
          [](PyChunkManager& self) {
            return self.Run([](M& m) { return m.TierStatsJson().dump(); });
          },
          "Per-tier statistics as JSON (a list of objects), without the trace.")
      .def(
          "reset_peak_stats", [](PyChunkManager& self) { self.Run([](M& m) { m.ResetPeakStats(); }); },
          "Each tier's peak_chunk_bytes starts again from its current chunk bytes.")
      .def_property_readonly(
          "peak_total_chunk_bytes",
          [](PyChunkManager& self) {
            return self.Run([](M& m) { return m.peak_total_chunk_bytes(); });
          },
          "The peak of all tiers' chunk bytes together (not the sum of each tier's peak).")
      .def(
          "layout_json",
          [](PyChunkManager& self) { return self.Run([](M& m) { return m.LayoutJson().dump(); }); },
          "The chunk layout alone (chunks with their tensors, owners, hash) as JSON text; "
          "checkpoints record it without dump_json's trace and eviction log.")
      .def(
          "dump_json",
          [](PyChunkManager& self, int indent) {
            return self.Run([&](M& m) { return m.DumpJson(indent); });
          },
          py::arg("indent") = 2,
          "Layout, per-tier statistics, evictions and the tracer's trace, as JSON text.");
}

}  // namespace ps::bindings
