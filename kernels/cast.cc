#include "kernels/cast.h"

#include <bit>
#include <cmath>

#include "kernels/internal/cpu_paths.h"
#include "kernels/internal/dtype_dispatch.h"
#include "kernels/simd.h"

namespace ps::kernels {

uint16_t FloatToHalfBits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t exponent = (bits >> 23) & 0xffu;
  uint32_t mantissa = bits & 0x7fffffu;
  if (exponent == 0xff) {  // inf or NaN (keep NaN quiet and non-zero)
    return static_cast<uint16_t>(sign | 0x7c00u | (mantissa != 0 ? 0x200u | (mantissa >> 13) : 0));
  }
  const int32_t half_exponent = static_cast<int32_t>(exponent) - 127 + 15;
  if (half_exponent >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (half_exponent <= 0) {                                                // subnormal or zero
    if (half_exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - half_exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(half_exponent) << 10) | (mantissa >> 13);
  const uint32_t remainder = mantissa & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) ++half;  // may carry to inf
  return static_cast<uint16_t>(sign | half);
}

float HalfBitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

namespace {

template <DType kDtype>
uint16_t FloatTo16Bits(float value) {
  return kDtype == DType::kFloat16 ? FloatToHalfBits(value) : FloatToBFloat16Bits(value);
}

template <DType kDtype>
float Bits16ToFloat(uint16_t bits) {
  return kDtype == DType::kFloat16 ? HalfBitsToFloat(bits) : BFloat16BitsToFloat(bits);
}

}  // namespace

absl::Status CastFloatTo16(const float* src, uint16_t* dst, int64_t count, DType dst_dtype) {
  return internal::DispatchHalfOrBFloat16(dst_dtype, "cast to a 16-bit dtype", [&]<DType kDtype>() {
    for (int64_t i = 0; i < count; ++i) dst[i] = FloatTo16Bits<kDtype>(src[i]);
    return absl::OkStatus();
  });
}

absl::Status CastFloatTo16AsUpdate(const float* src, uint16_t* dst, int64_t count,
                                   DType dst_dtype) {
  if (dst_dtype != DType::kFloat16 && dst_dtype != DType::kBFloat16) {
    return CastFloatTo16(src, dst, count, dst_dtype);  // its error
  }
  internal::GetCpuPath(ActiveSimdLevel()).cast_to_16(src, dst, count, dst_dtype);
  return absl::OkStatus();
}

absl::Status Cast16ToFloat(const uint16_t* src, float* dst, int64_t count, DType src_dtype) {
  return internal::DispatchHalfOrBFloat16(
      src_dtype, "cast from a 16-bit dtype", [&]<DType kDtype>() {
        for (int64_t i = 0; i < count; ++i) dst[i] = Bits16ToFloat<kDtype>(src[i]);
        return absl::OkStatus();
      });
}

}  // namespace ps::kernels
