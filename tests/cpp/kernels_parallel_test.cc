// The kernels' parallel-for: every block exactly once for any thread count, nested calls, and
// the fixed block layout of ParallelForChunkBlocks.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/parallel.h"

namespace ps::kernels {
namespace {

TEST(ParallelForTest, RunsEveryBlockOnceForAnyThreadCount) {
  for (int threads : {1, 2, 3, 8}) {
    SetKernelThreads(threads);
    EXPECT_EQ(KernelThreads(), threads);
    for (int64_t blocks : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(blocks);
      ParallelFor(blocks, [&](int64_t b) { hits[b].fetch_add(1); });
      for (int64_t b = 0; b < blocks; ++b) {
        ASSERT_EQ(hits[b].load(), 1) << threads << " threads, block " << b << " of " << blocks;
      }
    }
  }
  SetKernelThreads(0);
  EXPECT_GE(KernelThreads(), 1);
}

TEST(ParallelForTest, NestedCallsFinish) {
  SetKernelThreads(2);  // one pool worker: a nested call must not wait for a queued helper
  std::atomic<int64_t> total{0};
  ParallelFor(8, [&](int64_t) { ParallelFor(16, [&](int64_t b) { total.fetch_add(b); }); });
  EXPECT_EQ(total.load(), 8 * (15 * 16 / 2));
  SetKernelThreads(0);
}

TEST(ParallelForTest, ChunkBlocksAreFixedOffsetsInChunkOrder) {
  const std::vector<int64_t> counts = {10, 0, 25, 5};
  EXPECT_EQ(NumChunkBlocks(counts, 10), 1 + 0 + 3 + 1);
  std::mutex mutex;
  std::vector<std::tuple<int64_t, size_t, int64_t, int64_t>> seen;
  ParallelForChunkBlocks(counts, 10, [&](size_t c, int64_t block, int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.emplace_back(block, c, begin, end);
  });
  std::sort(seen.begin(), seen.end());
  const std::vector<std::tuple<int64_t, size_t, int64_t, int64_t>> expected = {
      {0, 0, 0, 10}, {1, 2, 0, 10}, {2, 2, 10, 20}, {3, 2, 20, 25}, {4, 3, 0, 5}};
  EXPECT_EQ(seen, expected);
}

}  // namespace
}  // namespace ps::kernels
