// fp32 <-> fp16/bf16 conversions: exhaustive over every 16-bit pattern, special values, and the
// CUDA kernels against the CPU ones when a GPU is present.
#include "kernels/cast.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/adam.h"
#include "kernels/simd.h"
#include "runtime/dtype.h"
#include "runtime/gpu.h"
#include "test_util.h"

namespace ps::kernels {
namespace {

bool IsHalfNan(uint16_t bits) { return (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0; }

TEST(CastTest, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float value = HalfBitsToFloat(static_cast<uint16_t>(bits));
    if (IsHalfNan(static_cast<uint16_t>(bits))) {
      EXPECT_TRUE(std::isnan(value));
      EXPECT_TRUE(IsHalfNan(FloatToHalfBits(value)));
      continue;
    }
    EXPECT_EQ(FloatToHalfBits(value), bits) << "half bits " << bits;
  }
}

TEST(CastTest, EveryBFloat16RoundTripsThroughFloat) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const float value = BFloat16BitsToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(BFloat16BitsToFloat(FloatToBFloat16Bits(value))));
      continue;
    }
    EXPECT_EQ(FloatToBFloat16Bits(value), bits) << "bf16 bits " << bits;
  }
}

TEST(CastTest, RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): ties go to even (1).
  EXPECT_EQ(FloatToHalfBits(1.0f + std::ldexp(1.0f, -11)), 0x3c00u);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even): rounds up.
  EXPECT_EQ(FloatToHalfBits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02u);
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bffu);     // largest half
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7c00u);     // rounds to inf
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001u);  // smallest subnormal
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -26)), 0x0000u);  // underflows to zero
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000u);
  EXPECT_EQ(FloatToBFloat16Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80u);  // tie to even
  EXPECT_EQ(FloatToBFloat16Bits(std::numeric_limits<float>::max()), 0x7f80u);
  EXPECT_EQ(FloatToBFloat16Bits(-std::numeric_limits<float>::infinity()), 0xff80u);
}

// Note [Compute chunks re-made from the master] (chunk/chunk_manager_remake.cc): a 16-bit compute
// copy made from the fp32 master must carry the bits the update's param_copy stored, on every
// SIMD path: random values of every magnitude, subnormals, zeros of both signs, infinities and
// NaNs, with lengths that leave partial vectors.
TEST(CastTest, AsUpdateGivesTheParamCopyOfTheAdamKernelOnEveryPath) {
  std::vector<float> values;
  uint32_t state = 12345;
  for (int i = 0; i < 4099; ++i) {
    state = state * 1664525u + 1013904223u;
    values.push_back(std::bit_cast<float>(state));
  }
  for (float special : {0.0f, -0.0f, std::ldexp(1.0f, -130), -std::ldexp(1.0f, -149),
                        std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), 1.0f + std::ldexp(1.0f, -8)}) {
    values.insert(values.begin() + 5, special);
  }
  for (SimdLevel level : SupportedSimdLevels()) {
    PS_ASSERT_OK(ForceSimdLevel(level));
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      for (int64_t n : {int64_t{1}, int64_t{17}, static_cast<int64_t>(values.size())}) {
        // lr 0 and a zero gradient: the kernel stores the master unchanged (NaNs quieted).
        std::vector<float> master(values.begin(), values.begin() + n);
        std::vector<float> zeros(n, 0.0f), exp_avg(n, 0.0f), exp_avg_sq(n, 0.0f);
        std::vector<uint16_t> copy(n), remade(n);
        AdamChunk chunk;
        chunk.param = master.data();
        chunk.grad = zeros.data();
        chunk.exp_avg = exp_avg.data();
        chunk.exp_avg_sq = exp_avg_sq.data();
        chunk.param_copy = copy.data();
        chunk.copy_dtype = dtype;
        chunk.count = n;
        AdamHyperParams params;
        params.lr = 0.0;
        PS_ASSERT_OK(AdamUpdate(chunk, params));
        PS_ASSERT_OK(CastFloatTo16AsUpdate(master.data(), remade.data(), n, dtype));
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(remade[i], copy[i]) << SimdLevelName(level) << " " << DTypeName(dtype)
                                        << " element " << i << " of " << n;
        }
      }
    }
  }
  ClearForcedSimdLevel();
}

TEST(CastTest, ArrayCastsRejectNon16BitTargets) {
  std::vector<float> src(4, 1.5f);
  std::vector<uint16_t> dst(4);
  EXPECT_EQ(CastFloatTo16(src.data(), dst.data(), 4, DType::kFloat32).code(),
            absl::StatusCode::kInvalidArgument);
  PS_ASSERT_OK(CastFloatTo16(src.data(), dst.data(), 4, DType::kBFloat16));
  EXPECT_EQ(dst[3], 0x3fc0u);
  std::vector<float> back(4);
  PS_ASSERT_OK(Cast16ToFloat(dst.data(), back.data(), 4, DType::kBFloat16));
  EXPECT_EQ(back[2], 1.5f);
}

TEST(CastTest, DeviceKernelsMatchTheCpu) {
  if (gpu::DeviceCount() == 0) {
    EXPECT_FALSE(CastFloatTo16OnDevice(nullptr, nullptr, 1, DType::kFloat16, {}).ok());
    GTEST_SKIP() << "no GPU: " << gpu::UnavailableReason();
  }
  constexpr int64_t kCount = 1'000'003;
  std::vector<float> host(kCount);
  ps::testing::FillRandom(host.data(), kCount * 4, 9);
  for (float& v : host) {
    if (!std::isfinite(v)) v = 1.0f;
  }
  PS_ASSERT_OK_AND_ASSIGN(gpu::Stream stream, gpu::CreateStream(0));
  PS_ASSERT_OK_AND_ASSIGN(void* src, gpu::DeviceMalloc(0, kCount * 4));
  PS_ASSERT_OK_AND_ASSIGN(void* half, gpu::DeviceMalloc(0, kCount * 2));
  PS_ASSERT_OK_AND_ASSIGN(void* back, gpu::DeviceMalloc(0, kCount * 4));
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> expected(kCount), actual(kCount);
    std::vector<float> expected_back(kCount), actual_back(kCount);
    PS_ASSERT_OK(CastFloatTo16(host.data(), expected.data(), kCount, dtype));
    PS_ASSERT_OK(Cast16ToFloat(expected.data(), expected_back.data(), kCount, dtype));
    PS_ASSERT_OK(gpu::CopyAsync(src, host.data(), kCount * 4, stream));
    PS_ASSERT_OK(CastFloatTo16OnDevice(static_cast<float*>(src), static_cast<uint16_t*>(half),
                                       kCount, dtype, stream));
    PS_ASSERT_OK(Cast16ToFloatOnDevice(static_cast<uint16_t*>(half), static_cast<float*>(back),
                                       kCount, dtype, stream));
    PS_ASSERT_OK(gpu::CopyAsync(actual.data(), half, kCount * 2, stream));
    PS_ASSERT_OK(gpu::CopyAsync(actual_back.data(), back, kCount * 4, stream));
    PS_ASSERT_OK(gpu::SynchronizeStream(stream));
    EXPECT_EQ(actual, expected) << DTypeName(dtype);
    EXPECT_EQ(std::memcmp(actual_back.data(), expected_back.data(), kCount * 4), 0);
  }
  gpu::DeviceFree(0, src);
  gpu::DeviceFree(0, half);
  gpu::DeviceFree(0, back);
  gpu::DestroyStream(stream);
}

}  // namespace
}  // namespace ps::kernels
