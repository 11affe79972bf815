// A fixed-size pool of worker threads running queued tasks in FIFO order.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace ps {

class ThreadPool {
 public:
  // `num_threads` <= 0 means one per core this process may run on.
  explicit ThreadPool(int num_threads, std::string name = "ps-pool");
  ~ThreadPool();  // runs the tasks already queued, then joins
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }
  // Blocks until the queue is empty and no task is running.
  void WaitIdle();

 private:
  void WorkerLoop();

  absl::Mutex mutex_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mutex_);
  int running_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

// Cores in this process's affinity mask (at least 1).
int UsableCores();

}  // namespace ps
