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
    if (c.dtype != DType::kFloat32 && c.dtype != DType::kFloat16 && c.dtype != DType::kBFloat16) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient chunk ", i, ": unknown dtype ", static_cast<int>(c.dtype)));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> Counts(absl::Span<const GradChunk> chunks) {
  std::vector<int64_t> counts;
  for (const GradChunk& chunk : chunks) counts.push_back(chunk.count);
  return counts;
}

}  // namespace

absl::StatusOr<GradStats> ComputeGradStats(absl::Span<const GradChunk> chunks) {
  PS_RETURN_IF_ERROR(ValidateGradChunks(chunks));
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  const std::vector<int64_t> counts = Counts(chunks);
  std::vector<double> block_sums(NumChunkBlocks(counts, internal::kNormBlock), 0.0);
  ParallelForChunkBlocks(
      counts, internal::kNormBlock, [&](size_t c, int64_t block, int64_t begin, int64_t end) {
        block_sums[block] = path.sum_squares(chunks[c].data, chunks[c].dtype, begin, end);
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
  ParallelForChunkBlocks(Counts(chunks), internal::kNormBlock,
                         [&](size_t c, int64_t, int64_t begin, int64_t end) {
                           // Once the answer is known the remaining blocks are skipped.
                           if (found.load(std::memory_order_relaxed)) return;
                           if (path.has_inf_or_nan(chunks[c].data, chunks[c].dtype, begin, end)) {
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
