// Blockwise 8-bit quantization (kernels/quantization.h): the dynamic maps' shape, nearest-code
// rounding against a plain scan of the thresholds and the distance to the codes, the block
// scales (absmax, the FLT_MIN floor, NaN) and block alignment; the SIMD paths' arithmetic
// nearest-code search against the bucket search.
#include "kernels/quantization.h"

#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/internal/cpu_paths.h"
#include "kernels/simd.h"

namespace ps::kernels {
namespace {

// The specification: the number of float midpoints of neighbouring codes below x, where a
// midpoint equal to x counts as below when x < 0 (halfway goes toward zero); at least 1 in the
// unsigned map (Note [The second moment never rounds to zero]).
uint8_t ScanQuantize(QuantizationMap map, float x) {
  absl::Span<const float> codes = QuantizationCodes(map);
  int q = 0;
  for (int k = 0; k < 255; ++k) {
    const float t = static_cast<float>((double{codes[k]} + double{codes[k + 1]}) / 2);
    if (x > t || (x < 0 && x == t)) q = k + 1;
  }
  if (map == QuantizationMap::kUnsigned && q == 0) q = 1;
  return static_cast<uint8_t>(q);
}

TEST(QuantizationTest, MapsHaveTheDynamicTreeShape) {
  absl::Span<const float> s = QuantizationCodes(QuantizationMap::kSigned);
  absl::Span<const float> u = QuantizationCodes(QuantizationMap::kUnsigned);
  ASSERT_EQ(s.size(), 256u);
  ASSERT_EQ(u.size(), 256u);
  for (int k = 0; k < 255; ++k) {
    EXPECT_LT(s[k], s[k + 1]) << k;
    EXPECT_LT(u[k], u[k + 1]) << k;
  }
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_GT(s[0], -1.0f);  // bitsandbytes' signed map has 1 but not -1
  EXPECT_FLOAT_EQ(s[128], 5.5e-7f);
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_FLOAT_EQ(u[1], 3.25e-7f);
}

TEST(QuantizationTest, NearestCodeEqualsTheThresholdScanEverywhere) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.01f, 1.01f);
  std::uniform_real_distribution<float> exponent(-30.0f, 0.5f);
  for (QuantizationMap map : {QuantizationMap::kSigned, QuantizationMap::kUnsigned}) {
    std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, 2.5f, 1e-30f, -1e-30f,
                                 FLT_MIN, std::numeric_limits<float>::denorm_min()};
    absl::Span<const float> codes = QuantizationCodes(map);
    for (int k = 0; k < 256; ++k) {
      values.push_back(codes[k]);
      if (k < 255) {
        const float t = static_cast<float>((double{codes[k]} + double{codes[k + 1]}) / 2);
        values.push_back(t);
        values.push_back(std::nextafter(t, 2.0f));
        values.push_back(std::nextafter(t, -2.0f));
      }
    }
    for (int i = 0; i < 200000; ++i) values.push_back(uniform(rng));
    for (int i = 0; i < 200000; ++i) {
      const float x = std::pow(10.0f, exponent(rng));
      values.push_back(x);
      values.push_back(-x);
    }
    for (float x : values) {
      const uint8_t q = QuantizeNormalized(map, x);
      ASSERT_EQ(q, ScanQuantize(map, x)) << "x = " << x;
      // Nearest: no other code is closer, up to the rounding of the midpoint to float (but for
      // the unsigned map's code 0, never given).
      const double d = std::fabs(double{x} - codes[q]);
      const double slack = 4e-7 * std::fabs(double{x}) + 1e-40;
      if (map == QuantizationMap::kUnsigned && q == 1 && x <= codes[1]) continue;
      if (q > 0) {
        ASSERT_LE(d, std::fabs(double{x} - codes[q - 1]) + slack) << x;
      }
      if (q < 255) {
        ASSERT_LE(d, std::fabs(double{x} - codes[q + 1]) + slack) << x;
      }
    }
  }
}

// Note [Nearest code by arithmetic]: the start-up checks prove the vector search exact; this
// compares it with the bucket search on every float within 2^12 ulps of every threshold (where
// the window and the exact search matter), on the region boundaries' neighbourhoods, on special
// values and on random magnitudes, for both signs, on every path.
TEST(QuantizationTest, EveryPathsSearchEqualsTheBucketSearchNearEveryThreshold) {
  constexpr int32_t kUlps = 1 << 12;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> exponent(-35.0f, 0.01f);
  for (QuantizationMap map : {QuantizationMap::kSigned, QuantizationMap::kUnsigned}) {
    absl::Span<const float> codes = QuantizationCodes(map);
    std::vector<float> values = {0.0f, 1.0f, 1.0000001f, 1.0000002f, 0.99999994f, 2.5f, 1e30f,
                                 1e-30f, FLT_MIN, FLT_MAX, std::numeric_limits<float>::denorm_min(),
                                 std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::signaling_NaN(),
                                 std::bit_cast<float>(0x7fffffff), 1.5f, 1.9999999f};
    for (int k = 0; k < 255; ++k) {
      const float t = static_cast<float>((double{codes[k]} + double{codes[k + 1]}) / 2);
      if (!(t > 0.0f)) continue;
      const int32_t bits = std::bit_cast<int32_t>(t);
      for (int32_t d = -kUlps; d <= kUlps; ++d) values.push_back(std::bit_cast<float>(bits + d));
    }
    for (int i = 0; i < 300000; ++i) values.push_back(std::pow(10.0f, exponent(rng)));
    for (int e = 0; e < 255; ++e) values.push_back(std::bit_cast<float>(e << 23));  // octaves
    const size_t positive = values.size();
    for (size_t i = 0; i < positive; ++i) values.push_back(-values[i]);
    std::vector<uint8_t> expected(values.size());
    for (size_t i = 0; i < values.size(); ++i) expected[i] = QuantizeNormalized(map, values[i]);
    for (SimdLevel level : SupportedSimdLevels()) {
      std::vector<uint8_t> got(values.size(), 0xaa);
      internal::GetCpuPath(level).quantize_normalized(map, values.data(),
                                                      static_cast<int64_t>(values.size()),
                                                      got.data());
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(got[i], expected[i])
            << SimdLevelName(level) << " map " << static_cast<int>(map) << " x = " << values[i]
            << " (bits " << std::hex << std::bit_cast<uint32_t>(values[i]) << ")";
      }
    }
  }
}

TEST(QuantizationTest, BlockwiseRoundTripIsWithinHalfACodeGapOfTheBlockScale) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  const int64_t n = 3 * kQuantizationBlock + 77;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  for (QuantizationMap map : {QuantizationMap::kSigned, QuantizationMap::kUnsigned}) {
    std::vector<float> input = values;
    if (map == QuantizationMap::kUnsigned) {
      for (float& v : input) v = v * v;
    }
    std::vector<uint8_t> codes(n);
    std::vector<float> scales(NumQuantizationBlocks(n)), out(n);
    ASSERT_EQ(scales.size(), 4u);
    ASSERT_TRUE(QuantizeBlockwise(input.data(), n, map, codes.data(), scales.data()).ok());
    ASSERT_TRUE(DequantizeBlockwise(codes.data(), scales.data(), n, map, out.data()).ok());
    absl::Span<const float> table = QuantizationCodes(map);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = i / kQuantizationBlock;
      const float scale = scales[b];
      EXPECT_EQ(scale, BlockScale(absl::MakeConstSpan(input.data() + b * kQuantizationBlock,
                                                      std::min(kQuantizationBlock,
                                                               n - b * kQuantizationBlock))));
      const int q = codes[i];
      const double gap = std::max(q > 0 ? table[q] - table[q - 1] : 0.0,
                                  q < 255 ? table[q + 1] - table[q] : 0.0);
      // Below code 1 the unsigned map rounds up to it (Note [The second moment never rounds to
      // zero]): off by at most code 1 itself.
      const double bound = map == QuantizationMap::kUnsigned && q == 1 ? table[1] : 0.5 * gap;
      ASSERT_LE(std::fabs(double{out[i]} - input[i]), bound * scale * (1 + 1e-5) + 1e-30) << i;
    }
  }
}

// Note [The second moment never rounds to zero]: a second moment far below its block's largest
// reads back as code 1 (3.25e-7 of the block scale), never 0, on every path.
TEST(QuantizationTest, TheUnsignedMapNeverGivesCodeZero) {
  const std::vector<float> values = {0.0f, -0.0f, -1.0f, 1e-30f, 1e-8f, 1.6e-7f, 1e-3f, 1.0f};
  const std::vector<uint8_t> expected = {1, 1, 1, 1, 1, 1, 0, 255};
  for (SimdLevel level : SupportedSimdLevels()) {
    std::vector<uint8_t> got(values.size());
    internal::GetCpuPath(level).quantize_normalized(QuantizationMap::kUnsigned, values.data(),
                                                    static_cast<int64_t>(values.size()),
                                                    got.data());
    for (size_t i = 0; i + 2 < values.size(); ++i) {
      EXPECT_EQ(got[i], expected[i]) << SimdLevelName(level) << " x = " << values[i];
    }
    EXPECT_GT(got[6], 1);
    EXPECT_EQ(got[7], 255);
  }
  EXPECT_EQ(QuantizeNormalized(QuantizationMap::kSigned, 1e-30f), 127);  // the signed map's zero
}

TEST(QuantizationTest, BlocksAreFixedRelativeToTheTensorStart) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 2 * kQuantizationBlock + 5;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  std::vector<uint8_t> whole(n), piece(n);
  std::vector<float> whole_scales(3), piece_scales(3);
  ASSERT_TRUE(QuantizeBlockwise(values.data(), n, QuantizationMap::kSigned, whole.data(),
                                whole_scales.data())
                  .ok());
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t begin = b * kQuantizationBlock;
    ASSERT_TRUE(QuantizeBlockwise(values.data() + begin, std::min(kQuantizationBlock, n - begin),
                                  QuantizationMap::kSigned, piece.data() + begin,
                                  piece_scales.data() + b)
                    .ok());
  }
  EXPECT_EQ(whole, piece);
  EXPECT_EQ(whole_scales, piece_scales);
}

TEST(QuantizationTest, ZeroBlocksNaNAndArguments) {
  std::vector<float> zeros(10, 0.0f);
  std::vector<uint8_t> codes(10);
  float scale = 0.0f;
  ASSERT_TRUE(QuantizeBlockwise(zeros.data(), 10, QuantizationMap::kSigned, codes.data(), &scale)
                  .ok());
  EXPECT_EQ(scale, FLT_MIN);
  for (uint8_t q : codes) EXPECT_EQ(q, 127);
  ASSERT_TRUE(
      QuantizeBlockwise(zeros.data(), 10, QuantizationMap::kUnsigned, codes.data(), &scale).ok());
  for (uint8_t q : codes) EXPECT_EQ(q, 1);  // Note [The second moment never rounds to zero]
  zeros[3] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(
      QuantizeBlockwise(zeros.data(), 10, QuantizationMap::kSigned, codes.data(), &scale).ok());
  EXPECT_TRUE(std::isnan(scale));
  EXPECT_EQ(QuantizeBlockwise(zeros.data(), -1, QuantizationMap::kSigned, codes.data(), &scale)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeBlockwise(nullptr, 4, QuantizationMap::kSigned, codes.data(), &scale).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NumQuantizationBlocks(0), 0);
  EXPECT_EQ(NumQuantizationBlocks(2048), 1);
  EXPECT_EQ(NumQuantizationBlocks(2049), 2);
}

}  // namespace
}  // namespace ps::kernels
