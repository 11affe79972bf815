#include "runtime/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace ps {

absl::string_view CollectiveName(CollectiveType type) {
  switch (type) {
    case CollectiveType::kAllGather:
      return "allgather";
    case CollectiveType::kReduceScatter:
      return "reduce_scatter";
    case CollectiveType::kAllReduce:
      return "all_reduce";
    case CollectiveType::kBroadcast:
      return "broadcast";
    case CollectiveType::kReduce:
      return "reduce";
  }
  return "collective";
}

absl::string_view ReduceOpName(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

std::string CollectiveDescription::ToString() const {
  std::string text = absl::StrCat(CollectiveName(type), " of ");
  if (buffers > 1) absl::StrAppend(&text, buffers, " x ");
  absl::StrAppend(&text, count, " ", DTypeName(dtype));
  if (!label.empty()) absl::StrAppend(&text, " (", label, ")");
  if (!backend.empty()) absl::StrAppend(&text, " on ", backend);
  return text;
}

void CollectiveState::Finish(absl::Status status) {
  absl::MutexLock lock(&mutex_);
  PS_CHECK(!done_, "collective finished twice: ", description_.ToString());
  status_ = status.ok() ? std::move(status) : Annotate(status, description_.ToString());
  done_ = true;
}

bool CollectiveState::done() const {
  absl::MutexLock lock(&mutex_);
  return done_;
}

absl::Status CollectiveState::Wait(absl::Duration timeout) const {
  absl::MutexLock lock(&mutex_);
  const bool finished = mutex_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  if (!finished) {
    return absl::DeadlineExceededError(absl::StrCat(
        description_.ToString(), " did not finish within ", absl::FormatDuration(timeout),
        ": another rank died, stopped, or issued a different sequence of collectives (",
        kSameCallsHint, ")"));
  }
  return status_;
}

CollectiveHandle CollectiveHandle::Failed(CollectiveDescription description, absl::Status status) {
  auto state = std::make_shared<CollectiveState>(std::move(description));
  state->Finish(std::move(status));
  return CollectiveHandle(std::move(state));
}

absl::Status CollectiveHandle::Wait(absl::Duration timeout) const {
  return state_ == nullptr ? absl::OkStatus() : state_->Wait(timeout);
}

std::string CollectiveHandle::ToString() const {
  return state_ == nullptr ? "no collective" : state_->description().ToString();
}

absl::Status ValidateCollective(const Communicator& communicator, CollectiveType type,
                                absl::Span<void* const> buffers, int64_t count, int root) {
  const int world = communicator.world_size();
  const bool group = type == CollectiveType::kAllGather || type == CollectiveType::kReduceScatter;
  const size_t expected = group ? static_cast<size_t>(world) : 1;
  if (buffers.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(CollectiveName(type), " takes ", expected,
                                                   " buffers (world size ", world, "), got ",
                                                   buffers.size()));
  }
  if (count <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(CollectiveName(type), ": element count must be positive, got ", count));
  }
  if (!group && (root < 0 || root >= world)) {
    return absl::InvalidArgumentError(absl::StrCat(CollectiveName(type), ": root ", root,
                                                   " is not a rank of a world of ", world));
  }
  if (!group && buffers[0] == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(CollectiveName(type), ": null buffer"));
  }
  return absl::OkStatus();
}

#if !PS_WITH_NCCL
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int, int, int,
                                                                     const std::string&) {
  return absl::FailedPreconditionError(
      "this build has no NCCL back end (built without CUDA, or CMake found no NCCL headers and "
      "library; see the configure log)");
}
absl::StatusOr<std::string> NcclUniqueId() { return CreateNcclCommunicator(0, 1, 0, "").status(); }
bool NcclAvailable() { return false; }
#endif

}  // namespace ps
