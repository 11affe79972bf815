// The CPU kernels for every SIMD path: one body (kernels/internal/cpu_body.inc) compiled once per
// ISA against that ISA's Ops.
//
// Note [One body, several ISAs]
// Each path is a namespace holding an Ops struct and the included body, compiled under
// `#pragma GCC target(...)` so that only those functions use the wider ISA; the rest of the
// binary stays baseline x86-64 and the paths are entered only after __builtin_cpu_supports says
// so (kernels/simd.cc). Writing the arithmetic once keeps the paths from drifting apart, which
// matters because they must round identically (Note [Identical rounding on every path] in
// kernels/adam.cc). The library is compiled with -ffp-contract=off: GCC implements the vector
// intrinsics as generic vector arithmetic and would otherwise fuse a Mul and an Add into an FMA
// on the AVX paths but not on the scalar one.
// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_* temporaries "may be used
// uninitialized" (a false positive in its own headers).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernels/internal/cpu_paths.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cast.h"
#include "kernels/quantization.h"

#define PS_INLINE inline __attribute__((always_inline))
// The per-vector lambdas: GCC does not always inline the larger ones (bf16 params with int8
// state), and a call per vector costs more than the vector's work.
#define PS_INLINE_LAMBDA __attribute__((always_inline))

namespace ps::kernels::internal {

namespace {

std::atomic<bool> vbmi_allowed{true};

// VBMI byte-table lookups (Note [Dequantization by byte tables]) when the CPU has them and
// tests have not turned them off.
bool UseVbmi() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") != 0;
  }();
  return supported && vbmi_allowed.load(std::memory_order_relaxed);
}

}  // namespace

void AllowVbmiForTesting(bool allowed) { vbmi_allowed.store(allowed); }

namespace scalar_path {

struct Ops {
  using V = float;
  static constexpr int kWidth = 1;
  static constexpr bool kNineRegions = false;
  static constexpr bool kPackCodes4 = false;
  static constexpr bool kPackCodePairs = false;
  static constexpr bool kPairedBf16 = false;  // KahanRound2 in kernels/internal/cpu_body.inc
  static PS_INLINE V Set1(float x) { return x; }
  static PS_INLINE V Load(const float* p) { return *p; }
  static PS_INLINE void Store(float* p, V x) { *p = x; }
  static PS_INLINE V LoadHalf(const uint16_t* p) { return HalfBitsToFloat(*p); }
  static PS_INLINE V LoadBf16(const uint16_t* p) { return BFloat16BitsToFloat(*p); }
  static PS_INLINE void StoreHalf(uint16_t* p, V x) { *p = FloatToHalfBits(x); }
  static PS_INLINE void StoreBf16(uint16_t* p, V x) { *p = FloatToBFloat16Bits(x); }
  static PS_INLINE void StoreTruncated16(uint16_t* p, V x) {
    *p = static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16);
  }
  static PS_INLINE V Add(V a, V b) { return a + b; }
  static PS_INLINE V Sub(V a, V b) { return a - b; }
  static PS_INLINE V Mul(V a, V b) { return a * b; }
  static PS_INLINE V Div(V a, V b) { return a / b; }
  static PS_INLINE V Sqrt(V a) { return std::sqrt(a); }
  static PS_INLINE V Fma(V a, V b, V c) { return std::fma(a, b, c); }
  static PS_INLINE bool AnyNonZero(V a) { return a != 0.0f; }

  static PS_INLINE V StoreBf16Rounded(uint16_t* p, V x) {
    *p = FloatToBFloat16Bits(x);
    return std::bit_cast<float>(static_cast<uint32_t>(*p) << 16);
  }
  using VI = int32_t;
  static PS_INLINE VI Set1I(int32_t x) { return x; }
  static PS_INLINE VI Bits(V x) { return std::bit_cast<int32_t>(x); }
  static PS_INLINE VI AndI(VI a, VI b) { return a & b; }
  // Wrapping integer arithmetic, as the vector instructions (signed overflow is UB in C++).
  static PS_INLINE VI AddI(VI a, VI b) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
  static PS_INLINE VI SubI(VI a, VI b) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
  }
  static PS_INLINE VI MulLoI(VI a, VI b) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b));
  }
  static PS_INLINE VI IotaI(int32_t base) { return base; }
  static PS_INLINE V FromBits(VI a) { return std::bit_cast<float>(a); }
  static PS_INLINE VI Srl15(VI a) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> 15); }
  static PS_INLINE V BlendIfNan(V x, V if_nan, V otherwise) {
    return std::isnan(x) ? if_nan : otherwise;
  }
  static PS_INLINE VI MaxI(VI a, VI b) { return std::max(a, b); }
  static PS_INLINE VI MinI(VI a, VI b) { return std::min(a, b); }
  static PS_INLINE VI Srl16(VI a) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> 16); }
  static PS_INLINE VI Sra31(VI a) { return a < 0 ? -1 : 0; }
  static PS_INLINE int32_t MaxLaneI(VI a) { return a; }
  static PS_INLINE V CvtI2F(VI a) { return static_cast<float>(a); }
  static PS_INLINE V Gather(const float* table, VI index) { return table[index]; }
  static PS_INLINE VI GatherI(const int32_t* table, VI index) { return table[index]; }
  static PS_INLINE VI XorI(VI a, VI b) { return a ^ b; }
  static PS_INLINE VI OrI(VI a, VI b) { return a | b; }
  static PS_INLINE VI AddIfGreaterI(VI q, VI a, VI b) { return q + (a > b ? 1 : 0); }
  static PS_INLINE VI LoadU8(const uint8_t* p) { return *p; }
  static PS_INLINE void StoreU8(uint8_t* p, VI x) { *p = static_cast<uint8_t>(x); }
  static PS_INLINE bool AnyAndZeroI(VI a, VI mask) { return (a & mask) == 0; }
  static PS_INLINE VI LoadI(const int32_t* p) { return *p; }
  static PS_INLINE void StoreI(int32_t* p, VI a) { *p = a; }
  // Note [Nearest code by arithmetic]'s operations, for the one scalar mirror of the vector code
  // (the scalar path itself uses the bucket search).
  static PS_INLINE VI Srl24(VI a) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> 24); }
  static PS_INLINE VI CvttI(V a) {  // as cvttps2dq: out of range and NaN give INT32_MIN
    return a >= -2147483648.0f && a < 2147483648.0f ? static_cast<int32_t>(a) : INT32_MIN;
  }
  static PS_INLINE VI AddIfGreaterF(VI q, V a, V b) { return q + (a > b ? 1 : 0); }
  static PS_INLINE V BlendIfGreaterF(V a, V b, V if_greater, V otherwise) {
    return a > b ? if_greater : otherwise;
  }
  static PS_INLINE V Lookup16(const float* table, VI r) { return table[r & 15]; }
  static PS_INLINE VI Lookup16I(const int32_t* table, VI r) { return table[r & 15]; }
  static PS_INLINE VI PairRegion(const FastQuantization& f, VI pair) {
    return f.pair_region_bytes[pair & 15];  // as the byte shuffle's index
  }
  static PS_INLINE VI SubSaturateU16(VI a, int32_t k) { return a > k ? a - k : 0; }
  static PS_INLINE void StoreU8Mirrored(uint8_t* p, VI q, VI sign_bits) {
    *p = static_cast<uint8_t>(sign_bits < 0 ? (q > 254 ? 0 : 254 - q) : q);
  }
  // The scalar path reads the code table directly (no groups).
  static PS_INLINE int64_t DequantizeGroups(const QuantizationTables&, const uint8_t*, int64_t,
                                            float, float*) {
    return 0;
  }

  struct Acc16 {
    double lane[16];
  };
  static PS_INLINE void AccZero(Acc16& acc) {
    for (double& lane : acc.lane) lane = 0.0;
  }
  // x's square into lane `slot` (the vector's place in its group of 16 elements).
  static PS_INLINE void AccSquare(Acc16& acc, V x, int slot) {
    acc.lane[slot] += static_cast<double>(x) * static_cast<double>(x);
  }
  static PS_INLINE void AccLanes(const Acc16& acc, double* out) {
    for (int j = 0; j < 16; ++j) out[j] = acc.lane[j];
  }
};

#include "kernels/internal/cpu_body.inc"

}  // namespace scalar_path

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2_path {

struct Ops {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr bool kNineRegions = false;  // 8-entry tables
  static constexpr bool kPackCodes4 = false;
  static PS_INLINE V Set1(float x) { return _mm256_set1_ps(x); }
  static PS_INLINE V Load(const float* p) { return _mm256_loadu_ps(p); }
  static PS_INLINE void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static PS_INLINE V LoadHalf(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static PS_INLINE V LoadBf16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static PS_INLINE void StoreHalf(uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Eight 32-bit lanes holding values < 2^16 -> eight uint16.
  static PS_INLINE void StoreLow16(uint16_t* p, __m256i words) {
    const __m256i packed = _mm256_packus_epi32(words, words);  // per 128-bit half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  }
  // Round to nearest even; NaN keeps its sign and top payload and becomes quiet (as cast.cc).
  static PS_INLINE void StoreBf16(uint16_t* p, V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    StoreLow16(p, _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                       _mm256_castsi256_ps(nan), is_nan)));
  }
  static PS_INLINE void StoreTruncated16(uint16_t* p, V x) {
    StoreLow16(p, _mm256_srli_epi32(_mm256_castps_si256(x), 16));
  }
  static PS_INLINE V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static PS_INLINE V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static PS_INLINE V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static PS_INLINE V Div(V a, V b) { return _mm256_div_ps(a, b); }
  static PS_INLINE V Sqrt(V a) { return _mm256_sqrt_ps(a); }
  static PS_INLINE V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static PS_INLINE bool AnyNonZero(V a) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ)) != 0;
  }

  // StoreBf16, returning the stored value as a float.
  static PS_INLINE V StoreBf16Rounded(uint16_t* p, V x) {
    const V rounded = RoundBf16(x);
    StoreTruncated16(p, rounded);
    return rounded;
  }
  // StoreBf16's rounding, kept in the high half of a float.
  static PS_INLINE V RoundBf16(V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256i chosen = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(nan), is_nan));
    return _mm256_castsi256_ps(_mm256_and_si256(chosen, _mm256_set1_epi32(~0xffff)));
  }

  // Note [Paired bf16 conversions on AVX2]
  // Two vectors at a time (StoreStates, KahanRound2): both round to nearest even by the integer
  // add of StoreBf16, then one pack and one permute put 16 bf16 values in one register, stored
  // whole (x0 then x1) or by halves (the two moments of a vector). The NaN rule costs StoreBf16
  // three operations per vector (the quiet payload, a compare, a blend); here one unordered
  // compare of the pair tells whether either vector holds a NaN (PairNeedsSingles), and such a
  // pair (never seen in training that goes on) takes StoreBf16 twice. Denormals need nothing:
  // the integer rounding keeps them, as the reference does. Same roundings, so the same bits as
  // StoreBf16.
  static constexpr bool kPairedBf16 = true;
  // The body (StoreStates, KahanRound2) asks this before the pair functions below, which do not
  // handle NaNs.
  static PS_INLINE bool PairNeedsSingles(V x0, V x1) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q)) != 0;
  }
  // x + 0x7fff + (bit 16 of x): the rounded value in the high half (the low half is garbage).
  static PS_INLINE __m256i RoundedHigh(V x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  }
  // The high halves of h0 and h1, in order: x0's 8 values in the low 128 bits, x1's above.
  static PS_INLINE __m256i PackHigh2(__m256i h0, __m256i h1) {
    const __m256i packed =
        _mm256_packus_epi32(_mm256_srli_epi32(h0, 16), _mm256_srli_epi32(h1, 16));
    return _mm256_permute4x64_epi64(packed, 0xd8);  // per-128-bit packing -> x0 | x1
  }
  static PS_INLINE void StoreBf16x2(uint16_t* p, V x0, V x1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        PackHigh2(RoundedHigh(x0), RoundedHigh(x1)));
  }
  static PS_INLINE void StoreBf16Split(uint16_t* p0, uint16_t* p1, V x0, V x1) {
    const __m256i both = PackHigh2(RoundedHigh(x0), RoundedHigh(x1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p0), _mm256_castsi256_si128(both));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1), _mm256_extracti128_si256(both, 1));
  }
  static PS_INLINE void StoreBf16Rounded2(uint16_t* p, V x0, V x1, V& rounded0, V& rounded1) {
    const __m256i h0 = RoundedHigh(x0), h1 = RoundedHigh(x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), PackHigh2(h0, h1));
    rounded0 = _mm256_castsi256_ps(_mm256_and_si256(h0, _mm256_set1_epi32(~0xffff)));
    rounded1 = _mm256_castsi256_ps(_mm256_and_si256(h1, _mm256_set1_epi32(~0xffff)));
  }
  using VI = __m256i;
  static PS_INLINE VI Set1I(int32_t x) { return _mm256_set1_epi32(x); }
  static PS_INLINE VI Bits(V x) { return _mm256_castps_si256(x); }
  static PS_INLINE VI AndI(VI a, VI b) { return _mm256_and_si256(a, b); }
  static PS_INLINE VI AddI(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static PS_INLINE VI SubI(VI a, VI b) { return _mm256_sub_epi32(a, b); }
  static PS_INLINE VI MulLoI(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  static PS_INLINE VI IotaI(int32_t base) {
    return _mm256_add_epi32(_mm256_set1_epi32(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static PS_INLINE V FromBits(VI a) { return _mm256_castsi256_ps(a); }
  static PS_INLINE VI Srl15(VI a) { return _mm256_srli_epi32(a, 15); }
  static PS_INLINE V BlendIfNan(V x, V if_nan, V otherwise) {
    return _mm256_blendv_ps(otherwise, if_nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  static PS_INLINE VI MaxI(VI a, VI b) { return _mm256_max_epi32(a, b); }
  static PS_INLINE VI MinI(VI a, VI b) { return _mm256_min_epi32(a, b); }
  static PS_INLINE VI Srl16(VI a) { return _mm256_srli_epi32(a, 16); }
  static PS_INLINE VI Sra31(VI a) { return _mm256_srai_epi32(a, 31); }
  static PS_INLINE int32_t MaxLaneI(VI a) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    return *std::max_element(lanes, lanes + 8);
  }
  static PS_INLINE V CvtI2F(VI a) { return _mm256_cvtepi32_ps(a); }
  static PS_INLINE V Gather(const float* table, VI index) {
    return _mm256_i32gather_ps(table, index, 4);
  }
  static PS_INLINE VI GatherI(const int32_t* table, VI index) {
    return _mm256_i32gather_epi32(table, index, 4);
  }
  static PS_INLINE VI XorI(VI a, VI b) { return _mm256_xor_si256(a, b); }
  static PS_INLINE VI OrI(VI a, VI b) { return _mm256_or_si256(a, b); }
  static PS_INLINE VI AddIfGreaterI(VI q, VI a, VI b) {  // the compare is -1 where a > b
    return _mm256_sub_epi32(q, _mm256_cmpgt_epi32(a, b));
  }
  static PS_INLINE VI LoadU8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static PS_INLINE void StoreU8(uint8_t* p, VI x) {  // lanes hold 0..255 (below 0 stores 0)
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
  static PS_INLINE VI Srl24(VI a) { return _mm256_srli_epi32(a, 24); }
  static PS_INLINE VI LoadI(const int32_t* p) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  }
  static PS_INLINE void StoreI(int32_t* p, VI a) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p), a);
  }
  static PS_INLINE VI CvttI(V a) { return _mm256_cvttps_epi32(a); }
  static PS_INLINE V BlendIfGreaterF(V a, V b, V if_greater, V otherwise) {
    return _mm256_blendv_ps(otherwise, if_greater, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  static PS_INLINE VI AddIfGreaterF(VI q, V a, V b) {
    return _mm256_sub_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)));
  }
  // Some lane with a & mask == 0 (mask >= 0): (a & mask) - 1 is negative exactly there, and
  // vtestps reads the sign bits.
  static PS_INLINE bool AnyAndZeroI(VI a, VI mask) {
    const __m256 minus_one =
        _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_and_si256(a, mask), _mm256_set1_epi32(1)));
    return !_mm256_testz_ps(minus_one, minus_one);
  }
  // table[r] for r in [0, 8) (the tables have 16 entries for the AVX-512 path).
  static PS_INLINE V Lookup16(const float* table, VI r) {
    return _mm256_permutevar8x32_ps(_mm256_load_ps(table), r);
  }
  static PS_INLINE VI Lookup16I(const int32_t* table, VI r) {
    return _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(table)),
                                       r);
  }
  // The 16-entry table of pairs of octaves by one byte shuffle: the index is the low byte of each
  // lane (below 128: a NaN's is 79, entry 15), and the other bytes, 0, read entry 0, region 0,
  // so the lane is the region with no mask (BuildFast checks pair_region_bytes[0] == 0).
  static PS_INLINE VI PairRegion(const FastQuantization& f, VI pair) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(f.pair_region_bytes)));
    return _mm256_shuffle_epi8(table, pair);
  }
  // a - k, saturated at 0, for lanes holding 0 <= a < 2^16 (16-bit saturation on the low half).
  static PS_INLINE VI SubSaturateU16(VI a, int32_t k) {
    return _mm256_subs_epu16(a, _mm256_set1_epi32(k));
  }
  // q, or 254 - q where sign_bits is negative (blendv reads the sign bit): -1 for q = 255, which
  // the stores' unsigned saturation takes to 0.
  static PS_INLINE VI Mirror(VI q, VI sign_bits) {
    const VI mirrored = _mm256_sub_epi32(_mm256_set1_epi32(254), q);
    return _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(q), _mm256_castsi256_ps(mirrored), _mm256_castsi256_ps(sign_bits)));
  }
  static PS_INLINE void StoreU8Mirrored(uint8_t* p, VI q, VI sign_bits) {
    StoreU8(p, Mirror(q, sign_bits));
  }
  // StoreU8(p0, q0) and StoreU8(p1, q1) by one pack sequence: the words of both (per 128-bit
  // half: q0's four, q1's four), the 64-bit groups reordered to q0's eight then q1's, and their
  // bytes, q0's in the low half, q1's in the high.
  static constexpr bool kPackCodePairs = true;
  static PS_INLINE void StoreU8Pair(uint8_t* p0, uint8_t* p1, VI q0, VI q1) {
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(q0, q1), 0xd8);
    const __m256i bytes = _mm256_packus_epi16(words, words);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p0), _mm256_castsi256_si128(bytes));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p1), _mm256_extracti128_si256(bytes, 1));
  }
  // AnyAndZeroI(a, mask) || AnyAndZeroI(b, mask), by an unsigned min of the masked lanes.
  static PS_INLINE bool AnyAndZeroI2(VI a, VI b, VI mask) {
    return AnyAndZeroI(_mm256_min_epu32(_mm256_and_si256(a, mask), _mm256_and_si256(b, mask)),
                       mask);
  }
  static PS_INLINE int64_t DequantizeGroups(const QuantizationTables&, const uint8_t*, int64_t,
                                            float, float*) {
    return 0;
  }
  struct Acc16 {
    __m256d lane[4];  // lanes 0-3, 4-7, 8-11, 12-15
  };
  static PS_INLINE void AccZero(Acc16& acc) {
    for (__m256d& lane : acc.lane) lane = _mm256_setzero_pd();
  }
  // x's squares into lanes 8 * slot .. 8 * slot + 7 (slot: the vector's place, 0 or 1, in its
  // group of 16 elements). A branch, not acc.lane[2 * slot], which would keep acc in memory.
  static PS_INLINE void AccSquare(Acc16& acc, V x, int slot) {
    const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    if (slot == 0) {
      acc.lane[0] = _mm256_fmadd_pd(low, low, acc.lane[0]);
      acc.lane[1] = _mm256_fmadd_pd(high, high, acc.lane[1]);
    } else {
      acc.lane[2] = _mm256_fmadd_pd(low, low, acc.lane[2]);
      acc.lane[3] = _mm256_fmadd_pd(high, high, acc.lane[3]);
    }
  }
  static PS_INLINE void AccLanes(const Acc16& acc, double* out) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_pd(out + 4 * j, acc.lane[j]);
  }
};

#include "kernels/internal/cpu_body.inc"

}  // namespace avx2_path
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512_path {

// Note [Dequantization by byte tables]
// A code's value is a 256-entry table read; gathering 16 floats costs more than the rest of a
// vector's update on the CPUs measured. With VBMI, vpermi2b reads a 128-entry byte table for 64
// indices at once, so the table is kept as four byte planes (QuantizationTables::code_byte, 16
// zmm registers): per plane two vpermi2b (codes below and above 128) and a blend on the code's
// top bit, then the four planes are interleaved back into floats with byte and word unpacks.
// The unpacks work inside 128-bit lanes, so the 64 codes are first permuted (one vpermb) such
// that the four result vectors come out in element order. The values are the table's, so the
// result is the gather's, bit for bit; then the one multiply by the scale, as everywhere.
// Result vector k's 128-bit lane L, dword q, comes from byte 16 L + 4 k + q of the permuted
// codes and must be element 16 k + 4 L + q.
alignas(64) constexpr uint8_t kVbmiOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,  //
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,  //
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,  //
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))
int64_t DequantizeGroupsVbmi(const QuantizationTables& t, const uint8_t* codes, int64_t n,
                             float scale, float* out) {
  // Plane p, codes 64 q .. 64 q + 63 (named, not an array, so that they stay in registers).
#define PS_PLANE(p, q) const __m512i plane##p##q = _mm512_load_si512(t.code_byte[p] + 64 * q)
  PS_PLANE(0, 0); PS_PLANE(0, 1); PS_PLANE(0, 2); PS_PLANE(0, 3);
  PS_PLANE(1, 0); PS_PLANE(1, 1); PS_PLANE(1, 2); PS_PLANE(1, 3);
  PS_PLANE(2, 0); PS_PLANE(2, 1); PS_PLANE(2, 2); PS_PLANE(2, 3);
  PS_PLANE(3, 0); PS_PLANE(3, 1); PS_PLANE(3, 2); PS_PLANE(3, 3);
#undef PS_PLANE
  const __m512i order = _mm512_load_si512(kVbmiOrder);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + j));
    const __mmask64 high = _mm512_movepi8_mask(c);
#define PS_LOOKUP(p)                                                               \
  _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(plane##p##0, c, plane##p##1), \
                         _mm512_permutex2var_epi8(plane##p##2, c, plane##p##3))
    const __m512i b0 = PS_LOOKUP(0), b1 = PS_LOOKUP(1), b2 = PS_LOOKUP(2), b3 = PS_LOOKUP(3);
#undef PS_LOOKUP
    const __m512i w01_low = _mm512_unpacklo_epi8(b0, b1);
    const __m512i w01_high = _mm512_unpackhi_epi8(b0, b1);
    const __m512i w23_low = _mm512_unpacklo_epi8(b2, b3);
    const __m512i w23_high = _mm512_unpackhi_epi8(b2, b3);
    const __m512i f0 = _mm512_unpacklo_epi16(w01_low, w23_low);
    const __m512i f1 = _mm512_unpackhi_epi16(w01_low, w23_low);
    const __m512i f2 = _mm512_unpacklo_epi16(w01_high, w23_high);
    const __m512i f3 = _mm512_unpackhi_epi16(w01_high, w23_high);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_castsi512_ps(f0), s));
    _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_castsi512_ps(f1), s));
    _mm512_storeu_ps(out + j + 32, _mm512_mul_ps(_mm512_castsi512_ps(f2), s));
    _mm512_storeu_ps(out + j + 48, _mm512_mul_ps(_mm512_castsi512_ps(f3), s));
  }
  return j;
}

// WidenBf16's permute: word 2 k + 1 of the result is bf16 k (word 2 k is zeroed by the mask).
alignas(64) constexpr uint16_t kWidenBf16[32] = {0, 0, 0, 1,  0, 2,  0, 3,  0, 4,  0, 5,  0, 6,
                                                 0, 7, 0, 8,  0, 9,  0, 10, 0, 11, 0, 12, 0, 13,
                                                 0, 14, 0, 15};
// The same for bf16 16 + k (the high half of a 32-bf16 vector, vcvtne2ps2bf16's first operand).
alignas(64) constexpr uint16_t kWidenBf16High[32] = {0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21,
                                                     0, 22, 0, 23, 0, 24, 0, 25, 0, 26, 0, 27,
                                                     0, 28, 0, 29, 0, 30, 0, 31};

struct Ops {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr bool kNineRegions = true;  // Note [Nearest code by arithmetic]
  static constexpr bool kPackCodes4 = true;
  static constexpr bool kPackCodePairs = false;  // four vectors at a time instead
  static constexpr bool kPairedBf16 = false;  // KahanRound2 in kernels/internal/cpu_body.inc
  static PS_INLINE V Set1(float x) { return _mm512_set1_ps(x); }
  static PS_INLINE V Load(const float* p) { return _mm512_loadu_ps(p); }
  static PS_INLINE void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static PS_INLINE V LoadHalf(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static PS_INLINE V LoadBf16(const uint16_t* p) {
    return WidenBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 bf16 -> 16 floats by one word permute into the high halves, zeroing the low ones: one
  // vector operation where the widening and a shift are two.
  static PS_INLINE V WidenBf16(__m256i halves) {
    return WidenBf16Of(_mm512_castsi256_si512(halves), kWidenBf16);
  }
  // The 16 of 32 bf16 that `table` (kWidenBf16: the low ones, kWidenBf16High) picks, as floats.
  static PS_INLINE V WidenBf16Of(__m512i bf16, const uint16_t* table) {
    return _mm512_castsi512_ps(
        _mm512_maskz_permutexvar_epi16(0xaaaaaaaa, _mm512_load_si512(table), bf16));
  }
  static PS_INLINE void StoreHalf(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Round to nearest even with integer operations (as the AVX2 path and cast.cc).
  static PS_INLINE void StoreBf16(uint16_t* p, V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan)));
  }
  static PS_INLINE void StoreTruncated16(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
  static PS_INLINE V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static PS_INLINE V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static PS_INLINE V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static PS_INLINE V Div(V a, V b) { return _mm512_div_ps(a, b); }
  static PS_INLINE V Sqrt(V a) { return _mm512_sqrt_ps(a); }
  static PS_INLINE V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static PS_INLINE bool AnyNonZero(V a) {
    return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ) != 0;
  }

  // StoreBf16, returning the stored value as a float.
  static PS_INLINE V StoreBf16Rounded(uint16_t* p, V x) {
    const V rounded = RoundBf16(x);
    StoreTruncated16(p, rounded);
    return rounded;
  }
  // StoreBf16's rounding, kept in the high half of a float.
  static PS_INLINE V RoundBf16(V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __m512i nan = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(is_nan, rounded, nan),
                                                _mm512_set1_epi32(~0xffff)));
  }
  using VI = __m512i;
  static PS_INLINE VI Set1I(int32_t x) { return _mm512_set1_epi32(x); }
  static PS_INLINE VI Bits(V x) { return _mm512_castps_si512(x); }
  static PS_INLINE VI AndI(VI a, VI b) { return _mm512_and_si512(a, b); }
  static PS_INLINE VI AddI(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static PS_INLINE VI SubI(VI a, VI b) { return _mm512_sub_epi32(a, b); }
  static PS_INLINE VI MulLoI(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  static PS_INLINE VI IotaI(int32_t base) {
    return _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                       9, 10, 11, 12, 13, 14, 15));
  }
  static PS_INLINE V FromBits(VI a) { return _mm512_castsi512_ps(a); }
  static PS_INLINE VI Srl15(VI a) { return _mm512_srli_epi32(a, 15); }
  static PS_INLINE V BlendIfNan(V x, V if_nan, V otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), otherwise, if_nan);
  }
  static PS_INLINE VI MaxI(VI a, VI b) { return _mm512_max_epi32(a, b); }
  static PS_INLINE VI MinI(VI a, VI b) { return _mm512_min_epi32(a, b); }
  static PS_INLINE VI Srl16(VI a) { return _mm512_srli_epi32(a, 16); }
  static PS_INLINE VI Sra31(VI a) { return _mm512_srai_epi32(a, 31); }
  static PS_INLINE int32_t MaxLaneI(VI a) { return _mm512_reduce_max_epi32(a); }
  static PS_INLINE V CvtI2F(VI a) { return _mm512_cvtepi32_ps(a); }
  static PS_INLINE V Gather(const float* table, VI index) {
    return _mm512_i32gather_ps(index, table, 4);
  }
  static PS_INLINE VI GatherI(const int32_t* table, VI index) {
    return _mm512_i32gather_epi32(index, table, 4);
  }
  static PS_INLINE VI XorI(VI a, VI b) { return _mm512_xor_si512(a, b); }
  static PS_INLINE VI OrI(VI a, VI b) { return _mm512_or_si512(a, b); }
  static PS_INLINE VI AddIfGreaterI(VI q, VI a, VI b) {
    return _mm512_mask_add_epi32(q, _mm512_cmpgt_epi32_mask(a, b), q, _mm512_set1_epi32(1));
  }
  static PS_INLINE VI LoadU8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static PS_INLINE void StoreU8(uint8_t* p, VI x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static PS_INLINE VI Srl23(VI a) { return _mm512_srli_epi32(a, 23); }
  static PS_INLINE VI LoadI(const int32_t* p) { return _mm512_load_si512(p); }
  static PS_INLINE void StoreI(int32_t* p, VI a) { _mm512_store_si512(p, a); }
  static PS_INLINE VI CvttI(V a) { return _mm512_cvttps_epi32(a); }
  static PS_INLINE V BlendIfGreaterF(V a, V b, V if_greater, V otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), otherwise, if_greater);
  }
  static PS_INLINE VI AddIfGreaterF(VI q, V a, V b) {
    return _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), q,
                                 _mm512_set1_epi32(1));
  }
  static PS_INLINE bool AnyAndZeroI(VI a, VI mask) {  // one vptestnmd
    return _mm512_testn_epi32_mask(a, mask) != 0;
  }
  static PS_INLINE V Lookup16(const float* table, VI r) {
    return _mm512_permutexvar_ps(r, _mm512_load_ps(table));
  }
  static PS_INLINE VI Lookup16I(const int32_t* table, VI r) {
    return _mm512_permutexvar_epi32(r, _mm512_load_si512(table));
  }
  // min(|x|, c) with the sign cleared (vrangeps, imm: min of magnitudes, sign 0); a NaN x
  // stays NaN.
  static PS_INLINE V MinAbs(V x, V c) { return _mm512_range_ps(x, c, 0x0a); }
  static PS_INLINE V MaxF(V a, V b) { return _mm512_max_ps(a, b); }  // b when either is NaN
  static PS_INLINE VI OctaveRegion(const FastQuantization& f, VI octave) {
    return _mm512_permutex2var_epi32(_mm512_load_si512(f.octave_region), octave,
                                     _mm512_load_si512(f.octave_region + 16));
  }
  static PS_INLINE VI SubSaturateU16(VI a, int32_t k) {
    return _mm512_subs_epu16(a, _mm512_set1_epi32(k));
  }
  // The mirror on the packed bytes: 254 - q saturates at 0 by itself.
  static PS_INLINE void StoreU8Mirrored(uint8_t* p, VI q, VI sign_bits) {
    const __m128i codes = _mm512_cvtepi32_epi8(q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_mask_subs_epu8(codes, _mm512_movepi32_mask(sign_bits),
                                        _mm_set1_epi8(static_cast<char>(254)), codes));
  }
  // Four vectors of codes (lanes 0..255) as 64 bytes: vpackusdw and vpackuswb work inside
  // 128-bit lanes, so lane L holds dwords 4 L .. 4 L + 3 of q[0], q[1], q[2], q[3] in that order;
  // the permute puts them in element order. Three packs and a permute where four vpmovdb are
  // eight operations. `signs` packs the sign bits alike (signed saturation keeps them).
  static PS_INLINE __m512i PackLanes4(__m512i a, __m512i b, __m512i c, __m512i d) {
    return _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
  }
  static PS_INLINE __m512i ElementOrder4(__m512i packed) {
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
  }
  static PS_INLINE void StoreU8x4(uint8_t* p, VI q0, VI q1, VI q2, VI q3) {
    _mm512_storeu_si512(p, ElementOrder4(PackLanes4(q0, q1, q2, q3)));
  }
  // StoreU8x4 of q, or of max(254 - q, 0) where sign_bits is negative (StoreU8Mirrored).
  static PS_INLINE void StoreU8x4Mirrored(uint8_t* p, VI q0, VI q1, VI q2, VI q3, VI s0, VI s1,
                                          VI s2, VI s3) {
    const __m512i codes = PackLanes4(q0, q1, q2, q3);
    const __m512i signs =
        _mm512_packs_epi16(_mm512_packs_epi32(s0, s1), _mm512_packs_epi32(s2, s3));
    _mm512_storeu_si512(p, ElementOrder4(_mm512_mask_subs_epu8(
                               codes, _mm512_movepi8_mask(signs),
                               _mm512_set1_epi8(static_cast<char>(254)), codes)));
  }
  static PS_INLINE bool AnyAndZeroI4(VI a0, VI a1, VI a2, VI a3, VI mask) {
    return (_mm512_testn_epi32_mask(a0, mask) | _mm512_testn_epi32_mask(a1, mask) |
            _mm512_testn_epi32_mask(a2, mask) | _mm512_testn_epi32_mask(a3, mask)) != 0;
  }
  // Whole groups of 64 codes by byte-table lookups where the CPU has VBMI, else none (the caller
  // gathers). Returns the elements done.
  static PS_INLINE int64_t DequantizeGroups(const QuantizationTables& t, const uint8_t* codes,
                                            int64_t n, float scale, float* out) {
    return UseVbmi() ? DequantizeGroupsVbmi(t, codes, n, scale, out) : 0;
  }

  struct Acc16 {
    __m512d lane[2];  // lanes 0-7, 8-15
  };
  static PS_INLINE void AccZero(Acc16& acc) {
    acc.lane[0] = _mm512_setzero_pd();
    acc.lane[1] = _mm512_setzero_pd();
  }
  static PS_INLINE void AccSquare(Acc16& acc, V x, int /*slot: always 0*/) {
    const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d high = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    acc.lane[0] = _mm512_fmadd_pd(low, low, acc.lane[0]);
    acc.lane[1] = _mm512_fmadd_pd(high, high, acc.lane[1]);
  }
  static PS_INLINE void AccLanes(const Acc16& acc, double* out) {
    _mm512_storeu_pd(out, acc.lane[0]);
    _mm512_storeu_pd(out + 8, acc.lane[1]);
  }
};

#include "kernels/internal/cpu_body.inc"

}  // namespace avx512_path
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace avx512bf16_path {

// Note [vcvtneps2bf16 and denormals]
// vcvtneps2bf16 rounds to nearest even and quiets NaNs exactly as the integer rounding does, but
// treats denormal inputs as zero. A vector holding a denormal (rare: |x| < 2^-126) therefore takes
// the integer rounding, so that this path's copy matches the others bit for bit.
struct Ops : avx512_path::Ops {
  // A denormal lane: one vfpclassps (class 0x20, denormal of either sign), where two tests and a
  // mask AND were three operations (twice per vector with Kahan).
  static PS_INLINE bool AnyDenormal(V x) { return _mm512_fpclass_ps_mask(x, 0x20) != 0; }
  static PS_INLINE void StoreBf16(uint16_t* p, V x) {
    if (AnyDenormal(x)) [[unlikely]] {
      avx512_path::Ops::StoreBf16(p, x);
      return;
    }
    const __m256bh converted = _mm512_cvtneps_pbh(x);
    std::memcpy(p, &converted, sizeof(converted));
  }
  // One vcvtneps2bf16 for the store and the value (widened back), denormals as StoreBf16.
  static PS_INLINE V StoreBf16Rounded(uint16_t* p, V x) {
    if (AnyDenormal(x)) [[unlikely]] {
      return avx512_path::Ops::StoreBf16Rounded(p, x);
    }
    const __m256bh converted = _mm512_cvtneps_pbh(x);
    __m256i halves;
    std::memcpy(&halves, &converted, sizeof(halves));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
    return WidenBf16(halves);
  }

  // Two vectors at a time (StoreStates, KahanRound2): x0 into p[0, 16), x1 into p[16, 32) by one
  // vcvtne2ps2bf16, as StoreBf16 and StoreBf16Rounded do each (a pair holding a denormal takes
  // them one vector at a time: PairNeedsSingles).
  static constexpr bool kPairedBf16 = true;
  // Asked by the body before the pair functions below, which would flush a denormal (as
  // vcvtne2ps2bf16 does) where StoreBf16 keeps it.
  static PS_INLINE bool PairNeedsSingles(V x0, V x1) {
    return (_mm512_fpclass_ps_mask(x0, 0x20) | _mm512_fpclass_ps_mask(x1, 0x20)) != 0;
  }
  static PS_INLINE __m512i ConvertBf16x2(V x0, V x1) {
    const __m512bh converted = _mm512_cvtne2ps_pbh(x1, x0);  // x1 in the high half
    __m512i bits;
    std::memcpy(&bits, &converted, sizeof(bits));
    return bits;
  }
  static PS_INLINE void StoreBf16x2(uint16_t* p, V x0, V x1) {
    _mm512_storeu_si512(p, ConvertBf16x2(x0, x1));
  }
  // x0 into p0[0, 16) and x1 into p1[0, 16) by one vcvtne2ps2bf16 (the two moments of a vector).
  static PS_INLINE void StoreBf16Split(uint16_t* p0, uint16_t* p1, V x0, V x1) {
    const __m512i bits = ConvertBf16x2(x0, x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p0), _mm512_castsi512_si256(bits));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p1), _mm512_extracti64x4_epi64(bits, 1));
  }
  static PS_INLINE void StoreBf16Rounded2(uint16_t* p, V x0, V x1, V& rounded0, V& rounded1) {
    const __m512i bits = ConvertBf16x2(x0, x1);
    _mm512_storeu_si512(p, bits);
    rounded0 = WidenBf16Of(bits, avx512_path::kWidenBf16);
    rounded1 = WidenBf16Of(bits, avx512_path::kWidenBf16High);
  }
};

#include "kernels/internal/cpu_body.inc"

}  // namespace avx512bf16_path
#pragma GCC pop_options

const CpuPath& GetCpuPath(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return scalar_path::kPath;
    case SimdLevel::kAvx2:
      return avx2_path::kPath;
    case SimdLevel::kAvx512:
      return avx512_path::kPath;
    case SimdLevel::kAvx512Bf16:
      return avx512bf16_path::kPath;
  }
  return scalar_path::kPath;
}

}  // namespace ps::kernels::internal
