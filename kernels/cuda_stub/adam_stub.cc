// The GPU update kernels in a build without CUDA: every entry point says so.
#include "absl/strings/str_cat.h"
#include "kernels/adam.h"
#include "kernels/grad_stats.h"

namespace ps::kernels {
namespace {
absl::Status NotBuilt(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, " needs a CUDA build (PS_WITH_CUDA): this build has no GPU kernels"));
}
}  // namespace

absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk>, const AdamHyperParams&, gpu::Stream) {
  return NotBuilt("AdamUpdateOnDevice");
}
absl::Status GradStatsOnDevice(absl::Span<const GradChunk>, double*, int32_t*, gpu::Stream) {
  return NotBuilt("GradStatsOnDevice");
}
absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk>, float, int32_t*, gpu::Stream) {
  return NotBuilt("ScaleGradsOnDevice");
}

}  // namespace ps::kernels
