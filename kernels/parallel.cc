#include "kernels/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "runtime/thread_pool.h"

namespace ps::kernels {
namespace {

int DefaultThreads() {
  if (const char* value = std::getenv("PS_KERNEL_THREADS")) {
    const int threads = std::atoi(value);
    if (threads > 0) return threads;
  }
  return UsableCores();
}

struct PoolState {
  absl::Mutex mutex;
  int threads = 0;                   // 0: not chosen yet
  // threads - 1 workers (the caller is the other one). Shared with running calls, so that
  // SetKernelThreads cannot destroy a pool a call is still scheduling into.
  std::shared_ptr<ThreadPool> pool;
};

PoolState& State() {
  static PoolState* state = new PoolState();
  return *state;
}

}  // namespace

int KernelThreads() {
  PoolState& state = State();
  absl::MutexLock lock(&state.mutex);
  if (state.threads == 0) state.threads = DefaultThreads();
  return state.threads;
}

void SetKernelThreads(int threads) {
  PoolState& state = State();
  absl::MutexLock lock(&state.mutex);
  state.threads = threads > 0 ? threads : DefaultThreads();
  state.pool.reset();
}

// Note [Helpers that start late]
// The caller takes blocks itself and returns as soon as every block is done, without waiting
// for helper tasks that have not started: on a loaded machine a helper may be scheduled only
// after the caller has done all the work, and a nested call from a pool thread would otherwise
// wait for a helper queued behind itself. A helper that starts late finds no block left and
// touches nothing but the shared state it co-owns (never `fn`, which the caller's frame owns).
struct ParallelForState {
  explicit ParallelForState(int64_t blocks, const std::function<void(int64_t)>* f)
      : num_blocks(blocks), fn(f) {}
  const int64_t num_blocks;
  const std::function<void(int64_t)>* const fn;
  std::atomic<int64_t> next{0};
  absl::Mutex mutex;
  int64_t done ABSL_GUARDED_BY(mutex) = 0;

  void Work() {
    int64_t mine = 0;
    for (int64_t block = next.fetch_add(1, std::memory_order_relaxed); block < num_blocks;
         block = next.fetch_add(1, std::memory_order_relaxed)) {
      (*fn)(block);
      ++mine;
    }
    if (mine > 0) {
      absl::MutexLock lock(&mutex);
      done += mine;
    }
  }
};

void ParallelFor(int64_t num_blocks, const std::function<void(int64_t)>& fn) {
  if (num_blocks <= 0) return;
  std::shared_ptr<ThreadPool> pool;
  int threads = 1;
  {
    PoolState& state = State();
    absl::MutexLock lock(&state.mutex);
    if (state.threads == 0) state.threads = DefaultThreads();
    threads = static_cast<int>(std::min<int64_t>(state.threads, num_blocks));
    if (threads > 1) {
      if (state.pool == nullptr) {
        state.pool = std::make_shared<ThreadPool>(state.threads - 1, "ps-kernels");
      }
      pool = state.pool;
    }
  }
  if (pool == nullptr) {
    for (int64_t block = 0; block < num_blocks; ++block) fn(block);
    return;
  }
  auto shared = std::make_shared<ParallelForState>(num_blocks, &fn);
  for (int i = 1; i < threads; ++i) pool->Schedule([shared] { shared->Work(); });
  shared->Work();
  absl::MutexLock lock(&shared->mutex);
  shared->mutex.Await(absl::Condition(
      +[](ParallelForState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->done == s->num_blocks; },
      shared.get()));
}

int64_t NumChunkBlocks(absl::Span<const int64_t> counts, int64_t block_elements) {
  int64_t blocks = 0;
  for (int64_t count : counts) blocks += (count + block_elements - 1) / block_elements;
  return blocks;
}

void ParallelForChunkBlocks(
    absl::Span<const int64_t> counts, int64_t block_elements,
    const std::function<void(size_t chunk, int64_t block, int64_t begin, int64_t end)>& fn) {
  std::vector<int64_t> first_block(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) {
    first_block[i + 1] = first_block[i] + (counts[i] + block_elements - 1) / block_elements;
  }
  ParallelFor(first_block.back(), [&](int64_t block) {
    const size_t chunk =
        std::upper_bound(first_block.begin(), first_block.end(), block) - first_block.begin() - 1;
    const int64_t begin = (block - first_block[chunk]) * block_elements;
    fn(chunk, block, begin, std::min(counts[chunk], begin + block_elements));
  });
}

}  // namespace ps::kernels
