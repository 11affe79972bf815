// ChunkManager: the owner's 16-bit compute chunks dropped between uses and made again from their
// fp32 masters.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "chunk/chunk_manager.h"
#include "runtime/status.h"

namespace ps {

// Note [Compute chunks re-made from the master]
// With data parallelism in fp16/bf16 and master weights, the owner of a compute-param chunk kept
// it between uses although its fp32 master chunk holds the same values, one conversion away: 2
// bytes per owned parameter that FSDP2 does not keep (it casts its fp32 shard for each gather;
// 18 against 16 B/param with gradient accumulation, docs/benchmarks.md). A chunk declared by
// SetRemakeSources is therefore released by ReleaseGroup like the remote members of its group
// (payload dropped, tensors RELEASED), and made again on this rank alone: by the gather of its
// group (GroupCollectives::IssueGather, before it pins the chunk to send it) and by any access
// of one of its tensors in between (Access: checkpoints, the owner reading a tensor after its
// group was released). No collective is involved, so the collective sequence is what it was.
// The values are exactly what the chunk held before, provided
//   * the conversion is the one the optimizer writes the compute copy with (its `param_copy`,
//     which the optimizer then drops for these chunks: the update writes only the master), and
//     initialization's torch copy_ agrees with it: both round to nearest even; they differ only
//     in the payload of a NaN (torch writes its canonical NaN, the kernel keeps the sign and
//     the high payload bits, as every step's param_copy did already);
//   * the master changes only through the optimizer, checkpoint loads and initialization, all
//     of which write the master whenever they write the compute copy;
//   * every tensor of the chunk has a master at the same offset of one master chunk: a chunk
//     with a frozen 16-bit parameter (no master, Note [Frozen parameters in 16 bits] in
//     engine.py) is not declared and keeps its payload.
// The master is staged by an access where it is when the host can read that memory, else in the
// host tier (which may bring it from NVMe and may evict to make room, like any access), and
// converted on the host into a payload placed where the caller computes when the host can write
// that memory (a gather: only into free room, as for the chunks it receives, Note [Receiving
// where the group is computed on] in group_collectives.h), else in the host tier: device memory
// is never touched by the host, and a chunk made in the host tier is pinned or moved like a
// received one.

absl::StatusOr<int64_t> ChunkManager::SetRemakeSources(
    absl::Span<const std::pair<TensorId, TensorId>> pairs, CastToCompute cast) {
  PS_RETURN_IF_ERROR(CheckBuilt("set remake sources"));
  PS_RETURN_IF_ERROR(TierIndex(TierKind::kHost).status());
  if (cast == nullptr) return absl::InvalidArgumentError("set remake sources: no conversion");
  absl::flat_hash_map<TensorId, TensorId> master_of;
  absl::flat_hash_map<ChunkId, ChunkId> source_of;
  absl::flat_hash_set<ChunkId> mismatched;
  for (const auto& [compute_id, master_id] : pairs) {
    PS_ASSIGN_OR_RETURN(const TensorInfo* compute, tensor(compute_id));
    PS_ASSIGN_OR_RETURN(const TensorInfo* master, tensor(master_id));
    const Chunk& compute_chunk = chunks_[compute->chunk];
    const Chunk& master_chunk = chunks_[master->chunk];
    if (compute_chunk.kind_ != ChunkKind::kComputeParam ||
        master_chunk.kind_ != ChunkKind::kMasterParam ||
        (compute->dtype != DType::kFloat16 && compute->dtype != DType::kBFloat16) ||
        master->dtype != DType::kFloat32 || compute->numel != master->numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "set remake sources: '", compute->name, "' (", ChunkKindName(compute_chunk.kind_),
          ", ", DTypeName(compute->dtype), ") cannot be made from '", master->name, "' (",
          ChunkKindName(master_chunk.kind_), ", ", DTypeName(master->dtype),
          "): a 16-bit compute param and its fp32 master of the same size are needed"));
    }
    if (!IsLocal(compute_chunk.id_)) continue;  // released as a remote chunk anyway
    master_of[compute_id] = master_id;
    const auto [it, inserted] = source_of.emplace(compute_chunk.id_, master_chunk.id_);
    if (it->second != master_chunk.id_ || compute->offset != master->offset ||
        !IsLocal(master_chunk.id_)) {
      mismatched.insert(compute_chunk.id_);
    }
  }
  remake_sources_.clear();
  master_of_.clear();
  for (const auto& [compute_chunk, master_chunk] : source_of) {
    const std::vector<TensorId>& members = chunks_[compute_chunk].tensors_;
    const bool all_paired = std::all_of(members.begin(), members.end(),
                                        [&](TensorId t) { return master_of.contains(t); });
    if (!all_paired || mismatched.contains(compute_chunk)) continue;
    remake_sources_[compute_chunk] = master_chunk;
    for (TensorId t : members) master_of_[t] = master_of[t];
  }
  cast_ = cast;
  return static_cast<int64_t>(remake_sources_.size());
}

absl::StatusOr<bool> ChunkManager::Remake(ChunkId id, std::optional<TierKind> tier_kind,
                                          bool evict) {
  PS_RETURN_IF_ERROR(CheckBuilt("re-make chunk"));
  PS_ASSIGN_OR_RETURN(const Chunk* found, chunk(id));
  Chunk& target = chunks_[found->id_];
  const auto source = remake_sources_.find(target.id_);
  if (source == remake_sources_.end() || target.has_payload()) return false;
  std::vector<TensorId> released;
  for (TensorId t : target.tensors_) {
    if (tensors_[t].state == TensorState::kReleased) released.push_back(t);
  }
  if (released.empty()) return false;
  Chunk& master = chunks_[source->second];
  PS_ASSIGN_OR_RETURN(const int host, TierIndex(TierKind::kHost));
  // Stage the master in host memory, pinned by an access of one of its tensors, unless it is
  // pinned there already (an optimizer row in progress): where it is (or is being moved to)
  // when that is host memory (the emulated device outside strict mode: moving it out would
  // copy 4 bytes per element twice per pass), else in the host tier (from NVMe or the device).
  TierKind stage_tier = TierKind::kHost;
  if (master.has_payload()) {
    const int where =
        master.prefetch_in_flight() ? master.pending_tier_index() : master.tier_index_;
    const Tier& tier = *tiers_[where].tier;
    if (tier.address_space() == AddressSpace::kHostMemory) stage_tier = tier.kind();
  }
  TensorId staged = -1;
  TensorState staged_state = TensorState::kHold;
  if (master.compute_tensors_ == 0) {
    for (TensorId t : master.tensors_) {
      if (HoldsData(tensors_[t].state)) {
        staged = t;
        staged_state = tensors_[t].state;
        break;
      }
    }
    if (staged >= 0) PS_RETURN_IF_ERROR(Access(staged, stage_tier).status());
  } else if (tiers_[master.tier_index_].tier->address_space() != AddressSpace::kHostMemory) {
    return absl::FailedPreconditionError(
        absl::StrCat("re-make ", DescribeChunk(target), ": its master ", DescribeChunk(master),
                     " is in use in device memory"));
  }
  absl::Status status = [&]() -> absl::Status {
    {
      EventLog::TriggerScope trigger(events_, EventTrigger::kGather, target.id_);
      // Zero-filled, where the caller will use it if the host can write there (the emulated
      // device tier outside strict mode), else in the host tier.
      absl::Status placed = absl::ResourceExhaustedError("no preferred tier");
      if (tier_kind.has_value() && *tier_kind != TierKind::kNvme) {
        PS_ASSIGN_OR_RETURN(const int preferred, TierIndex(*tier_kind));
        if (tiers_[preferred].tier->address_space() == AddressSpace::kHostMemory) {
          placed = MakeResident(target, preferred, evict);
          if (!placed.ok() && !absl::IsResourceExhausted(placed)) return placed;
        }
      }
      if (!placed.ok()) PS_RETURN_IF_ERROR(MakeResident(target, host));
    }
    const float* from = master.has_payload() ? static_cast<const float*>(master.payload_.data())
                                             : nullptr;
    auto* to = static_cast<uint16_t*>(target.payload_.data());
    for (TensorId t : released) {
      const TensorInfo& info = tensors_[t];
      const TensorInfo& source_info = tensors_[master_of_.at(t)];
      // A master without data is zeros, as the fresh payload already is.
      if (from == nullptr || !HoldsData(source_info.state)) continue;
      PS_RETURN_IF_ERROR(
          cast_(from + source_info.offset, to + info.offset, info.numel, target.dtype_));
    }
    for (TensorId t : released) PS_RETURN_IF_ERROR(Transition(tensors_[t], TensorState::kHold));
    return absl::OkStatus();
  }();
  if (staged >= 0) {
    absl::Status unstaged = Release(staged, staged_state);
    if (status.ok()) status = unstaged;
  }
  if (!status.ok()) {
    // As it was: no payload, its tensors RELEASED.
    for (TensorId t : released) tensors_[t].state = TensorState::kReleased;
    DropPayload(target).IgnoreError();
    return Annotate(status, absl::StrCat("re-making ", DescribeChunk(target), " from its master"));
  }
  remakes_ += 1;
  return true;
}

}  // namespace ps
