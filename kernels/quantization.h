// Blockwise 8-bit quantization of optimizer state (issue 21): the dynamic tree quantization maps
// of Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization" (bitsandbytes'
// create_dynamic_map: the signed map for exp_avg, the unsigned one for exp_avg_sq), blocks of
// 2048 elements with one float scale each, and round to the nearest code.
//
// The Adam kernels (kernels/adam.h, state_dtype kInt8) dequantize, update and requantize in one
// pass with the same tables and the same rounding (Note [Blockwise quantization]); the functions
// here are the standalone scalar versions, used by tests, checkpoints and state conversion.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace ps::kernels {

// Elements per quantization block. Blocks start at element 0 of the tensor (chunk) and every
// multiple of kQuantizationBlock after it, whatever the thread split.
inline constexpr int64_t kQuantizationBlock = 2048;

enum class QuantizationMap : uint8_t {
  kSigned = 0,    // 256 codes in [-1, 1]: 127 negative, 0, 127 positive, 1 (exp_avg)
  kUnsigned = 1,  // 256 codes in [0, 1]: 0, 254 positive, 1 (exp_avg_sq)
};

// Scales a tensor of `count` elements needs: ceil(count / kQuantizationBlock).
constexpr int64_t NumQuantizationBlocks(int64_t count) {
  return (count + kQuantizationBlock - 1) / kQuantizationBlock;
}

// The map's 256 code values, ascending (code byte i stands for codes[i] * block scale).
absl::Span<const float> QuantizationCodes(QuantizationMap map);

// The code byte nearest to `normalized` (a value divided by its block's scale, nominally in
// [-1, 1]); a value exactly halfway between two codes takes the one nearer zero. Beyond the
// map's range it takes the end code. The unsigned map never gives code 0: what is below code 1
// (zero and negative values included) takes code 1 (Note [The second moment never rounds to
// zero] in quantization.cc).
uint8_t QuantizeNormalized(QuantizationMap map, float normalized);

// The scale of a block holding `values`: max(absmax, FLT_MIN), so that an all-zero block has a
// positive scale (Note [Blockwise quantization]). A NaN makes the scale NaN.
float BlockScale(absl::Span<const float> values);

// values[count] -> codes[count] and scales[NumQuantizationBlocks(count)].
absl::Status QuantizeBlockwise(const float* values, int64_t count, QuantizationMap map,
                               uint8_t* codes, float* scales);
// codes + scales -> values: values[i] = codes_map[codes[i]] * scales[i / kQuantizationBlock].
absl::Status DequantizeBlockwise(const uint8_t* codes, const float* scales, int64_t count,
                                 QuantizationMap map, float* values);

namespace internal {

// The lookup tables shared by the scalar functions above and every path of the Adam kernel
// (Notes [Nearest code by bucket] and [Nearest code by arithmetic] in quantization.cc).
inline constexpr int32_t kBucketMinExponent = 103;  // biased exponent of 2^-24
inline constexpr int32_t kBuckets = (127 - kBucketMinExponent + 1) * 128;

// Note [Nearest code by arithmetic] in quantization.cc: the vector paths' nearest-code search.
// |x| selects one of kFastRegions regions (the zero code, then the map's seven decades, then the
// top code 1.0 alone), where z = fma(|x|, scale[r], offset[r]) is a fixed-point
// (kFastFractionBits) code index: the code is z >> 15 (at most last[r]) unless z mod 2^15 <
// kFastWindow, near a threshold, where the exact bucket search decides. The 8-lane (AVX2) search
// reads 8-entry tables, so it has no region 8: its region 7 also holds the top code, reached
// through the stand-in `above_top` (its own `upper8`), and looks the region up by pairs of
// octaves (`pair_region_bytes`: one 16-byte shuffle instead of a 32-entry table).
inline constexpr int32_t kFastRegions = 9;
inline constexpr int32_t kFastTopRegion = kFastRegions - 1;
inline constexpr int32_t kFastOctaves = 32;
inline constexpr int32_t kFastOctaveBase = 96;  // biased exponent of octave 0, [2^-31, 2^-30)
inline constexpr int32_t kFastFractionBits = 15;
inline constexpr int32_t kFastWindow = 8;
struct FastQuantization {
  // The region of the lowest magnitude of each octave (exponents below octave 0 count as octave
  // 0); a magnitude above upper[region] is in the next region. octave_region and upper are the
  // nine-region search's; upper8 the eight-region one's, which reads the region of the lowest
  // magnitude of each pair of octaves (2k, 2k + 1) instead: a pair holds at most one of its
  // region boundaries too.
  alignas(64) int32_t octave_region[kFastOctaves];
  alignas(16) uint8_t pair_region_bytes[kFastOctaves / 2];
  // Per region (16 entries, the last 7 unused, so that one 16-lane permute reads them): the
  // region's upper end (a threshold, +inf for the last), the linear map and the highest code.
  alignas(64) float upper[16];
  alignas(64) float scale[16];
  alignas(64) float offset[16];
  alignas(64) int32_t last[16];
  alignas(32) float upper8[8];  // upper of the eight-region search: region 7 ends at +inf
  float top;        // threshold[254]: above it the code is 255 (1.0)
  float above_top;  // the magnitude that stands in for those above top: its z gives 255
  // The nine-region search clamps magnitudes into [lowest, above_top]: below octave 0 (region 0,
  // whose z does not depend on y) and above the top (region 8, likewise) nothing changes.
  float lowest;  // 2^-31, the bottom of octave 0
};

struct QuantizationTables {
  float code[256];
  // Byte p of code[k]'s bits in code_byte[p][k]: byte-wise table lookups (VBMI).
  alignas(64) uint8_t code_byte[4][256];
  FastQuantization fast;
  // threshold[k]: midpoint of code[k] and code[k + 1], rounded to float; threshold[255] = +inf.
  float threshold[256];
  // Per bucket of magnitudes: the code of its lowest magnitude in bits 0-7 and, in bits 16-31,
  // the low 16 bits of the one threshold inside it (0xffff when none is).
  uint32_t bucket[kBuckets];
};
const QuantizationTables& GetQuantizationTables(QuantizationMap map);

// The bucket of a magnitude's bits (sign clear): exponent and the top 7 mantissa bits, with
// magnitudes below 2^-24 * (1 + 2^-7) in bucket 0 and 2 and above (inf, NaN) in the last.
inline int32_t BucketOf(int32_t magnitude_bits) {
  const int32_t b = (magnitude_bits >> 16) - (kBucketMinExponent << 7);
  return b < 0 ? 0 : (b > kBuckets - 1 ? kBuckets - 1 : b);
}

// The scalar quantization of one normalized value (the SIMD paths do the same operations).
inline uint8_t QuantizeWithTables(const QuantizationTables& t, bool is_signed, int32_t bits) {
  int32_t sign = 0;
  if (is_signed) {
    sign = bits >> 31;  // 0 or -1 (arithmetic shift)
    bits &= 0x7fffffff;
  } else if (bits < 0) {
    bits = 0;  // negative (and negative NaN) -> +0.0, which takes code 1 (Note [The second
               // moment never rounds to zero] in quantization.cc)
  }
  const uint32_t entry = t.bucket[BucketOf(bits)];
  int32_t q = static_cast<int32_t>(entry & 0xff) +
              ((bits & 0xffff) > static_cast<int32_t>(entry >> 16) ? 1 : 0);
  // Negative: the mirror code 254 - q (the signed map is symmetric but for its code 1.0).
  q = (q ^ sign) + (sign & 255);
  return static_cast<uint8_t>(q < 0 ? 0 : q);
}

}  // namespace internal
}  // namespace ps::kernels
