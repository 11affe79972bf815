#include "kernels/grad_stats.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/internal/cpu_paths.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "runtime/status.h"

namespace ps::kernels {

// Note [Deterministic norm]
// The squared norm is summed in double in a fixed order that depends on neither the SIMD path
// nor the thread count: a chunk is cut into kNormBlock-element blocks at fixed offsets; inside a
// block, element i goes to lane i % 16 of 16 double accumulators (two zmm, four ymm or sixteen
// scalars, all the same lanes), the lanes are added in a fixed tree, and the block sums are
// added in chunk then block order by the calling thread. Squaring a float in double is exact, so
// an FMA and a multiply-then-add give the same lane values. The result is bit-identical on every
// path, and inf/NaN anywhere makes it non-finite (a finite float squared is < 2^256), which is
// how ComputeGradStats reports overflow without a second pass.

namespace {

absl::Status ValidateGradChunks(absl::Span<const GradChunk> chunks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const GradChunk& c = chunks[i];
    if (c.count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient chunk ", i, ": negative count ", c.count));
    }
    if (c.count > 0 && c.data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient chunk ", i, " of ", c.count, " elements: null data"));
    }
    if (c.dtype != DType::kFloat32 && c.dtype != DType::kFloat16 &&
        c.dtype != DType::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat("gradient chunk ", i, ": unknown dtype ",
                                                     static_cast<int>(c.dtype)));
    }
  }
  return absl::OkStatus();
}

// Calls fn(block_index, chunk, begin, end) for every kNormBlock block of every chunk in parallel;
// block_index numbers blocks in chunk then offset order.
template <typename Fn>
int64_t ForEachNormBlock(absl::Span<const GradChunk> chunks, const Fn& fn) {
  std::vector<int64_t> first_block(chunks.size() + 1, 0);
  for (size_t i = 0; i < chunks.size(); ++i) {
    first_block[i + 1] =
        first_block[i] + (chunks[i].count + internal::kNormBlock - 1) / internal::kNormBlock;
  }
  ParallelFor(first_block.back(), [&](int64_t block) {
    const size_t index =
        std::upper_bound(first_block.begin(), first_block.end(), block) - first_block.begin() - 1;
    const GradChunk& chunk = chunks[index];
    const int64_t begin = (block - first_block[index]) * internal::kNormBlock;
    fn(block, chunk, begin, std::min(chunk.count, begin + internal::kNormBlock));
  });
  return first_block.back();
}

}  // namespace

absl::StatusOr<GradStats> ComputeGradStats(absl::Span<const GradChunk> chunks) {
  PS_RETURN_IF_ERROR(ValidateGradChunks(chunks));
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  int64_t total_blocks = 0;
  for (const GradChunk& c : chunks) {
    total_blocks += (c.count + internal::kNormBlock - 1) / internal::kNormBlock;
  }
  std::vector<double> block_sums(total_blocks, 0.0);
  ForEachNormBlock(chunks, [&](int64_t block, const GradChunk& c, int64_t begin, int64_t end) {
    block_sums[block] = path.sum_squares(c.data, c.dtype, begin, end);
  });
  GradStats stats;
  for (double sum : block_sums) stats.squared_norm += sum;
  stats.has_inf_or_nan = !std::isfinite(stats.squared_norm);
  return stats;
}

absl::StatusOr<bool> HasInfOrNan(absl::Span<const GradChunk> chunks) {
  PS_RETURN_IF_ERROR(ValidateGradChunks(chunks));
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  std::atomic<bool> found{false};
  ForEachNormBlock(chunks, [&](int64_t, const GradChunk& c, int64_t begin, int64_t end) {
    if (found.load(std::memory_order_relaxed)) return;  // the answer is known: skip the rest
    if (path.has_inf_or_nan(c.data, c.dtype, begin, end)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

absl::StatusOr<double> SquaredL2Norm(absl::Span<const GradChunk> chunks) {
  PS_ASSIGN_OR_RETURN(GradStats stats, ComputeGradStats(chunks));
  return stats.squared_norm;
}

}  // namespace ps::kernels
