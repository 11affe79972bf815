// The GPU update kernels in a build without CUDA: the strict emulated device's when it is on
// (kernels/internal/strict_kernels.h), otherwise every entry point says CUDA is not built.
#include "absl/strings/str_cat.h"
#include "kernels/adam.h"
#include "kernels/grad_stats.h"
#include "kernels/internal/strict_kernels.h"

namespace ps::kernels {
namespace {
absl::Status NotBuilt(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, " needs a CUDA build (PS_WITH_CUDA): this build has no GPU kernels"));
}
}  // namespace

absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params,
                                gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::AdamUpdateOnDevice(chunks, params, stream);
  return NotBuilt("AdamUpdateOnDevice");
}
absl::Status GradStatsOnDevice(absl::Span<const GradChunk> chunks, double* norm, int32_t* overflow,
                               gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::GradStatsOnDevice(chunks, norm, overflow, stream);
  return NotBuilt("GradStatsOnDevice");
}
absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk> chunks, float multiplier,
                                int32_t* overflow, gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::ScaleGradsOnDevice(chunks, multiplier, overflow, stream);
  return NotBuilt("ScaleGradsOnDevice");
}

}  // namespace ps::kernels
