// Device casts in a build without CUDA.
#include "kernels/cast.h"

namespace ps::kernels {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("device casts need a CUDA build (PS_WITH_CUDA)");
}
}  // namespace
absl::Status CastFloatTo16OnDevice(const float*, uint16_t*, int64_t, DType, gpu::Stream) {
  return NotBuilt();
}
absl::Status Cast16ToFloatOnDevice(const uint16_t*, float*, int64_t, DType, gpu::Stream) {
  return NotBuilt();
}
}  // namespace ps::kernels
