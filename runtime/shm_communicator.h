// A Communicator for ranks on one host: collectives through a POSIX shared-memory segment
// instead of a network transport (gloo's TCP loopback copies every byte several times through
// the kernel, on the cores that also run the model). DeepSpeed's shm comm op does the same for
// same-host ranks.
//
// Each rank owns two staging slots of `slot_bytes` in the segment; a collective is cut into
// steps of at most one slot per rank, each step a write of this rank's piece into its slot, a
// publish, and reads of the peers' slots (Note [Shared-memory steps] in shm_communicator.cc).
// Calls run on one worker thread per communicator in issue order (Note [Group collectives]).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/communicator.h"

namespace ps {

struct ShmCommunicatorOptions {
  // The segment's shm_open name ("/ps-..."), the same on every rank and new for each
  // communicator: the caller makes it (rank 0) and shares it.
  std::string name;
  int rank = 0;
  int world_size = 1;
  // How long Create waits for every rank to attach, and how long the worker waits for a peer
  // within one collective before failing it (and every later one) with DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(300);
  // Per rank and step; a multiple of 64 bytes, at least 64 x world_size.
  int64_t slot_bytes = 4 << 20;
};

// Rank 0 creates the segment, the others open it; returns once every rank has attached (rank
// 0 then unlinks the name, so nothing is left in /dev/shm whatever happens later).
// DeadlineExceeded when a rank does not attach within the timeout, AlreadyExists when rank 0
// finds the name taken, InvalidArgument for options that disagree with the segment's.
absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(
    const ShmCommunicatorOptions& options);

}  // namespace ps
