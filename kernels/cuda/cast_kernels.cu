// fp32 <-> fp16/bf16 conversion kernels (round to nearest even, as the CPU versions).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cast.h"
#include "kernels/internal/strict_kernels.h"

namespace ps::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 4;  // elements per thread per iteration: 16-byte fp32 loads

template <typename Convert>
__global__ void CastFromFloatKernel(const float* __restrict__ src, uint16_t* __restrict__ dst,
                                    int64_t count, Convert convert) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVector;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
       base < count; base += stride) {
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      if (base + i < count) dst[base + i] = convert(src[base + i]);
    }
  }
}

template <typename Convert>
__global__ void CastToFloatKernel(const uint16_t* __restrict__ src, float* __restrict__ dst,
                                  int64_t count, Convert convert) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVector;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
       base < count; base += stride) {
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      if (base + i < count) dst[base + i] = convert(src[base + i]);
    }
  }
}

struct ToHalf {
  __device__ uint16_t operator()(float v) const { return __half_as_ushort(__float2half_rn(v)); }
};
struct ToBFloat16 {
  __device__ uint16_t operator()(float v) const {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
struct FromHalf {
  __device__ float operator()(uint16_t b) const { return __half2float(__ushort_as_half(b)); }
};
struct FromBFloat16 {
  __device__ float operator()(uint16_t b) const {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
};

int GridFor(int64_t count) {
  const int64_t blocks = (count + kThreads * kVector - 1) / (kThreads * kVector);
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

absl::Status LaunchStatus(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

}  // namespace

absl::Status CastFloatTo16OnDevice(const float* src, uint16_t* dst, int64_t count,
                                   DType dst_dtype, gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::CastFloatTo16OnDevice(src, dst, count, dst_dtype, stream);
  if (count == 0) return absl::OkStatus();
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (dst_dtype == DType::kFloat16) {
    CastFromFloatKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, ToHalf{});
  } else if (dst_dtype == DType::kBFloat16) {
    CastFromFloatKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, ToBFloat16{});
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cast to a 16-bit dtype: got ", DTypeName(dst_dtype)));
  }
  return LaunchStatus("CastFloatTo16OnDevice");
}

absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count,
                                   DType src_dtype, gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::Cast16ToFloatOnDevice(src, dst, count, src_dtype, stream);
  if (count == 0) return absl::OkStatus();
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (src_dtype == DType::kFloat16) {
    CastToFloatKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, FromHalf{});
  } else if (src_dtype == DType::kBFloat16) {
    CastToFloatKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, FromBFloat16{});
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("cast from a 16-bit dtype: got ", DTypeName(src_dtype)));
  }
  return LaunchStatus("Cast16ToFloatOnDevice");
}

}  // namespace ps::kernels
