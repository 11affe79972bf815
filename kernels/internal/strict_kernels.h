// The device kernels on the strict emulated device (Note [Strict device] in
// runtime/strict_device.h): each *OnDevice entry point forwards here when gpu::StrictDevice(). A
// kernel is the CPU kernel run late, as emulated device work on the caller's stream, over the
// device-side alias of its buffers: the math is the CPU path's (Note [Identical rounding on every
// path]), the streams, waits and memory discipline are the GPU's.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/adam.h"
#include "kernels/grad_stats.h"
#include "runtime/dtype.h"
#include "runtime/gpu.h"

namespace ps::kernels::strict {

absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params,
                                gpu::Stream stream);
absl::Status GradStatsOnDevice(absl::Span<const GradChunk> chunks, double* device_squared_norm,
                               int32_t* device_overflow, gpu::Stream stream);
absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk> chunks, float multiplier,
                                int32_t* device_overflow, gpu::Stream stream);
absl::Status CastFloatTo16OnDevice(const float* src, uint16_t* dst, int64_t count, DType dst_dtype,
                                   gpu::Stream stream);
absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count, DType src_dtype,
                                   gpu::Stream stream);

}  // namespace ps::kernels::strict
