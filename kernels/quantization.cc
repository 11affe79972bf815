#include "kernels/quantization.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runtime/status.h"

namespace ps::kernels {

// Note [Blockwise quantization]
// An 8-bit state tensor is stored as one code byte per element plus one float scale per block of
// kQuantizationBlock (2048) elements; element i belongs to block i / 2048 of its tensor (chunk),
// so the blocks never depend on how a kernel splits the work over threads (the Adam kernel's
// thread blocks, kAdamBlock, are a multiple of 2048 and start at 0). The value of code byte q in
// block b is codes[q] * scale[b].
//   scale  = max(absmax of the block, FLT_MIN), taken as an integer max over the bits of |x|:
//            exact and order-free, so every path and thread split finds the same scale; the
//            FLT_MIN floor gives an all-zero block a positive scale (its codes are then 0), and
//            a NaN (whose bits exceed inf's) makes the scale NaN, so the block reads back NaN.
//   x      = value * (1.0f / scale): one division per block, then one multiply per element.
//            |x| may exceed 1 by an ulp or two; it then takes the code 1.0 like 1 itself.
//   code   = the code nearest to x; exactly halfway (at threshold[k], the float midpoint of
//            codes k and k + 1) goes to the lower code k (Note [Nearest code by bucket]).
// Every SIMD path of the Adam kernel does exactly these operations with these tables, so the
// codes and scales are bit-identical across paths and thread counts (tested), and equal to
// QuantizeBlockwise applied to the updated fp32 state.
//
// The maps are bitsandbytes' create_dynamic_map(signed=True) and create_dynamic_map(signed=False)
// (max_exponent_bits=7, total_bits=8) evaluated with torch's float32 linspace and sorted; the
// values below were printed from that recipe and tests/python/test_adam_lowp.py re-derives them
// in torch and compares bit for bit. Signed: for each decade 10^(i-6), i = 0..6, the midpoints of
// 2^i + 1 points spread linearly over [0.1, 1] of the decade, both signs, plus 0 and 1 (note:
// no -1). Unsigned: 2^(i+1) midpoints per decade, positive only, plus 0 and 1.
namespace {

#include "kernels/internal/quantization_maps.inc"

// Note [Nearest code by bucket]
// The nearest code of x is the number of thresholds below x (thresholds ascending), which a
// binary search would find in 8 dependent table reads. Instead the float's top 16 bits (sign,
// exponent, 7 mantissa bits; magnitudes below 2^-24 folded into the first bucket of their sign,
// 2 and above into the last) select a bucket, a range of floats narrow enough (relative width
// 2^-7 = 0.8%) that at most one threshold falls inside it: neighbouring codes of both maps are
// at least 7% apart in relative terms, and the first threshold above zero is 1.6e-7 > 2^-23.
// bucket[b] holds the code of the bucket's lowest value, q; then code(x) = q + (x > threshold[q]).
// That is two table reads (a gather each on the SIMD paths) and a compare, and it is exact:
// BuildTables checks the one-threshold property for every bucket at start-up.
internal::QuantizationTables BuildTables(const float* codes) {
  internal::QuantizationTables t;
  for (int k = 0; k < 256; ++k) t.code[k] = codes[k];
  for (int k = 0; k < 255; ++k) {
    t.threshold[k] =
        static_cast<float>((static_cast<double>(codes[k]) + static_cast<double>(codes[k + 1])) / 2);
  }
  t.threshold[255] = std::numeric_limits<float>::infinity();
  // Number of thresholds below x (x > threshold), and at or below x.
  auto below = [&t](float x) {
    return static_cast<int>(std::lower_bound(t.threshold, t.threshold + 255, x) - t.threshold);
  };
  auto at_or_below = [&t](float x) {
    return static_cast<int>(std::upper_bound(t.threshold, t.threshold + 255, x) - t.threshold);
  };
  for (int32_t sign = 0; sign < 2; ++sign) {
    for (int32_t j = 0; j < internal::kBucketsPerSign; ++j) {
      const uint32_t top = static_cast<uint32_t>(j + (internal::kBucketMinExponent << 7));
      float low = j == 0 ? 0.0f : std::bit_cast<float>(top << 16);
      float high = j == internal::kBucketsPerSign - 1 ? std::numeric_limits<float>::infinity()
                                                      : std::bit_cast<float>((top << 16) | 0xffff);
      if (sign == 1) {  // the bucket of magnitudes [low, high] is the range [-high, -low]
        const float negative_high = -low;
        low = -high;
        high = negative_high;
      }
      const int q = below(low);
      PS_CHECK(at_or_below(high) - q <= 1);  // Note [Nearest code by bucket]
      t.bucket[sign * internal::kBucketsPerSign + j] = static_cast<uint8_t>(q);
    }
  }
  for (int k = 0; k < 4; ++k) t.bucket[2 * internal::kBucketsPerSign + k] = 0;
  return t;
}

}  // namespace

namespace internal {

const QuantizationTables& GetQuantizationTables(QuantizationMap map) {
  static const QuantizationTables* const kSigned = new QuantizationTables(BuildTables(kSignedCodes));
  static const QuantizationTables* const kUnsigned =
      new QuantizationTables(BuildTables(kUnsignedCodes));
  return map == QuantizationMap::kSigned ? *kSigned : *kUnsigned;
}

}  // namespace internal

absl::Span<const float> QuantizationCodes(QuantizationMap map) {
  return internal::GetQuantizationTables(map).code;
}

uint8_t QuantizeNormalized(QuantizationMap map, float normalized) {
  const internal::QuantizationTables& t = internal::GetQuantizationTables(map);
  const uint8_t q = t.bucket[internal::BucketOf(std::bit_cast<uint32_t>(normalized))];
  return static_cast<uint8_t>(q + (normalized > t.threshold[q] ? 1 : 0));
}

float BlockScale(absl::Span<const float> values) {
  int32_t bits = std::bit_cast<int32_t>(FLT_MIN);
  for (float v : values) bits = std::max(bits, std::bit_cast<int32_t>(v) & 0x7fffffff);
  return std::bit_cast<float>(bits);
}

namespace {

absl::Status CheckArguments(const char* fn, int64_t count, const void* a, const void* b,
                            const void* c, QuantizationMap map) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat(fn, ": negative count ", count));
  if (map != QuantizationMap::kSigned && map != QuantizationMap::kUnsigned) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": unknown quantization map ", static_cast<int>(map)));
  }
  if (count > 0 && (a == nullptr || b == nullptr || c == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": null pointer for ", count, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeBlockwise(const float* values, int64_t count, QuantizationMap map,
                               uint8_t* codes, float* scales) {
  PS_RETURN_IF_ERROR(CheckArguments("QuantizeBlockwise", count, values, codes, scales, map));
  for (int64_t b = 0; b < count; b += kQuantizationBlock) {
    const int64_t n = std::min(kQuantizationBlock, count - b);
    const float scale = BlockScale(absl::MakeConstSpan(values + b, n));
    const float inverse = 1.0f / scale;
    scales[b / kQuantizationBlock] = scale;
    for (int64_t i = b; i < b + n; ++i) codes[i] = QuantizeNormalized(map, values[i] * inverse);
  }
  return absl::OkStatus();
}

absl::Status DequantizeBlockwise(const uint8_t* codes, const float* scales, int64_t count,
                                 QuantizationMap map, float* values) {
  PS_RETURN_IF_ERROR(
      CheckArguments("DequantizeBlockwise", count, codes, scales, values, map));
  const float* table = internal::GetQuantizationTables(map).code;
  for (int64_t i = 0; i < count; ++i) values[i] = table[codes[i]] * scales[i / kQuantizationBlock];
  return absl::OkStatus();
}

}  // namespace ps::kernels
