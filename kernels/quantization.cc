#include "kernels/quantization.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <utility>

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
// Every SIMD path of the Adam kernel does exactly these operations; its nearest-code search is
// a different computation (Note [Nearest code by arithmetic]) proven to give the same code for
// every float, so the codes and scales are bit-identical across paths and thread counts
// (tested), and equal to QuantizeBlockwise applied to the updated fp32 state.
//
// The maps are bitsandbytes' create_dynamic_map(signed=True) and create_dynamic_map(signed=False)
// (max_exponent_bits=7, total_bits=8) evaluated with torch's float32 linspace and sorted; the
// values below were printed from that recipe and tests/python/test_adam_lowp.py re-derives them
// in torch and compares bit for bit. Signed: for each decade 10^(i-6), i = 0..6, the midpoints of
// 2^i + 1 points spread linearly over [0.1, 1] of the decade, both signs, plus 0 and 1 (note:
// no -1). Unsigned: 2^(i+1) midpoints per decade, positive only, plus 0 and 1.
namespace {

#include "kernels/internal/quantization_maps.inc"

// Note [The second moment never rounds to zero]
// Adam divides by sqrt(v): a second moment stored as the unsigned map's code 0 while its first
// moment kept a nonzero code made the update m / eps, about 10^8 * m. Blockwise, that is common:
// an element whose gradients are small next to its block's largest (g / G below ~4e-4, as the
// inputs of a ReLU unit that rarely fires, or rows a batch barely touches) has v / absmax(v)
// below the first threshold (1.6e-7) while m / absmax(m) is still above the signed map's
// first; a step where its gradient is 0 (the unit is off) then moved the weight by lr * 10^3 or
// more (a 63x17 ReLU layer: a weight at -6.5 after two steps, where torch's Adam keeps 0.3).
// So the unsigned map (the second moment's) rounds everything below code 1 up to code 1, the
// smallest positive value: v never reads as 0, and m / sqrt(v) stays about 1 there, as Adam's
// (an element with m at 0 only sees its v floored at 3.3e-7 of the block's scale, which moves
// nothing). The map and every other rounding are the paper's; dequantizing code 0 (from older
// checkpoints) still gives 0. bitsandbytes avoids the case differently, keeping tensors below
// 4096 elements in 32-bit state (its min_8bit_size), which chunked state cannot do per tensor.
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
// Note [Nearest code by arithmetic]
// The SIMD paths find the nearest code without a table gather (gathers were the int8 update's
// bottleneck: ~10 cycles per 16 lanes here). The map's code bytes have structure: after the
// zero code come seven decades 10^(i-6) * [0.1, 1], i = 0..6, each holding 2^i (signed) or
// 2^(i+1) (unsigned) codes spread evenly over it, then 1.0. Inside a decade the thresholds
// between its codes are, up to float rounding, evenly spaced too, so there the nearest code is
// floor(|x| * A + B) with A the inverse spacing; the threshold between a decade's last code and
// the next decade's first is not on that grid, and neither is the one below 1.0. So, for y = |x|:
//   region  the zero code, then decade 0..6, each (upper[r-1], upper[r]] with upper[r] the exact
//           threshold above its highest code, then region 8, y > threshold[254] (= top), the
//           code 255 alone. Decades are 3.3 octaves wide, so an octave holds at most one region
//           boundary: the exponent of y picks the region of its octave's low end (a 32-entry
//           table, one permute) and one compare with that region's upper end moves to the next.
//           Exact, ties included. Before that, y is clamped into [2^-31, above_top] (above_top
//           is in [1, 2), above the top): the exponent is then 96..127, whose low 5 bits are the
//           octave (96 = 3 * 32), and neither clamp changes a code, since regions 0 and 8 have
//           scale 0 (z does not depend on y there). Signed: min(|x|, above_top), sign cleared,
//           is one vrangeps that keeps a NaN, and max(2^-31, y) keeps it too (NaN -> window);
//           unsigned: two integer clamps of the bits, negative (and negative NaN) -> 2^-31, code
//           1 (region 0 takes code 1: Note [The second moment never rounds to zero]), positive
//           NaN -> above_top, code 255, the bucket search's codes for them.
//   top, 8 lanes  the AVX2 tables hold 8 entries (one 256-bit permute), so that path has no
//           region 8: y > top is replaced by `above_top`, whose z in region 7 is 255 (region 7's
//           last is 255; in the nine-region search its y <= top keeps z below 255), and it reads
//           its own `upper8` (region 7 ends at +inf), and takes the region by pairs of octaves
//           (`pair_region_bytes`, 16 entries: one byte shuffle; a pair is 2 octaves wide, still
//           less than a decade, so it too holds at most one region boundary).
//   index   z = fma(y, A[r] 2^15, B[r] 2^15 + window / 2), truncated to an integer; the code is
//           min(z >> 15, last[r]). The clamp keeps the gap above a decade's last code, where z
//           runs on by up to 2 codes, on that last code (the last region has no such gap).
//   window  rounding (of the codes, the thresholds and the fma) moves z by up to about an ulp
//           (1/2 at 2^22) around the exact crossings of the integers, so lanes with z mod 2^15 <
//           kFastWindow (2^-12 of a code: about 2 in 10^4 uniformly spread values, and NaN,
//           whose conversion gives INT_MIN) are redone with the bucket search (inf is above
//           the top).
// Why the rest is exact: z is a monotone function of y (fma with A >= 0 is correctly rounded,
// truncation is monotone), so inside a region it suffices that for every threshold t[k] inside
// it, z(t[k]) < (k + 1) 2^15 + window and z(the float above t[k]) >= (k + 1) 2^15: then every y
// in (t[k-1], t[k]] has z in [k 2^15, (k + 1) 2^15 + window), which is in a window or floors
// to k. BuildFast checks exactly that at start-up (two evaluations per threshold, with std::fma,
// the vector fma's rounding), with the region ends, the stand-in above the top and the
// one-boundary-per-octave property, for both searches (and the clamps' ends);
// kernels_quantization_test compares every path with the bucket search on every float near each
// threshold, special values (NaN payloads and a signaling NaN among them) and random values.
internal::FastQuantization BuildFast(const internal::QuantizationTables& t, bool is_signed) {
  using internal::kFastFractionBits;
  using internal::kFastRegions;
  using internal::kFastTopRegion;
  using internal::kFastWindow;
  internal::FastQuantization f{};
  const int zero = is_signed ? 127 : 0;
  int first[kFastRegions], last[kFastRegions];
  first[0] = last[0] = zero;
  for (int i = 0; i < 7; ++i) {
    first[i + 1] = is_signed ? 127 + (1 << i) : (1 << (i + 1)) - 1;
    last[i + 1] = is_signed ? 126 + (1 << (i + 1)) : (1 << (i + 2)) - 2;
  }
  first[kFastTopRegion] = last[kFastTopRegion] = 255;
  constexpr int kDecade6 = kFastTopRegion - 1;  // region 7, the last decade
  PS_CHECK(last[kDecade6] == 254, "the last decade ends at ", last[kDecade6]);
  constexpr double kOne = 1 << kFastFractionBits;
  const float inf = std::numeric_limits<float>::infinity();
  for (int r = 0; r < kFastRegions; ++r) {
    const int lo = first[r], hi = last[r];
    PS_CHECK(r == 0 || lo == last[r - 1] + 1, "regions do not tile the codes at ", r);
    f.upper[r] = r == kFastTopRegion ? inf : t.threshold[hi];
    // Region 7 of the eight-region search also takes the stand-in for y > top (code 255); in the
    // nine-region search its y <= top (z below 255, checked below), so the clamp is inactive.
    f.last[r] = r == kDecade6 ? 255 : hi;
    if (lo == hi) {
      f.scale[r] = 0.0f;
      f.offset[r] = static_cast<float>((lo + 0.5) * kOne);
      continue;
    }
    const double a =
        (hi - lo) / (static_cast<double>(t.code[hi]) - static_cast<double>(t.code[lo]));
    f.scale[r] = static_cast<float>(a * kOne);
    f.offset[r] = static_cast<float>((lo + 0.5 - static_cast<double>(t.code[lo]) * a) * kOne +
                                     kFastWindow / 2);
  }
  if (!is_signed) {  // region 0 takes code 1: Note [The second moment never rounds to zero]
    f.last[0] = 1;
    f.offset[0] = static_cast<float>(1.5 * kOne);
  }
  for (int r = 0; r < 8; ++r) f.upper8[r] = r == kDecade6 ? inf : f.upper[r];
  f.top = t.threshold[254];
  PS_CHECK(f.upper[kDecade6] == f.top, "region 7 does not end at threshold[254]");
  f.above_top = static_cast<float>((255.5 * kOne - f.offset[kDecade6]) / f.scale[kDecade6]);
  f.lowest = std::ldexp(1.0f, internal::kFastOctaveBase - 127);
  // The region formulas against every threshold inside them (Note [Nearest code by arithmetic]).
  auto z = [&f](int r, float y) {
    const float v = std::fma(y, f.scale[r], f.offset[r]);
    return v >= -2147483648.0f && v < 2147483648.0f ? int64_t{static_cast<int32_t>(v)}
                                                      : int64_t{INT32_MIN};
  };
  for (int r = 1; r < kFastRegions; ++r) {
    const float bottom = std::nextafter(f.upper[r - 1], inf);
    PS_CHECK(z(r, bottom) >= int64_t{first[r]} << kFastFractionBits, "region ", r,
             " starts below its first code");
    for (int k = first[r]; k < last[r]; ++k) {
      const int64_t crossing = int64_t{k + 1} << kFastFractionBits;
      PS_CHECK(z(r, t.threshold[k]) < crossing + kFastWindow, "threshold ", k, " is late");
      PS_CHECK(z(r, std::nextafter(t.threshold[k], inf)) >= crossing, "threshold ", k,
               " is early");
    }
  }
  // Octave -> region of its low end (nine-region search), pair of octaves -> the same (eight-
  // region search); at most one boundary inside an octave, or a pair. For the `count` regions
  // ending at upper[]: the region of `low`, and how many region ends lie in [low, width * low).
  auto locate = [](const float* upper, int count, float low, float width) {
    int region = 0, inside = 0;
    for (int r = 0; r < count; ++r) {
      if (upper[r] < low) ++region;
      if (upper[r] >= low && upper[r] < width * low) ++inside;
    }
    return std::pair{region, inside};
  };
  for (int octave = 0; octave < internal::kFastOctaves; ++octave) {
    const float low = std::ldexp(1.0f, octave + internal::kFastOctaveBase - 127);
    const auto [region, inside] = locate(f.upper, kFastRegions, low, 2);
    PS_CHECK(inside <= 1, "octave ", octave, " holds ", inside, " region boundaries");
    PS_CHECK(octave != 0 || region == 0, "a region boundary below octave 0");
    f.octave_region[octave] = region;
  }
  for (int pair = 0; pair < internal::kFastOctaves / 2; ++pair) {
    const float low = std::ldexp(1.0f, 2 * pair + internal::kFastOctaveBase - 127);
    const auto [region8, inside] = locate(f.upper8, 8, low, 4);
    PS_CHECK(inside <= 1, "octaves ", 2 * pair, " and ", 2 * pair + 1, " hold ", inside,
             " region boundaries");
    PS_CHECK(pair != 0 || region8 == 0, "a region boundary below octave 0");
    f.pair_region_bytes[pair] = static_cast<uint8_t>(region8);
  }
  PS_CHECK(z(kDecade6, f.top) < int64_t{255} << kFastFractionBits,
           "z at threshold 254 is too high");
  // The stand-in above the top (eight-region search): in the last octave's region, region 7,
  // code 255, clear of the window.
  const int32_t above_bits = std::bit_cast<int32_t>(f.above_top);
  PS_CHECK((above_bits >> 23) - internal::kFastOctaveBase == internal::kFastOctaves - 1 &&
               f.pair_region_bytes[internal::kFastOctaves / 2 - 1] == kDecade6,
           "above_top ", f.above_top, " is not in the last region");
  const int64_t z_above = z(kDecade6, f.above_top);
  PS_CHECK(z_above >> kFastFractionBits == 255 &&
               (z_above & ((1 << kFastFractionBits) - 1)) >= kFastWindow,
           "above_top gives z ", z_above);
  // The nine-region search's clamp: above_top is above the top and in the last octave, whose
  // region is then 8; lowest is in octave 0 and region 0; region 8's z is 255, clear.
  PS_CHECK(f.above_top > f.top && f.octave_region[internal::kFastOctaves - 1] == kFastTopRegion,
           "the clamp above_top is not in region 8");
  PS_CHECK(f.lowest < f.upper[0] && (std::bit_cast<int32_t>(f.lowest) >> 23) ==
                                        internal::kFastOctaveBase,
           "the clamp lowest is not in octave 0, region 0");
  const int64_t z_top = z(kFastTopRegion, f.above_top);
  PS_CHECK(z_top >> kFastFractionBits == 255 &&
               (z_top & ((1 << kFastFractionBits) - 1)) >= kFastWindow,
           "region 8 gives z ", z_top);
  return f;
}

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
  const bool is_signed = codes[127] == 0.0f;
  if (!is_signed) {  // Note [The second moment never rounds to zero]: code 0 is never chosen
    for (int32_t j = 0; j < internal::kBuckets && (t.bucket[j] & 0xff) == 0; ++j) {
      t.bucket[j] = 1u | (0xffffu << 16);
    }
  }
  if (is_signed) {  // check the symmetry negative values rely on
    for (int k = 0; k < 127; ++k) PS_CHECK(codes[k] == -codes[254 - k], "code ", k);
    for (int k = 0; k < 127; ++k) PS_CHECK(t.threshold[k] == -t.threshold[253 - k], "t ", k);
  }
  for (int k = 0; k < 256; ++k) {
    const uint32_t bits = std::bit_cast<uint32_t>(codes[k]);
    for (int p = 0; p < 4; ++p) t.code_byte[p][k] = static_cast<uint8_t>(bits >> (8 * p));
  }
  t.fast = BuildFast(t, is_signed);
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
