#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

namespace ps {

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}

ThreadPool::ThreadPool(int num_threads, std::string name) {
  if (num_threads <= 0) num_threads = UsableCores();
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] { WorkerLoop(); });
    // Thread names show up in profilers and gdb; Linux limits them to 15 characters.
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void ThreadPool::Schedule(std::function<void()> task) {
  absl::MutexLock lock(&mutex_);
  queue_.push_back(std::move(task));
}

void ThreadPool::WaitIdle() {
  absl::MutexLock lock(&mutex_);
  mutex_.Await(absl::Condition(
      +[](ThreadPool* pool)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return pool->queue_.empty() && pool->running_ == 0; },
      this));
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(
          +[](ThreadPool* pool)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return !pool->queue_.empty() || pool->stopping_; },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task();
    absl::MutexLock lock(&mutex_);
    --running_;
  }
}

}  // namespace ps
