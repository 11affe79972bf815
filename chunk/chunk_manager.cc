// ChunkManager: creation, tensor registration and layout, lookups, tensor states and moments.
// The other concerns of the class live beside it: chunk_manager_placement.cc (budgets, victim
// choice, eviction), chunk_manager_moves.cc (copies, prefetch, residency), chunk_manager_groups.cc
// (communication-group bookkeeping), chunk_manager_stats.cc (statistics, JSON, profiling).
#include "chunk/chunk_manager.h"
#include "chunk/chunk_manager_internal.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/gpu.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace ps {

using chunk_manager_internal::IsOptimizerState;

absl::StatusOr<std::unique_ptr<ChunkManager>> ChunkManager::Create(ChunkManagerOptions options) {
  if (options.copy_engine == nullptr) {
    return absl::InvalidArgumentError("chunk manager: a copy engine is required");
  }
  if (options.tiers.empty()) {
    return absl::InvalidArgumentError("chunk manager: at least one tier is required");
  }
  bool has_memory_tier = false;
  for (size_t i = 0; i < options.tiers.size(); ++i) {
    const std::shared_ptr<Tier>& tier = options.tiers[i];
    if (tier == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("chunk manager: tier ", i, " is null"));
    }
    if (i > 0 && static_cast<int>(tier->kind()) <= static_cast<int>(options.tiers[i - 1]->kind())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk manager: tiers must be ordered device, host, nvme with one of each at most; '",
          tier->name(), "' (", TierKindName(tier->kind()), ") follows '",
          options.tiers[i - 1]->name(), "' (", TierKindName(options.tiers[i - 1]->kind()), ")"));
    }
    has_memory_tier |= tier->kind() != TierKind::kNvme;
  }
  if (!has_memory_tier) {
    return absl::InvalidArgumentError("chunk manager: needs a device or host tier to compute in");
  }
  if (options.world_size <= 0 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("chunk manager: rank ", options.rank,
                                                   " is not in a world of ", options.world_size));
  }
  if (options.prefetch_moments < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk manager: prefetch_moments must be >= 0, got ", options.prefetch_moments));
  }
  return std::unique_ptr<ChunkManager>(new ChunkManager(std::move(options)));
}

ChunkManager::ChunkManager(ChunkManagerOptions options)
    : options_(std::move(options)), tracer_(static_cast<int>(options_.tiers.size())) {
  for (const std::shared_ptr<Tier>& tier : options_.tiers) {
    TierSlot slot;
    slot.tier = tier;
    slot.budget_bytes = tier->budget_bytes();
    slot.stats.name = tier->name();
    slot.stats.kind = tier->kind();
    slot.stats.budget_bytes = slot.budget_bytes;
    tiers_.push_back(std::move(slot));
  }
}

ChunkManager::~ChunkManager() {
  // Device work queued on the chunks by other streams (the gradient store of a step an error
  // ended: Note [Gradient stores on the compute stream] in bindings/chunk_views.h) must be done
  // before their blocks go back to a pool another manager may share.
  for (const TierSlot& slot : tiers_) {
    if (slot.tier->address_space() == AddressSpace::kDeviceMemory) {
      absl::Status synced = gpu::SynchronizeDevice(options_.copy_engine->options().device);
      if (!synced.ok()) PS_LOG(kWarning, "chunk manager: %s", synced.ToString());
      break;
    }
  }
  for (Chunk& chunk : chunks_) {
    if (chunk.pending_.has_value()) {
      absl::Status status = chunk.pending_->handle.Wait();
      if (!status.ok()) PS_LOG(kWarning, "chunk manager: prefetch failed: %s", status.ToString());
      absl::Status freed = chunk.pending_->destination.tier->Free(chunk.pending_->destination);
      if (!freed.ok()) PS_LOG(kWarning, "chunk manager: %s", freed.ToString());
      chunk.pending_.reset();
    }
    if (chunk.has_payload()) {
      absl::Status freed = chunk.payload_.tier->Free(chunk.payload_);
      if (!freed.ok()) PS_LOG(kWarning, "chunk manager: %s", freed.ToString());
    }
  }
  // Give the slabs back so a budget change of the (shared) tier does not see stale reservations,
  // and restore the budget the tier was configured with.
  for (TierSlot& slot : tiers_) {
    slot.tier->Trim();
    absl::Status status = slot.tier->SetBudget(slot.budget_bytes);
    if (!status.ok()) PS_LOG(kWarning, "chunk manager: %s", status.ToString());
  }
}

// ---- Registration and layout ----------------------------------------------------------------

absl::StatusOr<TensorId> ChunkManager::RegisterTensor(TensorSpec spec) {
  if (built_) {
    return absl::FailedPreconditionError(
        absl::StrCat("register tensor '", spec.name, "': the chunk lists are already built"));
  }
  if (spec.name.empty()) return absl::InvalidArgumentError("register tensor: empty name");
  if (tensor_by_name_.contains(spec.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("register tensor '", spec.name, "': the name is already registered"));
  }
  absl::StatusOr<int64_t> counted = NumElements(spec.shape);
  if (!counted.ok()) {
    return Annotate(counted.status(), absl::StrCat("register tensor '", spec.name, "'"));
  }
  const int64_t numel = *counted;
  if (numel == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("register tensor '", spec.name, "': it has no elements"));
  }
  const TensorId id = static_cast<TensorId>(tensors_.size());
  TensorInfo info;
  info.name = spec.name;
  info.shape = spec.shape;
  info.numel = numel;
  info.kind = spec.kind;
  info.dtype = spec.dtype;
  tensors_.push_back(std::move(info));
  tensor_by_name_[spec.name] = id;
  specs_.push_back(std::move(spec));
  return id;
}

absl::StatusOr<LayoutReport> ChunkManager::BuildChunkLists(int64_t chunk_elements) {
  if (built_) return absl::FailedPreconditionError("build chunk lists: already built");
  PS_ASSIGN_OR_RETURN(LayoutPlan plan, PlanLayout(specs_, chunk_elements, options_.world_size));
  return Adopt(std::move(plan), /*candidates=*/1);
}

absl::StatusOr<LayoutReport> ChunkManager::BuildChunkListsSearched(const ChunkSizeSearch& search) {
  if (built_) return absl::FailedPreconditionError("build chunk lists: already built");
  PS_ASSIGN_OR_RETURN(ChunkSizeSearchResult result,
                      SearchChunkSize(specs_, search, options_.world_size));
  return Adopt(std::move(result.plan), result.candidates);
}

absl::StatusOr<LayoutReport> ChunkManager::Adopt(LayoutPlan plan, int64_t candidates) {
  if (specs_.empty()) {
    return absl::FailedPreconditionError("build chunk lists: no tensors are registered");
  }
  for (const PlannedList& list : plan.lists) {
    for (size_t index = 0; index < list.chunks.size(); ++index) {
      const PlannedChunk& planned = list.chunks[index];
      Chunk chunk;
      chunk.id_ = static_cast<ChunkId>(chunks_.size());
      chunk.kind_ = list.kind;
      chunk.dtype_ = list.dtype;
      chunk.capacity_elements_ = planned.capacity_elements;
      chunk.index_in_list_ = static_cast<int64_t>(index);
      chunk.group_ = static_cast<int64_t>(index) / options_.world_size;
      chunk.owner_rank_ = static_cast<int>(index % options_.world_size);
      chunk.oversize_ = planned.oversize;
      chunk.padding_ = planned.padding;
      for (size_t t = 0; t < planned.tensors.size(); ++t) {
        TensorInfo& tensor = tensors_[planned.tensors[t]];
        tensor.chunk = chunk.id_;
        tensor.offset = planned.offsets[t];
        chunk.tensors_.push_back(planned.tensors[t]);
      }
      chunks_.push_back(std::move(chunk));
    }
  }
  LayoutReport report;
  report.chunk_elements = plan.chunk_elements;
  report.wasted_bytes = plan.wasted_bytes;
  report.candidates = candidates;
  report.num_chunks = static_cast<int64_t>(chunks_.size());
  for (int64_t index : plan.oversize_tensors) report.oversize_tensors.push_back(specs_[index].name);
  layout_hash_ = LayoutHash(plan, specs_);
  report.layout_hash = layout_hash_;
  plan_ = std::move(plan);
  built_ = true;
  PS_LOG(kInfo,
         "chunk lists: %d tensors in %d chunks of %d elements (%d sizes searched), %s wasted, "
         "%d oversize tensors in chunks of their own%s%s, layout hash %016x",
         tensors_.size(), report.num_chunks, report.chunk_elements, candidates,
         FormatBytes(report.wasted_bytes), report.oversize_tensors.size(),
         report.oversize_tensors.empty() ? "" : ": ", absl::StrJoin(report.oversize_tensors, ", "),
         layout_hash_);
  return report;
}

// ---- Lookups ---------------------------------------------------------------------------------

absl::Status ChunkManager::CheckBuilt(absl::string_view operation) const {
  if (built_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(operation, ": the chunk lists are not built yet (call BuildChunkLists)"));
}

absl::StatusOr<TensorId> ChunkManager::FindTensor(absl::string_view name) const {
  auto it = tensor_by_name_.find(name);
  if (it == tensor_by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("no tensor named '", name, "' is registered"));
  }
  return it->second;
}

absl::StatusOr<const TensorInfo*> ChunkManager::tensor(TensorId tensor) const {
  if (tensor < 0 || tensor >= num_tensors()) {
    return absl::OutOfRangeError(
        absl::StrCat("tensor id ", tensor, " is not registered (", num_tensors(), " tensors)"));
  }
  return &tensors_[tensor];
}

absl::StatusOr<TensorInfo*> ChunkManager::MutableTensor(TensorId tensor) {
  PS_ASSIGN_OR_RETURN(const TensorInfo* info, this->tensor(tensor));
  return const_cast<TensorInfo*>(info);
}

absl::StatusOr<const Chunk*> ChunkManager::chunk(ChunkId chunk) const {
  if (chunk < 0 || chunk >= num_chunks()) {
    return absl::OutOfRangeError(
        absl::StrCat("chunk id ", chunk, " does not exist (", num_chunks(), " chunks)"));
  }
  return &chunks_[chunk];
}

std::vector<ChunkId> ChunkManager::ChunksOfKind(ChunkKind kind) const {
  std::vector<ChunkId> ids;
  for (const Chunk& chunk : chunks_) {
    if (chunk.kind_ == kind) ids.push_back(chunk.id_);
  }
  return ids;
}

absl::StatusOr<int> ChunkManager::TierIndex(TierKind kind) const {
  for (int i = 0; i < num_tiers(); ++i) {
    if (tiers_[i].tier->kind() == kind) return i;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the chunk manager has no ", TierKindName(kind), " tier"));
}

std::string ChunkManager::DescribeChunk(const Chunk& chunk) const {
  return absl::StrCat("chunk ", chunk.id_, " (", ChunkKindName(chunk.kind_), " #",
                      chunk.index_in_list_, ", ", FormatBytes(chunk.bytes()), ", on ",
                      chunk.tier_index_ < 0
                          ? std::string("no tier")
                          : absl::StrCat("'", tiers_[chunk.tier_index_].stats.name, "'"),
                      ")");
}

TensorView ChunkManager::ViewOf(const TensorInfo& tensor) const {
  const Chunk& chunk = chunks_[tensor.chunk];
  TensorView view;
  view.address = chunk.payload_.address + tensor.offset * ElementSize(chunk.dtype_);
  view.tier_kind = tiers_[chunk.tier_index_].tier->kind();
  view.address_space = tiers_[chunk.tier_index_].tier->address_space();
  view.tier_name = tiers_[chunk.tier_index_].stats.name;
  view.dtype = tensor.dtype;
  view.numel = tensor.numel;
  view.shape = tensor.shape;
  return view;
}

// ---- Tensor states ---------------------------------------------------------------------------

absl::Status ChunkManager::Transition(TensorInfo& tensor, TensorState to) {
  PS_RETURN_IF_ERROR(CheckTransition(tensor.name, tensor.state, to));
  tensor.state = to;
  return absl::OkStatus();
}

absl::Status ChunkManager::AfterStateChange(Chunk& chunk) {
  // A payload nobody's data lives in is dropped: the next access zero-fills (FREE) or gathers
  // (RELEASED) anyway.
  for (TensorId id : chunk.tensors_) {
    if (HoldsData(tensors_[id].state)) return absl::OkStatus();
  }
  return DropPayload(chunk);
}

absl::StatusOr<TensorView> ChunkManager::Access(TensorId id, TierKind tier_kind) {
  PS_RETURN_IF_ERROR(CheckBuilt("access"));
  PS_ASSIGN_OR_RETURN(TensorInfo * tensor, MutableTensor(id));
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (tier_kind == TierKind::kNvme) {
    return absl::InvalidArgumentError(
        absl::StrCat("access tensor '", tensor->name,
                     "': NVMe is not addressable; access it on device or host"));
  }
  PS_RETURN_IF_ERROR(CheckTransition(tensor->name, tensor->state, TensorState::kCompute));
  Chunk& chunk = chunks_[tensor->chunk];
  if (!IsLocal(chunk.id_) && IsOptimizerState(chunk.kind_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "access tensor '", tensor->name, "': ", DescribeChunk(chunk), " holds optimizer state of ",
        "rank ", chunk.owner_rank_, "; rank ", options_.rank, " keeps none of it"));
  }
  if (chunk.compute_tensors_ > 0 && chunk.tier_index_ != tier) {
    return absl::FailedPreconditionError(
        absl::StrCat("access tensor '", tensor->name, "' on '", tiers_[tier].stats.name,
                     "': ", DescribeChunk(chunk), " has ", chunk.compute_tensors_,
                     " tensors in COMPUTE there and cannot move"));
  }
  // An owner reads its own dropped compute chunk alone (checkpoints, tied weights, a use after
  // its group was released): made again from the master, no collective.
  if (tensor->state == TensorState::kReleased) {
    PS_RETURN_IF_ERROR(Remake(chunk.id_, tier_kind).status());
  }
  // Zero-filling a chunk that holds RELEASED tensors would later pass zeros off as their data,
  // whichever of its tensors is accessed.
  if (!chunk.has_payload() &&
      std::any_of(chunk.tensors_.begin(), chunk.tensors_.end(),
                  [&](TensorId t) { return tensors_[t].state == TensorState::kReleased; })) {
    return absl::FailedPreconditionError(absl::StrCat(
        "access tensor '", tensor->name, "': ", DescribeChunk(chunk),
        " holds RELEASED tensors and was not gathered; gather its group first (PlanGather, "
        "MaterializeGathered)"));
  }
  tracer_.RecordAccess(chunk.id_, tier);
  EventLog::TriggerScope trigger(events_, EventTrigger::kAccess, chunk.id_);
  PS_RETURN_IF_ERROR(
      Annotate(MakeResident(chunk, tier), absl::StrCat("access tensor '", tensor->name, "'")));
  tensor->state = TensorState::kCompute;
  chunk.compute_tensors_ += 1;
  chunk.last_use_ = ++lru_clock_;
  return ViewOf(*tensor);
}

absl::Status ChunkManager::Release(TensorId id, TensorState state) {
  PS_RETURN_IF_ERROR(CheckBuilt("release"));
  PS_ASSIGN_OR_RETURN(TensorInfo * tensor, MutableTensor(id));
  if (tensor->state != TensorState::kCompute) {
    PS_RETURN_IF_ERROR(CheckTransition(tensor->name, tensor->state, state));
    return absl::FailedPreconditionError(
        absl::StrCat("release tensor '", tensor->name, "': it is ", TensorStateName(tensor->state),
                     ", not COMPUTE (use SetTensorState for ", TensorStateName(tensor->state),
                     " -> ", TensorStateName(state), ")"));
  }
  PS_RETURN_IF_ERROR(Transition(*tensor, state));
  Chunk& chunk = chunks_[tensor->chunk];
  chunk.compute_tensors_ -= 1;
  return AfterStateChange(chunk);
}

absl::Status ChunkManager::SetTensorState(TensorId id, TensorState state) {
  PS_RETURN_IF_ERROR(CheckBuilt("set tensor state"));
  PS_ASSIGN_OR_RETURN(TensorInfo * tensor, MutableTensor(id));
  PS_RETURN_IF_ERROR(CheckTransition(tensor->name, tensor->state, state));
  if (state == TensorState::kCompute || tensor->state == TensorState::kCompute) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", tensor->name, "': ", TensorStateName(tensor->state), " -> ",
                     TensorStateName(state), " enters or leaves COMPUTE; use Access / Release"));
  }
  if (!HoldsData(tensor->state) && HoldsData(state)) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", tensor->name, "': ", TensorStateName(tensor->state), " -> ",
                     TensorStateName(state), " needs its data back; use MaterializeGathered"));
  }
  Chunk& chunk = chunks_[tensor->chunk];
  if (state == TensorState::kReleased && IsLocal(chunk.id_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor '", tensor->name, "': cannot be RELEASED, ", DescribeChunk(chunk),
        " is owned by this rank (", options_.rank, ") and its data lives nowhere else"));
  }
  PS_RETURN_IF_ERROR(Transition(*tensor, state));
  return AfterStateChange(chunk);
}

absl::StatusOr<TensorView> ChunkManager::View(TensorId id) const {
  PS_ASSIGN_OR_RETURN(const TensorInfo* tensor, this->tensor(id));
  if (tensor->state != TensorState::kCompute) {
    return absl::FailedPreconditionError(
        absl::StrCat("view of tensor '", tensor->name, "': it is ", TensorStateName(tensor->state),
                     "; only a COMPUTE tensor has a fixed address (Access it first)"));
  }
  return ViewOf(*tensor);
}

// ---- Moments ---------------------------------------------------------------------------------

absl::Status ChunkManager::Tick() {
  PS_RETURN_IF_ERROR(FinishAllPrefetches());
  RecordMoment(/*end_of_iteration=*/false);
  tracer_.Tick();
  EventLog::TriggerScope trigger(events_, EventTrigger::kBudget, -1);
  for (int tier = 0; tier < num_tiers(); ++tier) {
    PS_RETURN_IF_ERROR(Annotate(EnforceBudget(tier), absl::StrCat("moment ", tracer_.moment())));
  }
  return IssuePrefetches();
}

absl::Status ChunkManager::ReportNonModelData(TierKind tier_kind, int64_t bytes) {
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("non-model data on '", tiers_[tier].stats.name,
                                                   "' must be >= 0, got ", bytes));
  }
  tracer_.ReportNonModelBytes(tier, bytes);
  tiers_[tier].stats.non_model_bytes = bytes;
  EventLog::TriggerScope trigger(events_, EventTrigger::kBudget, -1);
  return EnforceBudget(tier);
}

absl::Status ChunkManager::SetNonModelDataProbe(TierKind tier_kind, NonModelDataProbe probe) {
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  tracer_.SetProbe(tier, std::move(probe));
  return absl::OkStatus();
}

absl::Status ChunkManager::EndIteration() {
  PS_RETURN_IF_ERROR(FinishAllPrefetches());
  RecordMoment(/*end_of_iteration=*/true);
  tracer_.EndIteration();
  EventLog::TriggerScope trigger(events_, EventTrigger::kBudget, -1);
  for (int tier = 0; tier < num_tiers(); ++tier) PS_RETURN_IF_ERROR(EnforceBudget(tier));
  return absl::OkStatus();
}

absl::Status ChunkManager::RestartWarmup() {
  if (!tracer_.warming_up()) {
    return absl::FailedPreconditionError(
        "restart warm-up: warm-up already ended (the trace of the first iteration is frozen)");
  }
  PS_RETURN_IF_ERROR(FinishAllPrefetches());
  tracer_.RestartWarmup();
  return absl::OkStatus();
}

}  // namespace ps
