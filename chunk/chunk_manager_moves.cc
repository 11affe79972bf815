// ChunkManager: copies between tiers, trace prefetch, started moves, residency and drops.
#include "chunk/chunk_manager.h"
#include "chunk/chunk_manager_internal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace ps {

using chunk_manager_internal::kUnlimited;
using chunk_manager_internal::Contains;
using chunk_manager_internal::With;

// ---- Copies and prefetch ---------------------------------------------------------------------

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

absl::Status ChunkManager::MakeResident(Chunk& chunk, int tier, bool evict) {
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
                                             absl::StrCat("placing ", DescribeChunk(chunk)),
                                             evict));
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
// chunks into host memory while it updates the current row, and writes an updated row back while it
// reads the next (Note [Optimizer sweep] in python/patrickstar/optimizer.py). The copy is pending
// exactly like a prefetch (Note [Prefetch]): the chunk stays where it is, pinned, until Access,
// Tick, EndIteration, MoveChunk or an allocation that needs its room settles it, so settling, and
// with it every eviction choice, does not depend on copy timing. Unlike a trace prefetch it may
// evict to get its destination block: the caller needs this chunk there next. A failed copy leaves
// the chunk where it was with its bytes intact (an NVMe slot that was being written stays invalid,
// Note [NVMe write validity]), and the error surfaces where the copy is settled, naming the chunk
// and, for NVMe, the file, offset and bytes.
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

}  // namespace ps
