// Device casts in a build without CUDA: the strict emulated device's when it is on.
#include "kernels/cast.h"
#include "kernels/internal/strict_kernels.h"

namespace ps::kernels {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("device casts need a CUDA build (PS_WITH_CUDA)");
}
}  // namespace
absl::Status CastFloatTo16OnDevice(const float* src, uint16_t* dst, int64_t count, DType dtype,
                                   gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::CastFloatTo16OnDevice(src, dst, count, dtype, stream);
  return NotBuilt();
}
absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count, DType dtype,
                                   gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::Cast16ToFloatOnDevice(src, dst, count, dtype, stream);
  return NotBuilt();
}
}  // namespace ps::kernels
