// Overflow detection and squared L2 norm of gradient chunks: every SIMD path forced, compared
// bit for bit with each other and with a reference in the documented order, tails, inf/NaN
// anywhere, 16-bit gradients, thread-count independence.
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cast.h"
#include "kernels/grad_stats.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "tests/cpp/kernels_test_util.h"

namespace ps::kernels {
namespace {

constexpr int64_t kBlock = int64_t{1} << 15;  // internal::kNormBlock

using kernel_testing::ScopedSimd;

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

// Note [Deterministic norm] written out: 16 lanes per block, tree over lanes, blocks in order.
double ReferenceSquaredNorm(const std::vector<float>& x) {
  double total = 0.0;
  for (int64_t begin = 0; begin < static_cast<int64_t>(x.size()); begin += kBlock) {
    const int64_t end = std::min<int64_t>(x.size(), begin + kBlock);
    double lanes[16] = {};
    for (int64_t i = begin; i < end; ++i) {
      lanes[(i - begin) % 16] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    }
    for (int width = 8; width >= 1; width /= 2) {
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    }
    total += lanes[0];
  }
  return total;
}

TEST(GradStatsTest, EveryPathGivesTheReferenceSumBitForBit) {
  for (int64_t n : {0, 1, 7, 15, 16, 17, 1000, 32768, 32769, 65536, 65537, 1000003}) {
    const std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n));
    const double expected = ReferenceSquaredNorm(x);
    long double exact = 0.0L;
    for (float v : x) exact += static_cast<long double>(v) * v;
    EXPECT_NEAR(expected, static_cast<double>(exact), 1e-12 * static_cast<double>(exact) + 1e-300);
    for (SimdLevel level : SupportedSimdLevels()) {
      ScopedSimd simd(level);
      absl::StatusOr<GradStats> stats = ComputeGradStats({{x.data(), DType::kFloat32, n}});
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_EQ(std::bit_cast<uint64_t>(stats->squared_norm), std::bit_cast<uint64_t>(expected))
          << SimdLevelName(level) << " n=" << n << ": " << stats->squared_norm << " vs "
          << expected;
      EXPECT_FALSE(stats->has_inf_or_nan);
      EXPECT_FALSE(*HasInfOrNan({{x.data(), DType::kFloat32, n}}));
    }
  }
}

TEST(GradStatsTest, SixteenBitGradientsAndSeveralChunks) {
  const std::vector<float> a = RandomFloats(70001, 1), b = RandomFloats(33, 2);
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  std::vector<float> a_wide(a.size()), b_wide(b.size());
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (size_t i = 0; i < a.size(); ++i) {
      a16[i] = dtype == DType::kFloat16 ? FloatToHalfBits(a[i]) : FloatToBFloat16Bits(a[i]);
      a_wide[i] = dtype == DType::kFloat16 ? HalfBitsToFloat(a16[i]) : BFloat16BitsToFloat(a16[i]);
    }
    for (size_t i = 0; i < b.size(); ++i) {
      b16[i] = dtype == DType::kFloat16 ? FloatToHalfBits(b[i]) : FloatToBFloat16Bits(b[i]);
      b_wide[i] = dtype == DType::kFloat16 ? HalfBitsToFloat(b16[i]) : BFloat16BitsToFloat(b16[i]);
    }
    const double expected = ReferenceSquaredNorm(a_wide) + ReferenceSquaredNorm(b_wide);
    for (SimdLevel level : SupportedSimdLevels()) {
      ScopedSimd simd(level);
      const std::vector<GradChunk> chunks = {{a16.data(), dtype, static_cast<int64_t>(a16.size())},
                                             {b16.data(), dtype, static_cast<int64_t>(b16.size())}};
      EXPECT_EQ(*SquaredL2Norm(chunks), expected) << SimdLevelName(level) << DTypeName(dtype);
    }
  }
}

TEST(GradStatsTest, FindsInfAndNanAnywhereOnEveryPath) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {1, 17, 100003}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (float bad : {inf, -inf, nan}) {
        std::vector<float> x = RandomFloats(n, 3);
        x[at] = bad;
        std::vector<uint16_t> half(n), bf16(n);
        for (int64_t i = 0; i < n; ++i) {
          half[i] = FloatToHalfBits(x[i]);
          bf16[i] = FloatToBFloat16Bits(x[i]);
        }
        for (SimdLevel level : SupportedSimdLevels()) {
          ScopedSimd simd(level);
          for (const GradChunk& chunk :
               {GradChunk{x.data(), DType::kFloat32, n}, GradChunk{half.data(), DType::kFloat16, n},
                GradChunk{bf16.data(), DType::kBFloat16, n}}) {
            EXPECT_TRUE(*HasInfOrNan({chunk})) << SimdLevelName(level) << " n=" << n << " at " << at
                                               << " " << DTypeName(chunk.dtype);
            const GradStats stats = *ComputeGradStats({chunk});
            EXPECT_TRUE(stats.has_inf_or_nan);
            EXPECT_FALSE(std::isfinite(stats.squared_norm));
          }
        }
      }
    }
  }
}

TEST(GradStatsTest, LargestFiniteValuesAreNotOverflow) {
  std::vector<float> x(40, std::numeric_limits<float>::max());
  std::vector<uint16_t> half(40, 0x7bff);  // 65504, the largest finite fp16
  for (SimdLevel level : SupportedSimdLevels()) {
    ScopedSimd simd(level);
    const GradStats stats = *ComputeGradStats({{x.data(), DType::kFloat32, 40}});
    EXPECT_FALSE(stats.has_inf_or_nan) << SimdLevelName(level);
    EXPECT_TRUE(std::isfinite(stats.squared_norm));
    EXPECT_FALSE(*HasInfOrNan({{x.data(), DType::kFloat32, 40}}));
    EXPECT_FALSE(*HasInfOrNan({{half.data(), DType::kFloat16, 40}}));
    EXPECT_EQ(*SquaredL2Norm({{half.data(), DType::kFloat16, 40}}), 40.0 * 65504.0 * 65504.0);
  }
}

TEST(GradStatsTest, SumDoesNotDependOnThreads) {
  const std::vector<float> x = RandomFloats(1 << 20, 8);
  SetKernelThreads(1);
  const double one = *SquaredL2Norm({{x.data(), DType::kFloat32, 1 << 20}});
  SetKernelThreads(4);
  const double four = *SquaredL2Norm({{x.data(), DType::kFloat32, 1 << 20}});
  SetKernelThreads(0);
  EXPECT_EQ(std::bit_cast<uint64_t>(one), std::bit_cast<uint64_t>(four));
}

TEST(GradStatsTest, RejectsBadChunks) {
  EXPECT_EQ(ComputeGradStats({{nullptr, DType::kFloat32, 3}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  float x = 1.0f;
  EXPECT_EQ(HasInfOrNan({{&x, DType::kFloat32, -1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*SquaredL2Norm({}), 0.0);
}

}  // namespace
}  // namespace ps::kernels
