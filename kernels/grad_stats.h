// Reductions over gradient chunks for loss scaling and global-norm clipping: overflow detection
// (any inf or NaN) and the squared L2 norm, vectorized on the CPU (kernels/simd.h) and on the GPU.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"
#include "runtime/gpu.h"

namespace ps::kernels {

struct GradChunk {
  const void* data = nullptr;  // fp32, fp16 or bf16 elements
  DType dtype = DType::kFloat32;
  int64_t count = 0;
};

struct GradStats {
  // Sum of squares accumulated in double; inf or NaN when some element is.
  double squared_norm = 0.0;
  bool has_inf_or_nan = false;
};

// Both reductions in one pass over every chunk. The sum is exact-order deterministic: the same
// bits for every SIMD path and thread count (Note [Deterministic norm]).
absl::StatusOr<GradStats> ComputeGradStats(absl::Span<const GradChunk> chunks);
// Only the overflow check (cheaper: no double accumulation).
absl::StatusOr<bool> HasInfOrNan(absl::Span<const GradChunk> chunks);
absl::StatusOr<double> SquaredL2Norm(absl::Span<const GradChunk> chunks);

// Device versions, enqueued on `stream`; the results land in device memory so that no host
// synchronization is needed until the caller reads them. `device_squared_norm` (one double) is
// added to and `device_overflow` (one int32) is set to 1 when some element is inf or NaN: zero
// them first (gpu::MemsetAsync). Either output may be null.
absl::Status GradStatsOnDevice(absl::Span<const GradChunk> chunks, double* device_squared_norm,
                               int32_t* device_overflow, gpu::Stream stream);
// Multiplies every gradient element by `multiplier` in place (1 / loss scale, times a clip
// coefficient), rounding 16-bit gradients to nearest even, and raises `device_overflow` (may be
// null) when an element is or becomes inf or NaN.
absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk> chunks, float multiplier,
                                int32_t* device_overflow, gpu::Stream stream);

}  // namespace ps::kernels
