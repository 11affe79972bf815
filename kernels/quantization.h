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
// [-1, 1]); a value exactly halfway between two codes takes the lower one.
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

// The lookup tables shared by the scalar functions above and every SIMD path of the Adam kernel
// (Note [Nearest code by bucket]).
inline constexpr int32_t kBucketMinExponent = 103;  // biased exponent of 2^-24
inline constexpr int32_t kBucketsPerSign = (127 - kBucketMinExponent + 1) * 128;
struct QuantizationTables {
  float code[256];
  // threshold[k]: midpoint of code[k] and code[k + 1], rounded to float; threshold[255] = +inf.
  float threshold[256];
  // The lowest code of each bucket (positive buckets first); +4 bytes so that 32-bit gathers at
  // any index stay inside.
  uint8_t bucket[2 * kBucketsPerSign + 4];
};
const QuantizationTables& GetQuantizationTables(QuantizationMap map);

// The bucket of a float by its bits: sign, exponent and the top 7 mantissa bits, with
// magnitudes below 2^-24 * (1 + 2^-7) in bucket 0 of their sign and magnitudes of 2 and more (and inf, NaN) in
// the last.
inline int32_t BucketOf(uint32_t bits) {
  int32_t magnitude = static_cast<int32_t>((bits >> 16) & 0x7fff) - (kBucketMinExponent << 7);
  magnitude = magnitude < 0 ? 0 : (magnitude > kBucketsPerSign - 1 ? kBucketsPerSign - 1 : magnitude);
  return magnitude + ((bits >> 31) != 0 ? kBucketsPerSign : 0);
}

}  // namespace internal
}  // namespace ps::kernels
