#include "chunk/chunk_manager.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/gpu.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace ps {

// Note [Communication groups]
// Each chunk list is padded to a multiple of world_size chunks (PlanLayout); chunks
// [g * world_size, (g + 1) * world_size) of a list form group g and rank r owns chunk
// g * world_size + r. Every rank materializes the whole model at initialization (same seed, same
// layout), then keeps only what it owns: compute-param and gradient chunks of other ranks are
// *remote*. A gather is an allgather of a whole group, so every rank must decide to gather (and
// to release) a group at the same point of the access sequence, whichever of its chunks it owns.
// Hence both decisions are made per group, from state that is the same on every rank: a group's
// remote chunks become releasable only when every tensor of the *group* was used in this pass
// (HOLD_AFTER_FWD / HOLD_AFTER_BWD, none COMPUTE); releasing drops the payload and marks their
// tensors RELEASED; the next access of any tensor of the group then needs the group gathered
// (PlanGather lists what this rank receives; MaterializeGathered takes the bytes). Optimizer-state
// chunks (master params, momentum, variance) exist only on their owner: accessing a remote one is
// an error. The collectives themselves live in a later layer; this file keeps the bookkeeping.

namespace {

constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

bool IsOptimizerState(ChunkKind kind) {
  return kind == ChunkKind::kMasterParam || kind == ChunkKind::kMomentum ||
         kind == ChunkKind::kVariance;
}

// Note [Spill order]: which kinds leave a memory tier for NVMe first when nothing better is known.
// Optimizer state is touched once an iteration (the sweep), gradients twice, compute parameters
// in forward and backward, so without a trace this is the order of least harm; after warm-up OPT
// decides (it reaches the same order during forward and backward on its own) and this only breaks
// its ties.
int SpillRank(ChunkKind kind) {
  if (IsOptimizerState(kind)) return 0;
  return kind == ChunkKind::kGradient ? 1 : 2;
}

bool Contains(absl::Span<const ChunkId> ids, ChunkId id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

std::vector<ChunkId> With(absl::Span<const ChunkId> ids, ChunkId id) {
  std::vector<ChunkId> result(ids.begin(), ids.end());
  result.push_back(id);
  return result;
}

}  // namespace

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

// ---- Budgets and eviction --------------------------------------------------------------------

int64_t ChunkManager::AllowedChunkBytes(int tier) const {
  const int64_t budget = tiers_[tier].budget_bytes;
  if (budget == 0) return kUnlimited;
  return budget - tracer_.NonModelBytes(tier);
}

absl::StatusOr<int64_t> ChunkManager::ChunkBytesAllowedAt(TierKind tier_kind,
                                                          int64_t moment) const {
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (moment < 0) {
    return absl::InvalidArgumentError(absl::StrCat("moment must be >= 0, got ", moment));
  }
  const int64_t budget = tiers_[tier].budget_bytes;
  if (budget == 0) return kUnlimited;
  return budget - tracer_.TracedNonModelBytes(tier, moment);
}

void ChunkManager::AddChunkBytes(int tier, int64_t delta) {
  TierSlot& slot = tiers_[tier];
  slot.chunk_bytes += delta;
  slot.stats.peak_chunk_bytes = std::max(slot.stats.peak_chunk_bytes, slot.chunk_bytes);
  tracer_.ObserveModelBytes(tier, slot.chunk_bytes);
}

void ChunkManager::SetPayload(Chunk& chunk, Block block, int tier) {
  chunk.payload_ = block;
  chunk.tier_index_ = tier;
  chunk.prefetched_tier_ = -1;
}

absl::Status ChunkManager::EnforceBudget(int tier) {
  TierSlot& slot = tiers_[tier];
  if (slot.budget_bytes == 0) return absl::OkStatus();
  const int64_t allowed = AllowedChunkBytes(tier);
  // A Tier budget of 0 means "unlimited", so "no room at all" is a budget of one byte.
  PS_RETURN_IF_ERROR(slot.tier->SetBudget(std::max<int64_t>(allowed, 1)));
  while (slot.tier->stats().reserved_bytes > allowed) {
    if (slot.tier->Trim() > 0) continue;
    Chunk* victim = ChooseVictim(tier, {});
    if (victim == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tier '", slot.stats.name, "' (", TierKindName(slot.stats.kind), "): budget ",
          FormatBytes(slot.budget_bytes), " minus non-model data ",
          FormatBytes(tracer_.NonModelBytes(tier)), " leaves ", FormatBytes(allowed),
          " for chunks, but ", FormatBytes(slot.tier->stats().reserved_bytes),
          " are reserved and every chunk there is pinned (COMPUTE or a copy in flight)"));
    }
    PS_RETURN_IF_ERROR(Evict(*victim, {}));
  }
  return absl::OkStatus();
}

// Note [Victim choice]
// Only unpinned chunks with a payload on the tier, outside `exclude` (the chunks the caller is
// moving right now), are candidates. With the warm-up trace (and policy kOptAfterWarmup) the
// victim is the candidate whose next use in the recorded sequence is farthest (Belady's OPT,
// reading the sequence cyclically so the start of the next iteration counts); before that, the
// least recently used. Evicting into NVMe, the kind breaks ties (and leads while warming up;
// Note [Spill order]). Then the least recently used, then the lowest id, so the choice is
// deterministic.
Chunk* ChunkManager::ChooseVictim(int tier, absl::Span<const ChunkId> exclude) {
  const bool use_opt = options_.eviction_policy == EvictionPolicy::kOptAfterWarmup &&
                       !tracer_.warming_up() && !tracer_.accesses().empty();
  const int64_t now = tracer_.cursor() - 1;
  const bool to_nvme =
      tier + 1 < num_tiers() && tiers_[tier + 1].stats.kind == TierKind::kNvme;
  // Lexicographic key, smaller evicted first: (spill rank while warming up into NVMe, -next use,
  // spill rank into NVMe, last use); Note [Spill order].
  auto key = [&](const Chunk& chunk) {
    const int rank = to_nvme ? SpillRank(chunk.kind_) : 0;
    const int64_t next_use = use_opt ? tracer_.NextUse(chunk.id_, now) : 0;
    return std::tuple(use_opt ? 0 : rank, -next_use, rank, chunk.last_use_);
  };
  Chunk* best = nullptr;
  decltype(key(chunks_.front())) best_key;
  for (Chunk& candidate : chunks_) {
    if (candidate.tier_index_ != tier || candidate.pinned() || !candidate.has_payload() ||
        Contains(exclude, candidate.id_)) {
      continue;
    }
    const auto candidate_key = key(candidate);
    if (best == nullptr || candidate_key < best_key) {
      best = &candidate;
      best_key = candidate_key;
    }
  }
  return best;
}

absl::Status ChunkManager::Evict(Chunk& victim, absl::Span<const ChunkId> exclude) {
  const int from = victim.tier_index_;
  if (from + 1 >= num_tiers()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot evict ", DescribeChunk(victim), ": '",
                                                     tiers_[from].stats.name,
                                                     "' is the last tier of the hierarchy"));
  }
  // A week-long run evicts billions of times: keep the latest records only (between
  // kEvictionLogKeep and twice that; found by the soak test, tests/python/test_soak.py).
  if (eviction_log_.size() >= 2 * kEvictionLogKeep) {
    eviction_log_.erase(eviction_log_.begin(), eviction_log_.end() - kEvictionLogKeep);
  }
  eviction_log_.push_back(EvictionRecord{tracer_.iteration(), tracer_.moment(),
                                         tracer_.cursor() - 1, victim.id_, from, from + 1});
  tiers_[from].stats.evictions += 1;
  PS_LOG(kDebug, "evicting %s to '%s'", DescribeChunk(victim), tiers_[from + 1].stats.name);
  if (events_.enabled()) {
    events_.Eviction(victim.id_, from, from + 1, victim.payload_.bytes,
                     NextUseDistance(tracer_, victim.id_));
  }
  EventLog::EvictionScope evicting(events_);
  return Annotate(MoveTo(victim, from + 1, exclude),
                  absl::StrCat("evicting from '", tiers_[from].stats.name, "'"));
}

absl::StatusOr<Block> ChunkManager::AllocateWithEviction(int tier, int64_t bytes,
                                                         absl::Span<const ChunkId> exclude,
                                                         absl::string_view purpose) {
  TierSlot& slot = tiers_[tier];
  for (;;) {
    const int64_t allowed = AllowedChunkBytes(tier);
    if (allowed == kUnlimited || slot.chunk_bytes + bytes <= allowed) {
      absl::StatusOr<Block> block = slot.tier->Allocate(bytes);
      if (block.ok()) return block;
      if (!absl::IsResourceExhausted(block.status())) {
        return Annotate(block.status(), purpose);
      }
      // Pooled blocks of other sizes may hold the room: return empty slabs and try again.
      if (slot.tier->Trim() > 0) continue;
    }
    // A copy already leaving this tier (a started write-back, a prefetch out of it) frees its
    // source block when settled: waiting for it costs no new traffic, an eviction does.
    if (Chunk* leaving = PendingCopy(tier, exclude, /*into=*/false); leaving != nullptr) {
      PS_RETURN_IF_ERROR(FinishPrefetch(*leaving));
      continue;
    }
    Chunk* victim = ChooseVictim(tier, exclude);
    if (victim == nullptr) {
      // A prefetch may only use room that was free (Note [Prefetch]), but when the moment's
      // real demand exceeds the trace's (a gather, another iteration's control flow) a pending
      // copy into this tier must not make an access fail: settle it, and it becomes an
      // evictable chunk.
      if (Chunk* pending = PendingCopy(tier, exclude, /*into=*/true); pending != nullptr) {
        PS_RETURN_IF_ERROR(FinishPrefetch(*pending));
        continue;
      }
      int64_t pinned_bytes = 0;
      for (const Chunk& chunk : chunks_) {
        if (chunk.tier_index_ == tier && chunk.pinned()) pinned_bytes += chunk.payload_.bytes;
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          purpose, ": tier '", slot.stats.name, "' (", TierKindName(slot.stats.kind),
          ") cannot take ", FormatBytes(bytes), ": budget ", FormatBytes(slot.budget_bytes),
          ", non-model data ", FormatBytes(tracer_.NonModelBytes(tier)), ", chunks in use ",
          FormatBytes(slot.chunk_bytes), " of which ", FormatBytes(pinned_bytes),
          " pinned (COMPUTE or copy in flight), nothing left to evict"));
    }
    PS_RETURN_IF_ERROR(Evict(*victim, exclude));
  }
}

Chunk* ChunkManager::PendingCopy(int tier, absl::Span<const ChunkId> exclude, bool into) {
  for (Chunk& chunk : chunks_) {
    if (chunk.pending_.has_value() && !Contains(exclude, chunk.id_) &&
        (into ? chunk.pending_->tier_index : chunk.tier_index_) == tier) {
      return &chunk;
    }
  }
  return nullptr;
}

absl::Status ChunkManager::MoveTo(Chunk& chunk, int tier, absl::Span<const ChunkId> exclude) {
  PS_CHECK(chunk.has_payload() && chunk.tier_index_ != tier && !chunk.pending_.has_value(),
           "MoveTo needs a settled payload elsewhere");
  const std::vector<ChunkId> keep = With(exclude, chunk.id_);
  PS_ASSIGN_OR_RETURN(Block destination,
                      AllocateWithEviction(tier, chunk.payload_.bytes, keep,
                                           absl::StrCat("moving ", DescribeChunk(chunk), " to '",
                                                        tiers_[tier].stats.name, "'")));
  PS_ASSIGN_OR_RETURN(const CopyHandle handle,
                      IssueCopy(chunk, destination, tier, /*prefetch=*/false,
                                absl::StrCat("moving ", DescribeChunk(chunk))));
  return SettleCopy(chunk, destination, tier, handle, "moving");
}

absl::StatusOr<CopyHandle> ChunkManager::IssueCopy(Chunk& chunk, const Block& destination,
                                                   int tier, bool prefetch,
                                                   absl::string_view purpose) {
  AddChunkBytes(tier, destination.bytes);
  absl::StatusOr<CopyHandle> handle = options_.copy_engine->Copy(chunk.payload_, destination);
  if (!handle.ok()) {
    AbandonDestination(destination, tier);
    return Annotate(handle.status(), purpose);
  }
  events_.CopyIssued(chunk.id_, chunk.tier_index_, tier, chunk.payload_.bytes, prefetch);
  return handle;
}

void ChunkManager::AbandonDestination(const Block& destination, int tier) {
  AddChunkBytes(tier, -destination.bytes);
  absl::Status freed = destination.tier->Free(destination);
  if (!freed.ok()) PS_LOG(kWarning, "chunk manager: %s", freed.ToString());
}

absl::Status ChunkManager::SettleCopy(Chunk& chunk, const Block& destination, int tier,
                                      const CopyHandle& handle, absl::string_view what) {
  const absl::Time start = absl::Now();
  absl::Status copied = handle.Wait();
  const int64_t waited_ns = absl::ToInt64Nanoseconds(absl::Now() - start);
  tiers_[tier].stats.copy_wait_ns += waited_ns;
  events_.CopySettled(chunk.id_, waited_ns, copied.ok());
  if (!copied.ok()) {
    AbandonDestination(destination, tier);
    return Annotate(copied, absl::StrCat(what, " ", DescribeChunk(chunk)));
  }
  const int from = chunk.tier_index_;
  const int64_t moved = chunk.payload_.bytes;
  PS_RETURN_IF_ERROR(chunk.payload_.tier->Free(chunk.payload_));
  AddChunkBytes(from, -moved);
  tiers_[from].stats.bytes_out += moved;
  tiers_[from].stats.chunks_out += 1;
  tiers_[tier].stats.bytes_in += moved;
  tiers_[tier].stats.chunks_in += 1;
  SetPayload(chunk, destination, tier);
  return absl::OkStatus();
}

absl::Status ChunkManager::FinishPrefetch(Chunk& chunk) {
  const Chunk::PendingCopy pending = *chunk.pending_;
  chunk.pending_.reset();
  PS_RETURN_IF_ERROR(
      SettleCopy(chunk, pending.destination, pending.tier_index, pending.handle, "prefetching"));
  chunk.prefetched_tier_ = pending.tier_index;
  return absl::OkStatus();
}

absl::Status ChunkManager::FinishAllPrefetches() {
  for (Chunk& chunk : chunks_) {
    if (chunk.pending_.has_value()) PS_RETURN_IF_ERROR(FinishPrefetch(chunk));
  }
  return absl::OkStatus();
}

// Note [Prefetch]
// After warm-up, at each Tick the accesses recorded for the next `prefetch_moments` moments are
// walked in order; a chunk that will be accessed in a tier it is not in gets an asynchronous copy
// there, but only into room that is free for the whole window (the smallest B - N over those
// moments, from the trace) and only if the tier hands out a block without evicting anything:
// a prefetch never displaces a chunk, so it can only save copies, never add them. The chunk stays
// where it is, pinned, until Access or the next Tick settles the copy (waiting for it if needed).
// Settling every prefetch at the next Tick, rather than whenever a copy happens to be done, keeps
// the pinned set, and so every eviction choice, independent of copy timing: runs are
// reproducible. A copy still overlaps the compute of the moment it was issued in.
absl::Status ChunkManager::IssuePrefetches() {
  if (options_.prefetch_moments == 0 || tracer_.warming_up()) return absl::OkStatus();
  const std::vector<AccessRecord>& accesses = tracer_.accesses();
  const int64_t horizon = tracer_.moment() + options_.prefetch_moments;
  for (int64_t position = tracer_.cursor();
       position < static_cast<int64_t>(accesses.size()) && accesses[position].moment <= horizon;
       ++position) {
    const AccessRecord& access = accesses[position];
    Chunk& chunk = chunks_[access.chunk];
    const int tier = access.tier;
    if (chunk.tier_index_ == tier || chunk.pinned() || !chunk.has_payload()) continue;
    TierSlot& slot = tiers_[tier];
    if (slot.budget_bytes != 0) {
      int64_t window_allowed = kUnlimited;
      for (int64_t m = tracer_.moment(); m <= horizon; ++m) {
        window_allowed = std::min(
            window_allowed, slot.budget_bytes - std::max(tracer_.NonModelBytes(tier),
                                                         tracer_.TracedNonModelBytes(tier, m)));
      }
      if (slot.chunk_bytes + chunk.payload_.bytes > window_allowed) continue;
    }
    absl::StatusOr<Block> destination = slot.tier->Allocate(chunk.payload_.bytes);
    if (!destination.ok()) {
      if (absl::IsResourceExhausted(destination.status())) continue;
      return Annotate(destination.status(), absl::StrCat("prefetching ", DescribeChunk(chunk)));
    }
    PS_ASSIGN_OR_RETURN(const CopyHandle handle,
                        IssueCopy(chunk, *destination, tier, /*prefetch=*/true,
                                  absl::StrCat("prefetching ", DescribeChunk(chunk))));
    chunk.pending_ = Chunk::PendingCopy{*destination, tier, handle};
    slot.stats.prefetch_issued += 1;
  }
  return absl::OkStatus();
}

absl::Status ChunkManager::MakeResident(Chunk& chunk, int tier) {
  if (chunk.pending_.has_value()) PS_RETURN_IF_ERROR(FinishPrefetch(chunk));
  if (chunk.tier_index_ == tier) {
    if (chunk.prefetched_tier_ == tier) tiers_[tier].stats.prefetch_hits += 1;
    chunk.prefetched_tier_ = -1;
    return absl::OkStatus();
  }
  if (!chunk.has_payload()) {
    // Note [Zero-filled chunks]: a chunk with no payload holds nothing anybody wrote on this
    // rank (all its tensors FREE or RELEASED), so a fresh, zeroed block is a faithful payload;
    // for RELEASED tensors the caller gathers the data into it (PlanGather). The zeros are
    // written by the copy engine: a device block is not host memory (a cudaMalloc pointer the
    // host writes crashes the process), so it gets a cudaMemsetAsync that is complete before
    // the chunk is handed out, like any copy into the device.
    PS_ASSIGN_OR_RETURN(Block block,
                        AllocateWithEviction(tier, chunk.bytes(), {chunk.id_},
                                             absl::StrCat("placing ", DescribeChunk(chunk))));
    if (absl::Status filled = options_.copy_engine->Fill(block, 0); !filled.ok()) {
      if (absl::Status freed = block.tier->Free(block); !freed.ok()) {
        PS_LOG(kWarning, "chunk manager: %s", freed.ToString());
      }
      return Annotate(filled, absl::StrCat("zero-filling ", DescribeChunk(chunk)));
    }
    AddChunkBytes(tier, block.bytes);
    tiers_[tier].stats.zero_fills += 1;
    events_.ZeroFill(chunk.id_, tier, block.bytes);
    SetPayload(chunk, block, tier);
    return absl::OkStatus();
  }
  if (!tracer_.warming_up()) tiers_[tier].stats.prefetch_misses += 1;
  return MoveTo(chunk, tier, {});
}

absl::Status ChunkManager::DropPayload(Chunk& chunk) {
  if (chunk.pending_.has_value()) PS_RETURN_IF_ERROR(FinishPrefetch(chunk));
  if (!chunk.has_payload()) return absl::OkStatus();
  events_.Drop(chunk.id_, chunk.tier_index_, chunk.payload_.bytes);
  PS_RETURN_IF_ERROR(chunk.payload_.tier->Free(chunk.payload_));
  AddChunkBytes(chunk.tier_index_, -chunk.payload_.bytes);
  SetPayload(chunk, Block{}, -1);
  return absl::OkStatus();
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

absl::Status ChunkManager::MoveChunk(ChunkId id, TierKind tier_kind) {
  PS_RETURN_IF_ERROR(CheckBuilt("move chunk"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  Chunk& target_chunk = chunks_[found->id_];
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (target_chunk.compute_tensors_ > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("move ", DescribeChunk(target_chunk), " to '", tiers_[tier].stats.name,
                     "': ", target_chunk.compute_tensors_, " of its tensors are COMPUTE"));
  }
  if (target_chunk.pending_.has_value()) PS_RETURN_IF_ERROR(FinishPrefetch(target_chunk));
  if (!target_chunk.has_payload()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "move ", DescribeChunk(target_chunk), ": it has no payload (no tensor holds data)"));
  }
  if (target_chunk.tier_index_ == tier) return absl::OkStatus();
  EventLog::TriggerScope trigger(events_, EventTrigger::kExplicit, target_chunk.id_);
  return MoveTo(target_chunk, tier, {});
}

// Note [Started moves]
// StartMove is a prefetch asked for by name: the optimizer sweep reads the next row's NVMe-resident
// chunks into host memory while it updates the current row, and writes an updated row back while
// it reads the next (Note [Optimizer sweep] in python/patrickstar/engine.py). The copy is pending
// exactly like a prefetch (Note [Prefetch]): the chunk stays where it is, pinned, until Access,
// Tick, EndIteration, MoveChunk or an allocation that needs its room settles it, so settling, and
// with it every eviction choice, does not depend on copy timing. Unlike a trace prefetch it may
// evict to get its destination block: the caller needs this chunk there next. A failed copy
// leaves the chunk where it was with its bytes intact (an NVMe slot that was being written stays
// invalid, Note [NVMe write validity]), and the error surfaces where the copy is settled, naming
// the chunk and, for NVMe, the file, offset and bytes.
absl::StatusOr<bool> ChunkManager::StartMove(ChunkId id, TierKind tier_kind) {
  PS_RETURN_IF_ERROR(CheckBuilt("start move"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  Chunk& target = chunks_[found->id_];
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (target.pinned() || !target.has_payload() || target.tier_index_ == tier) return false;
  EventLog::TriggerScope trigger(events_, EventTrigger::kExplicit, target.id_);
  const std::string purpose = absl::StrCat("starting to move ", DescribeChunk(target), " to '",
                                           tiers_[tier].stats.name, "'");
  PS_ASSIGN_OR_RETURN(Block destination,
                      AllocateWithEviction(tier, target.payload_.bytes, {target.id_}, purpose));
  const bool upward = tier < target.tier_index_;
  PS_ASSIGN_OR_RETURN(const CopyHandle handle,
                      IssueCopy(target, destination, tier, /*prefetch=*/upward, purpose));
  if (upward) tiers_[tier].stats.prefetch_issued += 1;
  target.pending_ = Chunk::PendingCopy{destination, tier, handle};
  return true;
}

absl::StatusOr<std::optional<TierKind>> ChunkManager::ChunkTier(ChunkId id) const {
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  if (!found->has_payload()) return std::optional<TierKind>();
  return std::optional<TierKind>(tiers_[found->tier_index_].stats.kind);
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

// ---- Communication groups --------------------------------------------------------------------

bool ChunkManager::IsLocal(ChunkId chunk) const {
  return chunks_[chunk].owner_rank_ == options_.rank;
}

absl::StatusOr<GatherPlan> ChunkManager::PlanGather(TensorId id) const {
  PS_RETURN_IF_ERROR(CheckBuilt("plan gather"));
  PS_ASSIGN_OR_RETURN(const TensorInfo* tensor, this->tensor(id));
  const Chunk& chunk = chunks_[tensor->chunk];
  GatherPlan plan;
  plan.kind = chunk.kind_;
  plan.group = chunk.group_;
  const ChunkId first = FirstOfGroup(chunk);
  for (int r = 0; r < options_.world_size; ++r) {
    const Chunk& member = chunks_[first + r];
    plan.chunks.push_back(member.id_);
    if (member.owner_rank_ == options_.rank) plan.local_chunk = member.id_;
    if (member.owner_rank_ == options_.rank || member.has_payload()) continue;
    const bool released =
        std::any_of(member.tensors_.begin(), member.tensors_.end(),
                    [&](TensorId t) { return tensors_[t].state == TensorState::kReleased; });
    if (released) plan.to_receive.push_back(member.id_);
  }
  plan.needs_gather = released_groups_.contains(first) || !plan.to_receive.empty();
  return plan;
}

ChunkId ChunkManager::FirstOfGroup(const Chunk& chunk) const {
  // Chunks of one list are contiguous in id order (Adopt), so a group is a contiguous range.
  return chunk.id_ - (chunk.index_in_list_ - chunk.group_ * options_.world_size);
}

std::vector<ChunkId> ChunkManager::ReleasableGroups() const {
  std::vector<ChunkId> firsts;
  for (const Chunk& first : chunks_) {
    if (first.index_in_list_ % options_.world_size != 0 || released_groups_.contains(first.id_)) {
      continue;
    }
    bool all_used = true;
    bool any_tensor = false;
    for (int r = 0; r < options_.world_size && all_used; ++r) {
      const Chunk& member = chunks_[first.id_ + r];
      any_tensor |= !member.tensors_.empty();
      all_used =
          !member.pinned() &&
          std::all_of(member.tensors_.begin(), member.tensors_.end(), [&](TensorId t) {
            const TensorState state = tensors_[t].state;
            return state == TensorState::kHoldAfterFwd || state == TensorState::kHoldAfterBwd;
          });
    }
    if (all_used && any_tensor) firsts.push_back(first.id_);
  }
  return firsts;
}

absl::Status ChunkManager::ReleaseGroup(ChunkId id) {
  PS_RETURN_IF_ERROR(CheckBuilt("release group"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  const ChunkId first = FirstOfGroup(*found);
  // Check every member first so a refusal changes nothing.
  for (int r = 0; r < options_.world_size; ++r) {
    const Chunk& member = chunks_[first + r];
    if (member.compute_tensors_ > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "release group ", member.group_, " of ", ChunkKindName(member.kind_), ": ",
          DescribeChunk(member), " has ", member.compute_tensors_, " tensors in COMPUTE"));
    }
    if (IsLocal(member.id_)) continue;
    for (TensorId t : member.tensors_) {
      if (HoldsData(tensors_[t].state)) {
        PS_RETURN_IF_ERROR(
            CheckTransition(tensors_[t].name, tensors_[t].state, TensorState::kReleased));
      }
    }
  }
  for (int r = 0; r < options_.world_size; ++r) {
    Chunk& member = chunks_[first + r];
    if (IsLocal(member.id_)) continue;
    for (TensorId t : member.tensors_) {
      if (HoldsData(tensors_[t].state)) tensors_[t].state = TensorState::kReleased;
    }
    PS_RETURN_IF_ERROR(DropPayload(member));
  }
  released_groups_.insert(first);
  return absl::OkStatus();
}

absl::Status ChunkManager::CompleteGather(ChunkId id) {
  PS_RETURN_IF_ERROR(CheckBuilt("complete gather"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  const ChunkId first = FirstOfGroup(*found);
  for (int r = 0; r < options_.world_size; ++r) {
    const Chunk& member = chunks_[first + r];
    for (TensorId t : member.tensors_) {
      if (tensors_[t].state == TensorState::kReleased && !member.has_payload()) {
        return absl::FailedPreconditionError(
            absl::StrCat("complete gather of group ", member.group_, " of ",
                         ChunkKindName(member.kind_), ": ", DescribeChunk(member),
                         " was not received (tensor '", tensors_[t].name, "' is RELEASED)"));
      }
    }
  }
  released_groups_.erase(first);
  return absl::OkStatus();
}

absl::Status ChunkManager::MaterializeGathered(
    ChunkId id, TierKind tier_kind, absl::FunctionRef<absl::Status(void*, int64_t)> fill) {
  PS_RETURN_IF_ERROR(CheckBuilt("materialize gathered chunk"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  Chunk& remote = chunks_[found->id_];
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  if (tier_kind == TierKind::kNvme) {
    return absl::InvalidArgumentError(absl::StrCat("materialize ", DescribeChunk(remote),
                                                   ": a gather needs a memory tier, not NVMe"));
  }
  if (IsLocal(remote.id_) || remote.has_payload()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "materialize ", DescribeChunk(remote), ": only a remote chunk without a payload is ",
        "gathered (owner rank ", remote.owner_rank_, ", this rank ", options_.rank, ")"));
  }
  {
    EventLog::TriggerScope trigger(events_, EventTrigger::kGather, remote.id_);
    PS_RETURN_IF_ERROR(MakeResident(remote, tier));
  }
  // Pinned while the collective writes into it, so the fill cannot trigger its own eviction.
  remote.compute_tensors_ += 1;
  absl::Status filled = fill(remote.payload_.data(), remote.bytes());
  remote.compute_tensors_ -= 1;
  if (!filled.ok()) {
    PS_RETURN_IF_ERROR(DropPayload(remote));
    return Annotate(filled, absl::StrCat("gathering ", DescribeChunk(remote)));
  }
  for (TensorId t : remote.tensors_) {
    if (tensors_[t].state == TensorState::kReleased) {
      PS_RETURN_IF_ERROR(Transition(tensors_[t], TensorState::kHold));
    }
  }
  return absl::OkStatus();
}

// ---- Statistics ------------------------------------------------------------------------------

std::vector<TierChunkStats> ChunkManager::Stats() const {
  std::vector<TierChunkStats> result;
  for (int tier = 0; tier < num_tiers(); ++tier) {
    TierChunkStats stats = tiers_[tier].stats;
    stats.chunk_bytes = tiers_[tier].chunk_bytes;
    stats.non_model_bytes = tracer_.NonModelBytes(tier);
    stats.reserved_bytes = tiers_[tier].tier->stats().reserved_bytes;
    result.push_back(std::move(stats));
  }
  return result;
}

nlohmann::json ChunkManager::TierStatsJson() const {
  nlohmann::json tiers = nlohmann::json::array();
  for (const TierChunkStats& stats : Stats()) {
    tiers.push_back({{"name", stats.name},
                     {"kind", std::string(TierKindName(stats.kind))},
                     {"budget_bytes", stats.budget_bytes},
                     {"non_model_bytes", stats.non_model_bytes},
                     {"chunk_bytes", stats.chunk_bytes},
                     {"peak_chunk_bytes", stats.peak_chunk_bytes},
                     {"reserved_bytes", stats.reserved_bytes},
                     {"bytes_in", stats.bytes_in},
                     {"bytes_out", stats.bytes_out},
                     {"chunks_in", stats.chunks_in},
                     {"chunks_out", stats.chunks_out},
                     {"evictions", stats.evictions},
                     {"zero_fills", stats.zero_fills},
                     {"prefetch_issued", stats.prefetch_issued},
                     {"prefetch_hits", stats.prefetch_hits},
                     {"prefetch_misses", stats.prefetch_misses},
                     {"copy_wait_ns", stats.copy_wait_ns}});
  }
  return tiers;
}

nlohmann::json ChunkManager::ChunksJson(bool with_placement) const {
  nlohmann::json chunks = nlohmann::json::array();
  for (const Chunk& chunk : chunks_) {
    nlohmann::json tensors = nlohmann::json::array();
    for (TensorId id : chunk.tensors_) {
      const TensorInfo& tensor = tensors_[id];
      nlohmann::json entry = {{"id", id},
                              {"name", tensor.name},
                              {"offset", tensor.offset},
                              {"numel", tensor.numel},
                              {"shape", tensor.shape}};
      if (with_placement) entry["state"] = std::string(TensorStateName(tensor.state));
      tensors.push_back(std::move(entry));
    }
    nlohmann::json entry = {{"id", chunk.id_},
                            {"kind", std::string(ChunkKindName(chunk.kind_))},
                            {"dtype", std::string(DTypeName(chunk.dtype_))},
                            {"capacity_elements", chunk.capacity_elements_},
                            {"bytes", chunk.bytes()},
                            {"owner_rank", chunk.owner_rank_},
                            {"group", chunk.group_},
                            {"oversize", chunk.oversize_},
                            {"padding", chunk.padding_}};
    if (with_placement) {
      entry["tier"] = chunk.tier_index_ < 0 ? nlohmann::json(nullptr)
                                            : nlohmann::json(tiers_[chunk.tier_index_].stats.name);
    }
    entry["tensors"] = std::move(tensors);
    chunks.push_back(std::move(entry));
  }
  return chunks;
}

nlohmann::json ChunkManager::LayoutJson() const {
  return {{"world_size", options_.world_size},
          {"rank", options_.rank},
          {"hash", absl::StrFormat("%016x", layout_hash_)},
          {"chunks", ChunksJson(/*with_placement=*/false)}};
}

nlohmann::json ChunkManager::ToJson() const {
  nlohmann::json chunks = ChunksJson(/*with_placement=*/true);
  nlohmann::json tiers = TierStatsJson();
  nlohmann::json evictions = nlohmann::json::array();
  for (const EvictionRecord& record : eviction_log_) {
    evictions.push_back({{"iteration", record.iteration},
                         {"moment", record.moment},
                         {"position", record.position},
                         {"chunk", record.chunk},
                         {"from_tier", record.from_tier},
                         {"to_tier", record.to_tier}});
  }
  std::vector<std::string> oversize;
  for (int64_t index : plan_.oversize_tensors) oversize.push_back(specs_[index].name);
  return {{"world_size", options_.world_size},
          {"rank", options_.rank},
          {"eviction_policy", options_.eviction_policy == EvictionPolicy::kLru ? "lru" : "opt"},
          {"prefetch_moments", options_.prefetch_moments},
          {"layout",
           {{"built", built_},
            {"chunk_elements", plan_.chunk_elements},
            {"wasted_bytes", plan_.wasted_bytes},
            {"hash", absl::StrFormat("%016x", layout_hash_)},
            {"oversize_tensors", oversize},
            {"chunks", chunks}}},
          {"tiers", tiers},
          {"evictions", evictions},
          {"tracer", tracer_.ToJson()}};
}

std::string ChunkManager::DumpJson(int indent) const { return ToJson().dump(indent); }

// ---- Profiling -------------------------------------------------------------------------------

void ChunkManager::RecordMoment(bool end_of_iteration) {
  if (!events_.enabled()) return;
  std::vector<TierSample> samples;
  for (int tier = 0; tier < num_tiers(); ++tier) {
    samples.push_back(TierSample{tiers_[tier].chunk_bytes, tracer_.NonModelBytes(tier),
                                 tiers_[tier].budget_bytes});
  }
  events_.Moment(end_of_iteration, samples);
}

}  // namespace ps
