// Conversions between fp32 and the 16-bit compute dtypes (fp16, bf16), round to nearest even,
// NaN preserved, on the CPU and (CUDA builds) on the GPU.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "runtime/dtype.h"
#include "runtime/gpu.h"

namespace ps::kernels {

uint16_t FloatToHalfBits(float value);
float HalfBitsToFloat(uint16_t bits);
uint16_t FloatToBFloat16Bits(float value);
float BFloat16BitsToFloat(uint16_t bits);

// `dst_dtype` must be kFloat16 or kBFloat16.
absl::Status CastFloatTo16(const float* src, uint16_t* dst, int64_t count, DType dst_dtype);
absl::Status Cast16ToFloat(const uint16_t* src, float* dst, int64_t count, DType src_dtype);

// CastFloatTo16 on the SIMD path the update kernels use now (kernels/simd.h), vectorized: the
// bits the Adam kernel's param_copy stores (every path rounds as the scalar code does, Note
// [vcvtneps2bf16 and denormals] in kernels/cpu_paths.cc). Host memory.
absl::Status CastFloatTo16AsUpdate(const float* src, uint16_t* dst, int64_t count,
                                   DType dst_dtype);

// The same on device memory, enqueued on `stream`. FailedPrecondition in a build without CUDA.
absl::Status CastFloatTo16OnDevice(const float* src, uint16_t* dst, int64_t count,
                                   DType dst_dtype, gpu::Stream stream);
absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count,
                                   DType src_dtype, gpu::Stream stream);

}  // namespace ps::kernels
