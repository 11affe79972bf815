#include "chunk/group_collectives.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace ps {

absl::StatusOr<std::unique_ptr<GroupCollectives>> GroupCollectives::Create(
    ChunkManager* manager, Communicator* communicator, GroupCollectiveOptions options) {
  if (manager == nullptr || communicator == nullptr) {
    return absl::InvalidArgumentError("group collectives: manager and communicator are required");
  }
  if (!manager->built()) {
    return absl::FailedPreconditionError("group collectives: build the chunk lists first");
  }
  if (manager->world_size() != communicator->world_size() ||
      manager->rank() != communicator->rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group collectives: the chunk manager is rank ", manager->rank(), " of ",
        manager->world_size(), " but the ", communicator->backend(), " communicator is rank ",
        communicator->rank(), " of ", communicator->world_size()));
  }
  // Note [Receiving where the group is computed on]: a compute tier the communicator cannot
  // write into (or none) receives nothing; the access moves the chunk there, as before.
  bool compute_tier_usable = false;
  for (int t = 0; t < manager->num_tiers(); ++t) {
    const Tier& tier = manager->tier(t);
    compute_tier_usable |= options.compute_tier == tier.kind() &&
                           tier.kind() != TierKind::kNvme &&
                           tier.address_space() == communicator->address_space();
  }
  if (!compute_tier_usable) options.compute_tier.reset();
  for (int t = 0; t < manager->num_tiers(); ++t) {
    const Tier& tier = manager->tier(t);
    if (tier.kind() != options.tier) continue;
    if (tier.address_space() != communicator->address_space()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group collectives: tier '", tier.name(), "' holds ",
          tier.address_space() == AddressSpace::kDeviceMemory ? "device" : "host",
          " memory but the ", communicator->backend(), " communicator needs ",
          communicator->address_space() == AddressSpace::kDeviceMemory ? "device" : "host",
          " memory"));
    }
    return std::unique_ptr<GroupCollectives>(new GroupCollectives(manager, communicator, options));
  }
  return absl::InvalidArgumentError(absl::StrCat("group collectives: the chunk manager has no ",
                                                 TierKindName(options.tier), " tier"));
}

std::vector<ChunkId> GroupCollectives::Groups(ChunkKind kind) const {
  std::vector<ChunkId> firsts;
  const std::vector<ChunkId> list = manager_->ChunksOfKind(kind);
  const size_t world = static_cast<size_t>(manager_->world_size());
  for (size_t i = 0; i + world <= list.size(); i += world) {
    bool any_tensor = false;
    for (size_t r = 0; r < world; ++r) {
      any_tensor |= !(*manager_->chunk(list[i + r]))->tensors().empty();
    }
    if (any_tensor) firsts.push_back(list[i]);
  }
  return firsts;
}

absl::StatusOr<ChunkId> GroupCollectives::GroupOf(TensorId tensor) const {
  PS_ASSIGN_OR_RETURN(const TensorInfo* info, manager_->tensor(tensor));
  PS_ASSIGN_OR_RETURN(const Chunk* chunk, manager_->chunk(info->chunk));
  return FirstOf(*chunk);
}

ChunkId GroupCollectives::FirstOf(const Chunk& chunk) const {
  return chunk.id() - chunk.index_in_list() % manager_->world_size();
}

std::string GroupCollectives::Label(ChunkId first) const {
  const Chunk* chunk = *manager_->chunk(first);
  return absl::StrCat(ChunkKindName(chunk->kind()), " group ", chunk->group());
}

absl::StatusOr<std::vector<ChunkId>> GroupCollectives::Members(ChunkId group, int64_t* count,
                                                               DType* dtype) const {
  PS_ASSIGN_OR_RETURN(const Chunk* any, manager_->chunk(group));
  const ChunkId first = FirstOf(*any);
  std::vector<ChunkId> members;
  const int64_t bytes = any->bytes();
  for (int r = 0; r < manager_->world_size(); ++r) {
    const Chunk* member = *manager_->chunk(first + r);
    if (member->bytes() != bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          Label(first), " has chunks of different sizes (", bytes, " and ", member->bytes(),
          " bytes): a layout that is not one of PlanLayout's (Note [Oversize groups] in "
          "chunk/chunk_layout.h gives an oversize tensor a group of equal-size chunks)"));
    }
    members.push_back(member->id());
  }
  *dtype = any->dtype();
  *count = bytes / ElementSize(any->dtype());
  return members;
}

absl::Status GroupCollectives::CheckNoneInUse(absl::Span<const ChunkId> members) const {
  for (ChunkId member : members) {
    for (TensorId t : (*manager_->chunk(member))->tensors()) {
      const TensorInfo* info = *manager_->tensor(t);
      if (info->state != TensorState::kCompute) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          Label(members.front()), ": tensor '", info->name, "' is in use (COMPUTE) when its ",
          "group's collective starts; the collective must come before any access of the group"));
    }
  }
  return absl::OkStatus();
}

void GroupCollectives::CountCollective(const Pending& pending, int64_t count, DType dtype,
                                       size_t buffers) {
  collectives_issued_ += static_cast<int64_t>(pending.handles.size());
  bytes_communicated_ += count * ElementSize(dtype) * static_cast<int64_t>(buffers);
}

int GroupCollectives::SoleHolder(absl::Span<const ChunkId> members) const {
  int holder = -1;
  for (size_t r = 0; r < members.size(); ++r) {
    const Chunk& chunk = **manager_->chunk(members[r]);
    if (!chunk.oversize()) return -1;
    if (chunk.tensors().empty()) continue;
    if (holder >= 0) return -1;
    holder = static_cast<int>(r);
  }
  return holder;
}

absl::StatusOr<void*> GroupCollectives::PinChunk(ChunkId id, bool zero_fill,
                                                 std::vector<Pin>* pins) {
  PS_ASSIGN_OR_RETURN(const Chunk* chunk, manager_->chunk(id));
  TensorId chosen = -1;
  for (TensorId t : chunk->tensors()) {
    const TensorState state = (*manager_->tensor(t))->state;
    if (HoldsData(state)) {
      chosen = t;
      break;
    }
    if (state == TensorState::kFree && chosen < 0) chosen = t;
  }
  if (chosen < 0) return nullptr;  // no tensor, or every tensor RELEASED (nothing to send)
  const TensorState before = (*manager_->tensor(chosen))->state;
  if (!HoldsData(before) && !chunk->has_payload() && !zero_fill) return nullptr;
  PS_RETURN_IF_ERROR(manager_->Access(chosen, TierFor(*chunk)).status());
  pins->push_back(Pin{chosen, before});
  PS_ASSIGN_OR_RETURN(chunk, manager_->chunk(id));
  return chunk->payload().data();
}

TierKind GroupCollectives::TierFor(const Chunk& chunk) const {
  // Without gradients_in_place, gradient chunks move to the collective's tier, so that a
  // pending reduce-scatter holds no device memory during backward. Moving one copies it,
  // holding it twice for a moment, and the owner's then went back to the compute tier for the
  // next micro-step's gradients (prefetched there, twice again): 4 MiB each on the peak of the
  // block stack of docs/benchmarks.md, whose emulated device tier the communicator can address
  // (another rank's chunk in backward; the owner's accumulated shard with gradient
  // accumulation). So with gradients_in_place both are pinned where they are when the
  // communicator can address that memory, as parameter chunks are; the owner's receives the
  // reduced gradient there, and the optimizer reads it there (Note [Optimizer sweep] in
  // optimizer.py).
  if (!chunk.has_payload() ||
      (chunk.kind() == ChunkKind::kGradient && !options_.gradients_in_place)) {
    return options_.tier;
  }
  // A chunk with a copy in flight (a prefetch for the access after this collective) is pinned
  // where the copy lands: pinning it at its source would settle the copy and move it straight
  // back (Note [Pinning a group for a collective]).
  const int where =
      chunk.prefetch_in_flight() ? chunk.pending_tier_index() : chunk.tier_index();
  const Tier& tier = manager_->tier(where);
  const bool usable =
      tier.kind() != TierKind::kNvme && tier.address_space() == communicator_->address_space();
  return usable ? tier.kind() : options_.tier;
}

absl::Status GroupCollectives::Unpin(std::vector<Pin>& pins) {
  absl::Status first_error;
  for (const Pin& pin : pins) {
    absl::Status status = manager_->Release(pin.tensor, pin.restore);
    if (first_error.ok()) first_error = status;
  }
  pins.clear();
  return first_error;
}

absl::Status GroupCollectives::WaitAll(const std::vector<CollectiveHandle>& handles) const {
  absl::Status first_error;
  for (const CollectiveHandle& handle : handles) {
    absl::Status status = handle.Wait(options_.timeout);
    if (first_error.ok()) first_error = status;
  }
  return first_error;
}

GroupCollectives::~GroupCollectives() {
  // The communicator may still be writing into the buffers of started gathers: wait for them
  // before their chunks can be unpinned and freed. One that does not finish (a dead peer)
  // stays pinned: its memory is leaked rather than reused under a late write.
  for (Pending& pending : gathers_) {
    if (WaitAll(pending.handles).ok()) Unpin(pending.pins).IgnoreError();
  }
  for (Pending& pending : abandoned_) {
    const bool done = std::all_of(pending.handles.begin(), pending.handles.end(),
                                  [](const CollectiveHandle& h) { return h.done(); });
    if (done) Unpin(pending.pins).IgnoreError();
  }
}

absl::Status GroupCollectives::PlaceReceived(ChunkId chunk, bool compute_tier_allowed) {
  const auto no_fill = [](void*, int64_t) { return absl::OkStatus(); };
  if (compute_tier_allowed && options_.compute_tier.has_value() &&
      *options_.compute_tier != options_.tier) {
    // Note [Receiving where the group is computed on]: free room only, no eviction.
    absl::Status placed =
        manager_->MaterializeGathered(chunk, *options_.compute_tier, no_fill, /*evict=*/false);
    if (!absl::IsResourceExhausted(placed)) return placed;
  }
  return manager_->MaterializeGathered(chunk, options_.tier, no_fill);
}

bool GroupCollectives::StartedFitComputeTier(const GatherPlan& plan, int64_t count,
                                             DType dtype) const {
  if (!options_.started_in_compute_tier || !options_.compute_tier.has_value()) return false;
  const absl::StatusOr<int64_t> free = manager_->FreeChunkBytes(*options_.compute_tier);
  if (!free.ok()) return false;
  const int64_t placed = static_cast<int64_t>(plan.to_receive.size() + 1) * count *
                         ElementSize(dtype);
  return *free >= 2 * placed;
}

absl::StatusOr<std::optional<GroupCollectives::Pending>> GroupCollectives::IssueGather(
    ChunkId group, bool started) {
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  PS_ASSIGN_OR_RETURN(const std::vector<ChunkId> members, Members(group, &count, &dtype));
  TensorId probe = -1;
  for (ChunkId member : members) {
    const Chunk* chunk = *manager_->chunk(member);
    if (!chunk->tensors().empty()) {
      probe = chunk->tensors().front();
      break;
    }
  }
  if (probe < 0) return std::nullopt;  // a group of padding chunks: nothing to gather anywhere
  PS_ASSIGN_OR_RETURN(const GatherPlan plan, manager_->PlanGather(probe));
  if (!plan.needs_gather) return std::nullopt;
  PS_RETURN_IF_ERROR(CheckNoneInUse(members));
  // The owner's dropped chunk is made again from its master before it is sent (Note [Compute
  // chunks re-made from the master] in chunk/chunk_manager_remake.cc): in the compute tier
  // when it has free room, evicting nothing, else in the host tier. A started gather too: its
  // local chunk was pinned where it lived, the compute tier, before it was ever dropped, and
  // made in the host tier it is copied up at its first use (holding it twice: 2 MiB on the
  // per-rank peak of docs/benchmarks.md's bf16 run with accumulation at 2 ranks, measured).
  const bool compute_tier_allowed = !started || StartedFitComputeTier(plan, count, dtype);
  if (plan.local_chunk >= 0) {
    PS_RETURN_IF_ERROR(manager_
                           ->Remake(plan.local_chunk,
                                    compute_tier_allowed ? options_.compute_tier : std::nullopt,
                                    /*evict=*/false)
                           .status());
  }
  Pending pending;
  pending.first = members.front();
  std::vector<void*> buffers(members.size(), nullptr);
  absl::Status status;
  for (size_t r = 0; r < members.size() && status.ok(); ++r) {
    const ChunkId member = members[r];
    if (member == plan.local_chunk) {
      absl::StatusOr<void*> pinned = PinChunk(member, /*zero_fill=*/false, &pending.pins);
      status = pinned.status();
      if (pinned.ok()) buffers[r] = *pinned;
    } else if (std::find(plan.to_receive.begin(), plan.to_receive.end(), member) !=
               plan.to_receive.end()) {
      // The bytes arrive with the collective below; until then the tensors are HOLD over
      // uninitialized memory, pinned, and nobody reads them.
      status = PlaceReceived(member, compute_tier_allowed);
      if (!status.ok()) break;
      absl::StatusOr<void*> pinned = PinChunk(member, /*zero_fill=*/false, &pending.pins);
      status = pinned.status();
      if (pinned.ok()) buffers[r] = *pinned;
    }
  }
  if (!status.ok()) {
    Unpin(pending.pins).IgnoreError();  // the first error is the one to report
    manager_->ReleaseGroup(pending.first).IgnoreError();  // drop what was materialized
    return status;
  }
  const std::string label = Label(pending.first);
  const int holder = SoleHolder(members);
  if (holder >= 0) {
    // Note [One holder, one broadcast].
    pending.handles.push_back(communicator_->Broadcast(buffers[holder], count, dtype, holder,
                                                       absl::StrCat(label, ", oversize")));
  } else if (options_.memory_saving) {
    for (size_t r = 0; r < members.size(); ++r) {
      pending.handles.push_back(communicator_->Broadcast(
          buffers[r], count, dtype, static_cast<int>(r), absl::StrCat(label, ", chunk ", r)));
    }
  } else {
    pending.handles.push_back(communicator_->AllGather(buffers, count, dtype, label));
  }
  CountCollective(pending, count, dtype, holder >= 0 ? 1 : members.size());
  return pending;
}

absl::Status GroupCollectives::FinishGathersThrough(size_t index) {
  for (size_t i = 0; i <= index; ++i) {
    Pending pending = std::move(gathers_.front());
    gathers_.pop_front();
    absl::Status status = WaitAll(pending.handles);
    if (status.ok()) status = Unpin(pending.pins);
    if (status.ok()) status = manager_->CompleteGather(pending.first);
    if (status.ok()) continue;
    // Note [Started gathers]: a failed collective is reported at once, naming it; the ones
    // queued behind it are not waited for (they would fail or time out in turn). Their chunks
    // stay pinned, as the communicator may still write into them, and the groups stay
    // ungathered.
    abandoned_.push_back(std::move(pending));
    while (!gathers_.empty()) {
      abandoned_.push_back(std::move(gathers_.front()));
      gathers_.pop_front();
    }
    return status;
  }
  return absl::OkStatus();
}

int GroupCollectives::FindStartedGather(ChunkId first) const {
  for (size_t i = 0; i < gathers_.size(); ++i) {
    if (gathers_[i].first == first) return static_cast<int>(i);
  }
  return -1;
}

absl::StatusOr<bool> GroupCollectives::StartGather(ChunkId group) {
  PS_ASSIGN_OR_RETURN(const Chunk* any, manager_->chunk(group));
  if (FindStartedGather(FirstOf(*any)) >= 0) {
    return false;  // already on its way
  }
  absl::StatusOr<std::optional<Pending>> pending = IssueGather(group, /*started=*/true);
  if (absl::IsResourceExhausted(pending.status())) {
    // No room to pin the group now (Note [Started gathers]): nothing was issued and the group
    // is as it was, so the Gather that needs it issues it, at the same place in the sequence.
    gathers_declined_ += 1;
    return false;
  }
  PS_RETURN_IF_ERROR(pending.status());
  if (!pending->has_value()) return false;
  gathers_.push_back(**std::move(pending));
  gathers_started_ += 1;
  return true;
}

absl::StatusOr<bool> GroupCollectives::Gather(ChunkId group) {
  PS_ASSIGN_OR_RETURN(const Chunk* any, manager_->chunk(group));
  const int started = FindStartedGather(FirstOf(*any));
  if (started >= 0) {
    // Finish it and every gather started before it, in issue order.
    PS_RETURN_IF_ERROR(FinishGathersThrough(static_cast<size_t>(started)));
    return true;
  }
  PS_ASSIGN_OR_RETURN(std::optional<Pending> pending, IssueGather(group, /*started=*/false));
  if (!pending.has_value()) return false;
  gathers_.push_back(*std::move(pending));
  PS_RETURN_IF_ERROR(FinishGathersThrough(gathers_.size() - 1));
  return true;
}

absl::Status GroupCollectives::FinishGathers() {
  if (gathers_.empty()) return absl::OkStatus();
  return FinishGathersThrough(gathers_.size() - 1);
}

absl::Status GroupCollectives::ReleaseAll(ChunkKind kind) {
  // A started gather pins its chunks and is still writing into them: finish it first.
  if (kind == ChunkKind::kComputeParam) PS_RETURN_IF_ERROR(FinishGathers());
  // Every group, on every rank, whether or not this rank holds a remote payload of it (it may
  // own all of a group's tensors): whether a later Gather runs its collective must not depend
  // on the rank (Note [Collective order]).
  for (ChunkId first : Groups(kind)) PS_RETURN_IF_ERROR(manager_->ReleaseGroup(first));
  return absl::OkStatus();
}

absl::Status GroupCollectives::StartReduceScatter(ChunkId group, std::optional<ReduceOp> op) {
  const ReduceOp reduce_op = op.value_or(options_.gradient_op);
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  PS_ASSIGN_OR_RETURN(const std::vector<ChunkId> members, Members(group, &count, &dtype));
  PS_RETURN_IF_ERROR(CheckNoneInUse(members));
  Pending pending;
  pending.first = members.front();
  std::vector<void*> buffers(members.size(), nullptr);
  absl::Status status;
  for (size_t r = 0; r < members.size() && status.ok(); ++r) {
    const bool local = manager_->IsLocal(members[r]);
    // The local chunk needs a payload to receive the result even if this rank has no gradient
    // in it; remote chunks without data contribute zeros.
    absl::StatusOr<void*> pinned = PinChunk(members[r], /*zero_fill=*/local, &pending.pins);
    status = pinned.status();
    if (pinned.ok()) buffers[r] = *pinned;
    // Note [FREE tensors in a reduced chunk] (chunk_manager_groups.cc).
    if (status.ok() && buffers[r] != nullptr) status = manager_->ZeroFreeTensors(members[r]);
  }
  if (!status.ok()) {
    Unpin(pending.pins).IgnoreError();  // the first error is the one to report
    return status;
  }
  const std::string label = Label(pending.first);
  const int holder = SoleHolder(members);
  if (holder >= 0) {
    // Note [One holder, one broadcast].
    pending.handles.push_back(communicator_->Reduce(buffers[holder], count, dtype, reduce_op,
                                                    holder, absl::StrCat(label, ", oversize")));
  } else if (options_.memory_saving) {
    for (size_t r = 0; r < members.size(); ++r) {
      pending.handles.push_back(communicator_->Reduce(buffers[r], count, dtype, reduce_op,
                                                      static_cast<int>(r),
                                                      absl::StrCat(label, ", chunk ", r)));
    }
  } else {
    pending.handles.push_back(
        communicator_->ReduceScatter(buffers, count, dtype, reduce_op, label));
  }
  CountCollective(pending, count, dtype, holder >= 0 ? 1 : members.size());
  const std::vector<int64_t> issued = communicator_->IssuedByRank();
  if (!issued.empty()) pending.issued = issued[static_cast<size_t>(manager_->rank())];
  pending_.push_back(std::move(pending));
  return absl::OkStatus();
}

absl::Status GroupCollectives::FinishOldestReduceScatter() {
  Pending pending = std::move(pending_.front());
  pending_.pop_front();
  absl::Status status = WaitAll(pending.handles);
  const int world = manager_->world_size();
  if (status.ok()) {
    const ChunkId local = pending.first + manager_->rank();
    // Every tensor of the local chunk now holds the reduced gradient: make it HOLD while the
    // chunk is still pinned, so unpinning cannot drop the payload.
    for (TensorId t : (*manager_->chunk(local))->tensors()) {
      if ((*manager_->tensor(t))->state != TensorState::kFree) continue;
      status = manager_->Access(t, TierFor(**manager_->chunk(local))).status();
      if (status.ok()) status = manager_->Release(t, TensorState::kHold);
      if (!status.ok()) break;
    }
    for (Pin& pin : pending.pins) {
      if ((*manager_->tensor(pin.tensor))->chunk == local) pin.restore = TensorState::kHold;
    }
  }
  absl::Status unpinned = Unpin(pending.pins);
  if (status.ok()) status = unpinned;
  for (int r = 0; r < world && status.ok(); ++r) {
    const ChunkId member = pending.first + r;
    if (manager_->IsLocal(member)) continue;
    for (TensorId t : (*manager_->chunk(member))->tensors()) {
      if (HoldsData((*manager_->tensor(t))->state)) {
        status = manager_->SetTensorState(t, TensorState::kFree);
        if (!status.ok()) break;
      }
    }
  }
  return status;
}

absl::Status GroupCollectives::FinishReduceScatters() {
  absl::Status first_error;
  while (!pending_.empty()) {
    absl::Status status = FinishOldestReduceScatter();
    if (first_error.ok()) first_error = status;
  }
  return first_error;
}

absl::StatusOr<int> GroupCollectives::FinishCompletedReduceScatters() {
  int finished = 0;
  while (!pending_.empty() &&
         std::all_of(pending_.front().handles.begin(), pending_.front().handles.end(),
                     [](const CollectiveHandle& handle) { return handle.done(); })) {
    PS_RETURN_IF_ERROR(FinishOldestReduceScatter());
    ++finished;
  }
  return finished;
}

absl::StatusOr<ReduceScatterWait> GroupCollectives::FinishReduceScattersIssuedEverywhere(
    const Communicator* watched, absl::Duration bound) {
  // Note [Waiting for reduce-scatters every rank issued].
  ReduceScatterWait result;
  const absl::Time give_up = absl::Now() + bound;
  const size_t me = static_cast<size_t>(manager_->rank());
  int polls = 0;
  while (!pending_.empty()) {
    const Pending& oldest = pending_.front();
    const bool done = std::all_of(oldest.handles.begin(), oldest.handles.end(),
                                  [](const CollectiveHandle& handle) { return handle.done(); });
    if (!done) {
      const std::vector<int64_t> issued = communicator_->IssuedByRank();
      if (issued.empty() || oldest.issued == 0) return result;  // the back end cannot tell
      bool everywhere = true;
      bool stop = false;
      const std::vector<int64_t> elsewhere =
          watched == nullptr ? std::vector<int64_t>{} : watched->IssuedByRank();
      for (size_t r = 0; r < issued.size(); ++r) {
        if (issued[r] >= oldest.issued) continue;
        everywhere = false;
        // A rank that has yet to issue it went ahead of us on the watched communicator: it
        // may be waiting for us there.
        if (watched != nullptr && (elsewhere.empty() || elsewhere[r] > elsewhere[me])) {
          stop = true;
        }
      }
      if (!everywhere) {
        if (stop || absl::Now() >= give_up) {
          result.gave_up = true;
          return result;
        }
        if (++polls > 64) absl::SleepFor(absl::Microseconds(20));
        continue;
      }
    }
    PS_RETURN_IF_ERROR(FinishOldestReduceScatter());
    ++result.finished;
  }
  return result;
}

absl::StatusOr<bool> GroupCollectives::Release(ChunkId group) {
  PS_ASSIGN_OR_RETURN(const Chunk* any, manager_->chunk(group));
  if (any->kind() != ChunkKind::kComputeParam) {
    return absl::InvalidArgumentError(absl::StrCat(
        "release of one group: chunk ", group, " is a ", ChunkKindName(any->kind()),
        " chunk; only compute-param groups are gathered and released"));
  }
  const ChunkId first = FirstOf(*any);
  const int started = FindStartedGather(first);
  if (started >= 0) PS_RETURN_IF_ERROR(FinishGathersThrough(static_cast<size_t>(started)));
  // The counter ReleaseGroup refuses on: in use is "later", not an error.
  for (int r = 0; r < manager_->world_size(); ++r) {
    if ((*manager_->chunk(first + r))->compute_tensors() > 0) return false;
  }
  PS_RETURN_IF_ERROR(manager_->ReleaseGroup(first));
  return true;
}

}  // namespace ps
