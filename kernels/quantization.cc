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
//            codes k and k + 1) goes to the code nearer zero (Note [Nearest code by bucket]).
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
// The nearest code of x >= 0 is the number of thresholds below x (thresholds ascending), which a
// binary search would find in 8 dependent table reads. Instead the float's exponent and top 7
// mantissa bits (magnitudes below 2^-24 folded into the first bucket, 2 and above into the last)
// select a bucket, a range of floats narrow enough (relative width 2^-7 = 0.8%) that at most one
// threshold falls inside it: neighbouring codes of both maps are at least 7% apart in relative
// terms, and the first threshold above zero is 1.6e-7 > 2^-23. A threshold inside a bucket shares
// the bucket's top 16 bits, so x > threshold compares the low 16 bits alone, and one 32-bit entry
// per bucket holds both the code q of the bucket's lowest value and the threshold's low 16 bits:
// code(x) = q + (low16(x) > low16(threshold)). One table read (a gather on the SIMD paths) and
// an integer compare, exact: BuildTables checks the one-threshold property at start-up.
// Negative x uses the same table through the signed map's symmetry, code(-y) = 254 - code(y)
// (codes 0..126 are codes 128..254 negated, and so are the thresholds), which is why halfway
// goes toward zero on both sides; -y beyond -threshold[254] takes code 0, the map's end.
internal::QuantizationTables BuildTables(const float* codes) {
  internal::QuantizationTables t;
  for (int k = 0; k < 256; ++k) t.code[k] = codes[k];
  for (int k = 0; k < 255; ++k) {
    t.threshold[k] =
        static_cast<float>((static_cast<double>(codes[k]) + static_cast<double>(codes[k + 1])) / 2);
  }
  t.threshold[255] = std::numeric_limits<float>::infinity();
  const float* begin = t.threshold;
  const float* end = t.threshold + 255;
  for (int32_t j = 0; j < internal::kBuckets; ++j) {
    const uint32_t top = static_cast<uint32_t>(j + (internal::kBucketMinExponent << 7));
    const float low = j == 0 ? 0.0f : std::bit_cast<float>(top << 16);
    const float high = j == internal::kBuckets - 1 ? std::numeric_limits<float>::infinity()
                                                   : std::bit_cast<float>((top << 16) | 0xffff);
    const int q = static_cast<int>(std::lower_bound(begin, end, low) - t.threshold);
    const int inside = static_cast<int>(std::upper_bound(begin, end, high) - t.threshold) - q;
    PS_CHECK(inside <= 1, "bucket ", j, " holds ", inside, " thresholds");
    uint32_t key = 0xffff;
    if (inside == 1) {
      const uint32_t bits = std::bit_cast<uint32_t>(t.threshold[q]);
      PS_CHECK(j != 0 && j != internal::kBuckets - 1 && (bits >> 16) == top, "bucket ", j);
      key = bits & 0xffff;
    }
    t.bucket[j] = static_cast<uint32_t>(q) | (key << 16);
  }
  if (codes[127] == 0.0f) {  // the signed map: check the symmetry negative values rely on
    for (int k = 0; k < 127; ++k) PS_CHECK(codes[k] == -codes[254 - k], "code ", k);
    for (int k = 0; k < 127; ++k) PS_CHECK(t.threshold[k] == -t.threshold[253 - k], "t ", k);
  }
  return t;
}

}  // namespace

namespace internal {

const QuantizationTables& GetQuantizationTables(QuantizationMap map) {
  static const QuantizationTables* const kSigned =
      new QuantizationTables(BuildTables(kSignedCodes));
  static const QuantizationTables* const kUnsigned =
      new QuantizationTables(BuildTables(kUnsignedCodes));
  return map == QuantizationMap::kSigned ? *kSigned : *kUnsigned;
}

}  // namespace internal

absl::Span<const float> QuantizationCodes(QuantizationMap map) {
  return internal::GetQuantizationTables(map).code;
}

uint8_t QuantizeNormalized(QuantizationMap map, float normalized) {
  return internal::QuantizeWithTables(internal::GetQuantizationTables(map),
                                      map == QuantizationMap::kSigned,
                                      std::bit_cast<int32_t>(normalized));
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
