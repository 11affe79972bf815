// The copy engine: asynchronous block-to-block copies between any two tiers.
//
// Note [Copy routes]
//   host memory <-> host memory   memcpy on a host worker thread
//   host memory <-> file (NVMe)   io_uring (or pread/pwrite) straight into/out of the block
//   device <-> host memory        cudaMemcpyAsync on the engine's copy stream, then an event
//   device <-> device             the same, on the copy stream
//   device <-> file               staged through an aligned bounce buffer on a host worker
// The source is pinned and the destination pinned and marked invalid for the copy's duration
// (Note [Block pins and validity]); the destination becomes valid only when the copy succeeded.
// The source must be valid: copying out of an NVMe slot that holds no complete data fails.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "runtime/gpu.h"
#include "runtime/thread_pool.h"
#include "runtime/tier.h"

namespace ps {

class FaultInjector;  // runtime/fault_injection.h

// Completion handle of one copy; cheap to copy, all copies share the outcome.
class CopyHandle {
 public:
  CopyHandle() = default;
  // Blocks until the copy finished; returns its outcome.
  absl::Status Wait() const;
  bool Done() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class CopyEngine;
  struct State {
    absl::Notification done;
    absl::Status status;
  };
  std::shared_ptr<State> state_;
};

class CopyEngine {
 public:
  struct Options {
    int host_threads = 2;
    int device = 0;  // the GPU whose copy stream is used
    // Tests only (Note [Fault injection]): consulted before every copy; a fault fails the copy
    // through its handle, as a real copy error would.
    std::shared_ptr<FaultInjector> faults;
  };
  explicit CopyEngine(Options options);
  CopyEngine() : CopyEngine(Options{}) {}
  ~CopyEngine();  // waits for copies in flight
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Starts copying all of `src` into `dst` (dst must be at least as large). Errors found before
  // the copy starts (sizes, unknown blocks, an invalid source) are returned here; errors during
  // the copy are reported by the handle.
  absl::StatusOr<CopyHandle> Copy(const Block& src, const Block& dst);
  const Options& options() const { return options_; }
  // Copy() then Wait().
  absl::Status CopyAndWait(const Block& src, const Block& dst);
  // Waits for every copy started so far.
  void WaitAll();

  // Sets every byte of `block` (a memory tier's) to `value` and returns once that is done: a
  // host memset for host memory, cudaMemsetAsync on the upload stream for device memory (Note
  // [Zero-filled chunks] in chunk/chunk_manager_moves.cc): the host must never write device memory.
  absl::Status Fill(const Block& block, int value);

  // Orders every copy issued after this call after the work enqueued on `producer` so far
  // (an event recorded there, waited on by both copy streams): Note [Copy stream ordering].
  absl::Status OrderAfter(gpu::Stream producer);

 private:
  void RunMemoryCopy(const Block& src, const Block& dst, std::shared_ptr<CopyHandle::State> state);
  absl::Status RunDeviceCopy(void* dst, const void* src, int64_t bytes, bool to_device);
  void Finish(const Block& src, const Block& dst, std::shared_ptr<CopyHandle::State> state,
              absl::Status status);
  absl::Status EnsureGpuStreams() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gpu_mutex_);

  Options options_;
  absl::Mutex mutex_;
  int64_t in_flight_ ABSL_GUARDED_BY(mutex_) = 0;
  absl::StatusOr<gpu::Event> TakeEvent();
  void ReturnEvent(gpu::Event event);

  absl::Mutex gpu_mutex_;  // guards the streams and the event pool
  // One stream per direction so uploads and downloads overlap on the two copy engines.
  gpu::Stream to_device_stream_ ABSL_GUARDED_BY(gpu_mutex_);
  gpu::Stream from_device_stream_ ABSL_GUARDED_BY(gpu_mutex_);
  std::vector<gpu::Event> free_events_ ABSL_GUARDED_BY(gpu_mutex_);
  std::vector<gpu::Event> all_events_ ABSL_GUARDED_BY(gpu_mutex_);
  ThreadPool pool_;  // last: its threads are joined before the members they use go away
};

}  // namespace ps
