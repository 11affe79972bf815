// ChunkManager: tier budgets, victim choice and eviction (where a chunk may live).
#include "chunk/chunk_manager.h"
#include "chunk/chunk_manager_internal.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace ps {

using chunk_manager_internal::kUnlimited;
using chunk_manager_internal::IsOptimizerState;
using chunk_manager_internal::Contains;

namespace {

// Note [Spill order]: which kinds leave a memory tier for NVMe first when nothing better is known.
// Optimizer state is touched once an iteration (the sweep), gradients twice, compute parameters
// in forward and backward, so without a trace this is the order of least harm; after warm-up OPT
// decides (it reaches the same order during forward and backward on its own) and this only breaks
// its ties.
int SpillRank(ChunkKind kind) {
  if (IsOptimizerState(kind)) return 0;
  return kind == ChunkKind::kGradient ? 1 : 2;
}

}  // namespace

// ---- Budgets and eviction --------------------------------------------------------------------

// Note [The trace forecasts, the report bounds]
// After warm-up a tier keeps room for the non-model data the warm-up trace recorded at the
// current moment (Note [Moments and the warm-up trace]), so activations find room before they
// are allocated. But moment m of a later iteration is the warm-up's moment m only while the loop
// repeats the warm-up's calls: an evaluation forward before the first step (its moments are in
// the trace, and every later iteration is shorter by them), a model that runs fewer modules
// later (an early exit, a lighter head) or a larger batch in the warm-up put a later moment m
// at another point of the model. The optimizer step of such an iteration ran at a moment the
// trace had at the activations' peak: with the activations all freed, streaming Adam's state
// through a host budget that training fits failed with "cannot take 16384 bytes: budget
// 606655 bytes, non-model data 589824 bytes, ... nothing left to evict", an error a plain loop
// does not have. So the forecast is what eviction aims at (AllowedChunkBytes), and only the
// non-model data reported now bounds what a tier can hold (ChunkBytesLimit): an access, or a
// report of more non-model data, fails only when even evicting everything unpinned leaves no
// room beside what is there now. Prefetches still use only room free under the forecast, and
// the Tier's own budget stays at the forecast but for the one block taken beyond it: with the
// Tier's budget at the limit throughout, its reservation could grow past the forecast at any
// access, and a two-rank NVMe run (test_boundary_sizes.py) then failed when its activations
// rose, that room being reserved and pinned.
int64_t ChunkManager::AllowedChunkBytes(int tier) const {
  const int64_t budget = tiers_[tier].budget_bytes;
  if (budget == 0) return kUnlimited;
  return budget - tracer_.NonModelBytes(tier);
}

int64_t ChunkManager::ChunkBytesLimit(int tier) const {
  const int64_t budget = tiers_[tier].budget_bytes;
  if (budget == 0) return kUnlimited;
  return budget - tracer_.ReportedNonModelBytes(tier);
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

absl::StatusOr<int64_t> ChunkManager::FreeChunkBytes(TierKind tier_kind) const {
  PS_ASSIGN_OR_RETURN(const int tier, TierIndex(tier_kind));
  const int64_t allowed = AllowedChunkBytes(tier);
  if (allowed == kUnlimited) return kUnlimited;
  return std::max<int64_t>(0, allowed - tiers_[tier].chunk_bytes);
}

void ChunkManager::AddChunkBytes(int tier, int64_t delta) {
  TierSlot& slot = tiers_[tier];
  slot.chunk_bytes += delta;
  slot.stats.peak_chunk_bytes = std::max(slot.stats.peak_chunk_bytes, slot.chunk_bytes);
  total_chunk_bytes_ += delta;
  peak_total_chunk_bytes_ = std::max(peak_total_chunk_bytes_, total_chunk_bytes_);
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
  const int64_t limit = ChunkBytesLimit(tier);
  // A Tier budget of 0 means "unlimited", so "no room at all" is a budget of one byte.
  PS_RETURN_IF_ERROR(slot.tier->SetBudget(std::max<int64_t>(allowed, 1)));
  // The last tier has nowhere to evict to: a victim there would only fail with "last tier of
  // the hierarchy", naming neither the budget nor the non-model data that outgrew it (a host
  // budget without NVMe, the previous batch's logits still alive at the next forward).
  const bool last_tier = tier + 1 >= num_tiers();
  while (slot.tier->stats().reserved_bytes > allowed) {
    if (slot.tier->Trim() > 0) continue;
    Chunk* victim = last_tier ? nullptr : ChooseVictim(tier, {});
    if (victim == nullptr) {
      // Note [The trace forecasts, the report bounds]
      if (slot.tier->stats().reserved_bytes <= limit) break;
      return absl::ResourceExhaustedError(absl::StrCat(
          "tier '", slot.stats.name, "' (", TierKindName(slot.stats.kind), "): budget ",
          FormatBytes(slot.budget_bytes), " minus non-model data ",
          FormatBytes(tracer_.ReportedNonModelBytes(tier)), " leaves ", FormatBytes(limit),
          " for chunks, but ", FormatBytes(slot.tier->stats().reserved_bytes), " are reserved ",
          last_tier ? "and it is the last tier, with nowhere to evict to"
                    : "and every chunk there is pinned (COMPUTE or a copy in flight)"));
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
                                                         absl::string_view purpose,
                                                         bool evict) {
  TierSlot& slot = tiers_[tier];
  // Why the tier itself last refused the allocation. On NVMe this can be the filesystem (a
  // fallocate failing with ENOSPC when the disk filled up under a budget larger than its free
  // space); the error below must say so and name the file, not only the budget numbers.
  absl::Status refused;
  bool beyond_forecast = false;  // Note [The trace forecasts, the report bounds]
  for (;;) {
    const int64_t allowed = beyond_forecast ? ChunkBytesLimit(tier) : AllowedChunkBytes(tier);
    if (allowed == kUnlimited || slot.chunk_bytes + bytes <= allowed) {
      // Beyond the forecast the Tier's own budget (Note [Budgets and non-model data]) is raised
      // to the limit for this one block only.
      if (beyond_forecast) PS_RETURN_IF_ERROR(slot.tier->SetBudget(std::max<int64_t>(allowed, 1)));
      absl::StatusOr<Block> block = slot.tier->Allocate(bytes);
      if (beyond_forecast) {
        PS_RETURN_IF_ERROR(
            slot.tier->SetBudget(std::max<int64_t>(AllowedChunkBytes(tier), 1)));
      }
      if (block.ok()) return block;
      if (!absl::IsResourceExhausted(block.status())) {
        return Annotate(block.status(), purpose);
      }
      refused = block.status();
      // Pooled blocks of other sizes may hold the room: return empty slabs and try again.
      if (slot.tier->Trim() > 0) continue;
    }
    // A copy already leaving this tier (a started write-back, a prefetch out of it) frees its
    // source block when settled: waiting for it costs no new traffic, an eviction does.
    if (Chunk* leaving = PendingCopy(tier, exclude, /*into=*/false); leaving != nullptr) {
      PS_RETURN_IF_ERROR(FinishPrefetch(*leaving));
      continue;
    }
    // The last tier has nowhere to evict to: a victim there would only fail with "last tier of
    // the hierarchy" and hide the reason (the budget or a full disk) reported below.
    const bool can_evict = evict && tier + 1 < num_tiers();
    Chunk* victim = can_evict ? ChooseVictim(tier, exclude) : nullptr;
    if (victim == nullptr) {
      // A prefetch may only use room that was free (Note [Prefetch]), but when the moment's
      // real demand exceeds the trace's (a gather, another iteration's control flow) a pending
      // copy into this tier must not make an access fail: settle it, and it becomes an
      // evictable chunk.
      Chunk* pending = evict ? PendingCopy(tier, exclude, /*into=*/true) : nullptr;
      if (pending != nullptr) {
        PS_RETURN_IF_ERROR(FinishPrefetch(*pending));
        continue;
      }
      // Nothing left to evict for the trace's forecast: an access may still use the room
      // beside the non-model data there now (a prefetch may not).
      if (evict && !beyond_forecast && ChunkBytesLimit(tier) > AllowedChunkBytes(tier)) {
        beyond_forecast = true;
        continue;
      }
      int64_t pinned_bytes = 0;
      for (const Chunk& chunk : chunks_) {
        if (chunk.tier_index_ == tier && chunk.pinned()) pinned_bytes += chunk.payload_.bytes;
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          purpose, ": tier '", slot.stats.name, "' (", TierKindName(slot.stats.kind),
          ") cannot take ", FormatBytes(bytes), ": budget ", FormatBytes(slot.budget_bytes),
          ", non-model data ", FormatBytes(tracer_.ReportedNonModelBytes(tier)),
          // Only when the forecast was the bound (a prefetch): an access was refused beside
          // the reported figure alone.
          !beyond_forecast && tracer_.NonModelBytes(tier) > tracer_.ReportedNonModelBytes(tier)
              ? absl::StrCat(" (", FormatBytes(tracer_.NonModelBytes(tier)),
                             " kept free for the warm-up trace's peak at this moment)")
              : std::string(),
          ", chunks in use ",
          FormatBytes(slot.chunk_bytes), " of which ", FormatBytes(pinned_bytes),
          " pinned (COMPUTE or copy in flight), ",
          !evict       ? "no free room and no eviction asked for"
          : can_evict  ? "nothing left to evict"
                       : "and it is the last tier, with nowhere to evict to",
          refused.ok() ? "" : absl::StrCat("; the tier refused: ", refused.message())));
    }
    PS_RETURN_IF_ERROR(Evict(*victim, exclude));
  }
}

}  // namespace ps
