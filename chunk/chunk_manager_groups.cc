// ChunkManager: communication-group bookkeeping for data parallelism (the collectives are
// group_collectives.cc's).
#include "chunk/chunk_manager.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
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

// Note [FREE tensors in a reduced chunk]
// A chunk without a payload is zero-filled when it gets one (Note [Zero-filled chunks]), but a
// chunk that keeps its payload because some of its tensors hold data leaves the bytes of its
// FREE tensors as they were: a gradient freed by zero_grad keeps last step's values there. That
// is harmless until the chunk is the input of a reduce-scatter, which adds every byte of it: a
// gradient this rank did not produce this step (a branch it did not take), in a chunk it owns
// next to a tensor no rank produced a gradient for (which stays HOLD with its zeros), added the
// stale values to the other ranks' gradients. So the reduce-scatter zeroes FREE tensors first.
absl::Status ChunkManager::ZeroFreeTensors(ChunkId id) {
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  const Chunk& target = chunks_[found->id_];
  if (!target.has_payload()) return absl::OkStatus();
  const Block& payload = target.payload();
  if (payload.tier->address_space() == AddressSpace::kFile) {
    return absl::FailedPreconditionError(absl::StrCat(
        "zeroing the FREE tensors of ", DescribeChunk(target), ": its payload is a file range"));
  }
  const int64_t element = ElementSize(target.dtype_);
  // Runs of adjacent FREE tensors become one fill (a device fill waits for its stream).
  std::vector<std::pair<int64_t, int64_t>> runs;  // [begin, end) in elements
  for (TensorId t : target.tensors_) {
    const TensorInfo& info = tensors_[t];
    if (info.state != TensorState::kFree || info.numel == 0) continue;
    if (!runs.empty() && runs.back().second == info.offset) {
      runs.back().second += info.numel;
    } else {
      runs.emplace_back(info.offset, info.offset + info.numel);
    }
  }
  for (const auto& [begin, end] : runs) {
    Block range = payload;
    range.address += static_cast<uint64_t>(begin * element);
    range.bytes = (end - begin) * element;
    PS_RETURN_IF_ERROR(Annotate(options_.copy_engine->Fill(range, 0),
                                absl::StrCat("zeroing FREE tensors of ", DescribeChunk(target))));
  }
  return absl::OkStatus();
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
    if (IsLocal(member.id_) && !Remakeable(member.id_)) continue;
    for (TensorId t : member.tensors_) {
      if (HoldsData(tensors_[t].state)) {
        PS_RETURN_IF_ERROR(
            CheckTransition(tensors_[t].name, tensors_[t].state, TensorState::kReleased));
      }
    }
  }
  for (int r = 0; r < options_.world_size; ++r) {
    Chunk& member = chunks_[first + r];
    // The owner's chunk goes too when its master can make it again (Note [Compute chunks re-made
    // from the master] in chunk_manager_remake.cc).
    if (IsLocal(member.id_) && !Remakeable(member.id_)) continue;
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
    ChunkId id, TierKind tier_kind, absl::FunctionRef<absl::Status(void*, int64_t)> fill,
    bool evict) {
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
    PS_RETURN_IF_ERROR(MakeResident(remote, tier, evict));
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

}  // namespace ps
