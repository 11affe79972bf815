// fp32 <-> fp16/bf16 conversion kernels (round to nearest even, as the CPU versions).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cast.h"
#include "kernels/internal/dtype_dispatch.h"
#include "kernels/internal/strict_kernels.h"

namespace ps::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 4;  // elements per thread per iteration: 16-byte fp32 loads

template <typename Src, typename Dst, typename Convert>
__global__ void CastKernel(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t count,
                           Convert convert) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVector;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVector;
       base < count; base += stride) {
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      if (base + i < count) dst[base + i] = convert(src[base + i]);
    }
  }
}

// fp32 <-> the bits of a 16-bit dtype, as the CPU's FloatToHalfBits / BFloat16BitsToFloat.
template <DType kDtype>
struct To16Bits {
  __device__ uint16_t operator()(float v) const {
    if constexpr (kDtype == DType::kFloat16) {
      return __half_as_ushort(__float2half_rn(v));
    } else {
      return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
  }
};
template <DType kDtype>
struct From16Bits {
  __device__ float operator()(uint16_t b) const {
    if constexpr (kDtype == DType::kFloat16) {
      return __half2float(__ushort_as_half(b));
    } else {
      return __bfloat162float(__ushort_as_bfloat16(b));
    }
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
  return internal::DispatchHalfOrBFloat16(dst_dtype, "cast to a 16-bit dtype", [&]<DType kDtype>() {
    CastKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, To16Bits<kDtype>{});
    return LaunchStatus("CastFloatTo16OnDevice");
  });
}

absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count,
                                   DType src_dtype, gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::Cast16ToFloatOnDevice(src, dst, count, src_dtype, stream);
  if (count == 0) return absl::OkStatus();
  auto s = static_cast<cudaStream_t>(stream.handle);
  return internal::DispatchHalfOrBFloat16(
      src_dtype, "cast from a 16-bit dtype", [&]<DType kDtype>() {
        CastKernel<<<GridFor(count), kThreads, 0, s>>>(src, dst, count, From16Bits<kDtype>{});
        return LaunchStatus("Cast16ToFloatOnDevice");
      });
}

}  // namespace ps::kernels
