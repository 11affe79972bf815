// Collectives over chunk groups: the interface the chunk layer uses for data parallelism, and
// the handle its asynchronous calls return. Back ends: a c10d ProcessGroup (gloo, or NCCL
// through torch) implemented in bindings/ (the core never sees torch), a direct NCCL back end
// in runtime/cuda/ (CreateNcclCommunicator), and shared memory for ranks on one host
// (runtime/shm_communicator.h). Tests use an in-process fake world.
//
// Note [Group collectives]
// A chunk group is world_size equal-size buffers, one per rank's chunk, each contiguous but not
// contiguous with each other (each chunk is its own block). Every call takes the whole group:
//   AllGather:     buffers[rank] is this rank's input; every other buffers[r] receives rank r's.
//   ReduceScatter: buffers[r] is this rank's contribution to rank r's result; buffers[rank]
//                  receives the reduction over all ranks (sum, or average = sum / world_size).
//                  Other buffers may be overwritten with partial sums (they are dropped after).
//   AllReduce / Broadcast / Reduce: one buffer, in place (Reduce: the result on `root` only).
// A null buffer is allowed where a rank has nothing there: as an input it contributes zeros,
// as an output it is received and discarded (padding chunks, chunks whose tensors are all FREE).
// Calls are queued: every back end runs them in the order they were issued, so a caller that
// issues the same sequence on every rank never deadlocks, whatever the timing. The buffers
// must stay valid (pinned) until the handle is done.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"
#include "runtime/tier.h"

namespace ps {

enum class ReduceOp { kSum, kAvg };
enum class CollectiveType { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kReduce };

// Ends the errors of ranks whose calls no longer pair up (a timeout, Note [Same call at every
// step] in shm_communicator.cc): the usual cause in a training script.
inline constexpr absl::string_view kSameCallsHint =
    "every rank must make the same calls in the same order (each forward, backward, optimizer "
    "step and state-dict read on every rank); work on one rank alone, such as evaluation or "
    "saving under `if rank == 0`, desynchronizes them";

absl::string_view CollectiveName(CollectiveType type);  // "allgather", "reduce_scatter", ...
absl::string_view ReduceOpName(ReduceOp op);

// What a collective does, for logs and error messages: "allgather of 2 x 65536 float32
// (compute_param group 3) on gloo".
struct CollectiveDescription {
  CollectiveType type = CollectiveType::kAllGather;
  int64_t buffers = 1;
  int64_t count = 0;  // elements per buffer
  DType dtype = DType::kFloat32;
  std::string label;
  std::string backend;
  std::string ToString() const;
};

// Shared between a handle and the back end that completes it.
class CollectiveState {
 public:
  explicit CollectiveState(CollectiveDescription description)
      : description_(std::move(description)) {}
  const CollectiveDescription& description() const { return description_; }
  // Called once by the back end. A status that is not OK is annotated with the description.
  void Finish(absl::Status status);
  bool done() const;
  absl::Status Wait(absl::Duration timeout) const;

 private:
  const CollectiveDescription description_;
  mutable absl::Mutex mutex_;
  bool done_ ABSL_GUARDED_BY(mutex_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mutex_);
};

class CollectiveHandle {
 public:
  CollectiveHandle() = default;  // finished, OK (nothing to do)
  explicit CollectiveHandle(std::shared_ptr<CollectiveState> state) : state_(std::move(state)) {}
  static CollectiveHandle Failed(CollectiveDescription description, absl::Status status);

  bool done() const { return state_ == nullptr || state_->done(); }
  // The collective's status once it finished; DeadlineExceeded naming the collective (type,
  // sizes, label, back end) when it did not finish within `timeout` (a rank died or stopped
  // issuing collectives).
  absl::Status Wait(absl::Duration timeout) const;
  std::string ToString() const;

 private:
  std::shared_ptr<CollectiveState> state_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "gloo", "nccl", "fake", ...
  // Where the buffers must live: host memory (gloo, fake) or device memory (NCCL).
  virtual AddressSpace address_space() const = 0;

  // Note [Group collectives]. `buffers.size() == world_size()`; `count` elements per buffer.
  virtual CollectiveHandle AllGather(absl::Span<void* const> buffers, int64_t count, DType dtype,
                                     std::string label) = 0;
  virtual CollectiveHandle ReduceScatter(absl::Span<void* const> buffers, int64_t count,
                                         DType dtype, ReduceOp op, std::string label) = 0;
  virtual CollectiveHandle AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                     std::string label) = 0;
  virtual CollectiveHandle Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                     std::string label) = 0;
  virtual CollectiveHandle Reduce(void* buffer, int64_t count, DType dtype, ReduceOp op, int root,
                                  std::string label) = 0;

  // Note [Issued everywhere]
  // How many calls each rank has issued on this communicator, in rank order, as far as this rank
  // can see: empty when the back end cannot tell (c10d, NCCL, fake), a lower bound otherwise.
  // A call every rank has issued completes without any rank's caller doing anything more (the
  // back ends run calls in issue order, and every rank issued the same calls before it), so a
  // caller may block on it where blocking on one a peer has yet to issue could deadlock (the
  // peer might first need this caller in another collective). The shared-memory back end
  // counts in its segment.
  virtual std::vector<int64_t> IssuedByRank() const { return {}; }
};

// Argument checks shared by the back ends: buffer count, element count, root, and that this
// rank's own buffer is present where the collective needs it.
absl::Status ValidateCollective(const Communicator& communicator, CollectiveType type,
                                absl::Span<void* const> buffers, int64_t count, int root);

// The direct NCCL back end (runtime/cuda/nccl_communicator.cc): one communicator over
// `world_size` ranks on `device`, its own stream, ncclGroupStart/End around each group call.
// `unique_id` is the 128-byte ncclUniqueId made by rank 0 (NcclUniqueId) and shared by the
// caller. FailedPrecondition in builds without NCCL (the reason is in the message).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int world_size,
                                                                     int device,
                                                                     const std::string& unique_id);
absl::StatusOr<std::string> NcclUniqueId();
bool NcclAvailable();  // compiled with NCCL

}  // namespace ps
