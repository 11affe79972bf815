// CPU Adam/AdamW kernels: every SIMD path forced in turn and compared bit for bit with a scalar
// reference written from torch's formulas, tails, 16-bit gradients and copies, thread-count
// independence, argument checks, and the hybrid dispatcher.
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/grad_stats.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "runtime/gpu.h"
#include "tests/cpp/kernels_test_util.h"

namespace ps::kernels {
namespace {

using kernel_testing::ScopedSimd;

struct State {
  std::vector<float> param, exp_avg, exp_avg_sq;
  std::vector<float> grad_f32;   // the gradient as the kernel sees it after widening
  std::vector<uint16_t> grad16;  // the 16-bit gradient when grad_dtype is 16-bit
  std::vector<uint16_t> copy;
};

State MakeState(int64_t n, DType grad_dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.param.resize(n);
  s.exp_avg.assign(n, 0.0f);
  s.exp_avg_sq.assign(n, 0.0f);
  s.grad_f32.resize(n);
  s.grad16.resize(n);
  s.copy.assign(n, 0);
  for (int64_t i = 0; i < n; ++i) s.param[i] = normal(rng);
  return s;
}

// New gradient values for a step (in the state's grad dtype, widened copy in grad_f32).
void FillGrad(State& s, DType grad_dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (size_t i = 0; i < s.param.size(); ++i) {
    const float g = normal(rng) * 256.0f;  // looks like a loss-scaled gradient
    if (grad_dtype == DType::kFloat16) {
      s.grad16[i] = FloatToHalfBits(g);
      s.grad_f32[i] = HalfBitsToFloat(s.grad16[i]);
    } else if (grad_dtype == DType::kBFloat16) {
      s.grad16[i] = FloatToBFloat16Bits(g);
      s.grad_f32[i] = BFloat16BitsToFloat(s.grad16[i]);
    } else {
      s.grad_f32[i] = g;
    }
  }
}

AdamChunk ChunkOf(State& s, DType grad_dtype, bool with_copy, DType copy_dtype) {
  AdamChunk c;
  c.param = s.param.data();
  c.grad = grad_dtype == DType::kFloat32 ? static_cast<const void*>(s.grad_f32.data())
                                         : static_cast<const void*>(s.grad16.data());
  c.grad_dtype = grad_dtype;
  c.exp_avg = s.exp_avg.data();
  c.exp_avg_sq = s.exp_avg_sq.data();
  c.param_copy = with_copy ? s.copy.data() : nullptr;
  c.copy_dtype = copy_dtype;
  c.count = static_cast<int64_t>(s.param.size());
  return c;
}

// torch's _single_tensor_adam written out element by element (see Note [Adam arithmetic]).
void ReferenceStep(State& s, const AdamHyperParams& hp, bool with_copy, DType copy_dtype) {
  const double t = static_cast<double>(hp.step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, t) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, t) : 1.0;
  const float grad_mul = static_cast<float>(hp.clip_coef / hp.grad_scale);
  const float weight = static_cast<float>(1.0 - hp.beta1);
  const float beta2 = static_cast<float>(hp.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  const float bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  const float neg_step = static_cast<float>(-(hp.lr / bc1));
  const float eps = static_cast<float>(hp.eps);
  const bool use_wd = hp.weight_decay != 0.0;
  for (size_t i = 0; i < s.param.size(); ++i) {
    float p = s.param[i];
    float g = s.grad_f32[i] * grad_mul;
    if (use_wd && !hp.decoupled_weight_decay) {
      g = std::fma(p, static_cast<float>(hp.weight_decay), g);
    }
    if (use_wd && hp.decoupled_weight_decay) p *= static_cast<float>(1.0 - hp.lr * hp.weight_decay);
    float m = s.exp_avg[i];
    m = std::fabs(weight) < 0.5f ? std::fma(weight, g - m, m) : std::fma(weight - 1.0f, g - m, g);
    const float v = std::fma(one_minus_beta2 * g, g, s.exp_avg_sq[i] * beta2);
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    const float update = (neg_step * m) / denom;
    p = p + update;
    s.param[i] = p;
    s.exp_avg[i] = m;
    s.exp_avg_sq[i] = v;
    if (with_copy) {
      s.copy[i] = copy_dtype == DType::kFloat16 ? FloatToHalfBits(p) : FloatToBFloat16Bits(p);
    }
  }
}

void ExpectBitEqual(const std::vector<float>& a, const std::vector<float>& b, const char* what,
                    const std::string& context) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) {
      FAIL() << context << ": " << what << "[" << i << "] = " << a[i] << " but reference " << b[i];
    }
  }
}

struct Case {
  int64_t n;
  DType grad_dtype;
  bool with_copy;
  DType copy_dtype;
  bool adamw;
};

std::string CaseName(const Case& c, SimdLevel level) {
  return std::string(SimdLevelName(level)) + " n=" + std::to_string(c.n) +
         " grad=" + std::string(DTypeName(c.grad_dtype)) +
         (c.with_copy ? " copy=" + std::string(DTypeName(c.copy_dtype)) : " no copy") +
         (c.adamw ? " AdamW" : " Adam");
}

// Runs 10 steps with the kernel under `level` and with the reference, comparing every step.
void RunCase(const Case& c, SimdLevel level, const AdamHyperParams& base) {
  const std::string context = CaseName(c, level);
  ScopedSimd simd(level);
  State ours = MakeState(c.n, c.grad_dtype, 7);
  State ref = ours;
  std::mt19937 rng_ours(11), rng_ref(11);
  for (int64_t step = 1; step <= 10; ++step) {
    FillGrad(ours, c.grad_dtype, rng_ours);
    FillGrad(ref, c.grad_dtype, rng_ref);
    AdamHyperParams hp = base;
    hp.step = step;
    hp.decoupled_weight_decay = c.adamw;
    ASSERT_TRUE(AdamUpdate(ChunkOf(ours, c.grad_dtype, c.with_copy, c.copy_dtype), hp).ok());
    ReferenceStep(ref, hp, c.with_copy, c.copy_dtype);
    ExpectBitEqual(ours.param, ref.param, "param", context + " step " + std::to_string(step));
    ExpectBitEqual(ours.exp_avg, ref.exp_avg, "exp_avg", context);
    ExpectBitEqual(ours.exp_avg_sq, ref.exp_avg_sq, "exp_avg_sq", context);
    if (c.with_copy) {
      ASSERT_EQ(ours.copy, ref.copy) << context << " param copy";
    }
    if (testing::Test::HasFatalFailure()) return;
  }
}

AdamHyperParams LossScaledParams() {
  AdamHyperParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.05;
  hp.grad_scale = 256.0;
  hp.clip_coef = 0.75;
  return hp;
}

TEST(AdamKernelTest, EveryPathMatchesTheReferenceBitForBitOnTails) {
  for (SimdLevel level : SupportedSimdLevels()) {
    for (int64_t n : {1, 7, 15, 16, 17, 31, 33, 100}) {
      for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
        for (int copy = 0; copy < 3; ++copy) {
          for (bool adamw : {false, true}) {
            const Case c{n, grad, copy != 0, copy == 1 ? DType::kFloat16 : DType::kBFloat16, adamw};
            RunCase(c, level, LossScaledParams());
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(AdamKernelTest, EveryPathMatchesTheReferenceOnALargeChunk) {
  for (SimdLevel level : SupportedSimdLevels()) {
    RunCase({1000003, DType::kFloat32, true, DType::kBFloat16, true}, level, AdamHyperParams{});
    RunCase({1000003, DType::kFloat16, true, DType::kFloat16, false}, level, LossScaledParams());
    if (HasFatalFailure()) return;
  }
}

TEST(AdamKernelTest, SmallOneMinusBeta1TakesTorchsOtherLerpBranch) {
  AdamHyperParams hp;
  hp.beta1 = 0.3;  // 1 - beta1 >= 0.5: torch's lerp computes from the gradient side
  hp.bias_correction = false;
  for (SimdLevel level : SupportedSimdLevels()) {
    RunCase({37, DType::kFloat32, false, DType::kFloat16, false}, level, hp);
  }
}

TEST(AdamKernelTest, FirstStepMovesEachParamByLrAgainstTheGradientSign) {
  State s = MakeState(1000, DType::kFloat32, 3);
  std::mt19937 rng(5);
  FillGrad(s, DType::kFloat32, rng);
  const std::vector<float> before = s.param;
  AdamHyperParams hp;
  hp.lr = 0.01;
  ASSERT_TRUE(AdamUpdate(ChunkOf(s, DType::kFloat32, false, DType::kFloat16), hp).ok());
  for (size_t i = 0; i < before.size(); ++i) {
    // Step 1 with zero state: m_hat = g and sqrt(v_hat) = |g|, so the step is lr * sign(g).
    const float expected = before[i] - 0.01f * (s.grad_f32[i] > 0 ? 1.0f : -1.0f);
    EXPECT_NEAR(s.param[i], expected, 1e-6f * (1.0f + std::fabs(expected))) << i;
    EXPECT_FLOAT_EQ(s.exp_avg[i], 0.1f * s.grad_f32[i]);
  }
}

TEST(AdamKernelTest, ResultsDoNotDependOnTheThreadCount) {
  State one = MakeState(300001, DType::kBFloat16, 9);
  State two = one;
  std::mt19937 rng1(1), rng2(1);
  FillGrad(one, DType::kBFloat16, rng1);
  FillGrad(two, DType::kBFloat16, rng2);
  SetKernelThreads(1);
  ASSERT_TRUE(AdamUpdate(ChunkOf(one, DType::kBFloat16, true, DType::kBFloat16), {}).ok());
  SetKernelThreads(3);
  ASSERT_TRUE(AdamUpdate(ChunkOf(two, DType::kBFloat16, true, DType::kBFloat16), {}).ok());
  SetKernelThreads(0);
  ExpectBitEqual(one.param, two.param, "param", "1 vs 3 threads");
  EXPECT_EQ(one.copy, two.copy);
}

// Note [The norm the update measures]: the same update as AdamUpdate and ComputeGradStats' sum
// bit for bit, over several chunks whose sizes straddle the norm's blocks, on every path and
// thread count.
TEST(AdamKernelTest, MeasuringTheGradientsGivesTheNormOfGradStatsAndTheSameUpdate) {
  const int64_t sizes[] = {0, 1, 32767, 32768, 32769, 100003};
  for (DType grad_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    std::vector<State> plain, measured;
    std::vector<GradChunk> grads;
    for (int64_t n : sizes) {
      plain.push_back(MakeState(n, grad_dtype, static_cast<uint32_t>(n) + 1));
      std::mt19937 rng(static_cast<uint32_t>(n) + 2);
      FillGrad(plain.back(), grad_dtype, rng);
    }
    measured = plain;
    std::vector<AdamChunk> plain_chunks, measured_chunks;
    for (size_t c = 0; c < plain.size(); ++c) {
      plain_chunks.push_back(ChunkOf(plain[c], grad_dtype, true, DType::kBFloat16));
      measured_chunks.push_back(ChunkOf(measured[c], grad_dtype, true, DType::kBFloat16));
      grads.push_back({plain_chunks.back().grad, grad_dtype, plain_chunks.back().count});
    }
    const absl::StatusOr<GradStats> stats = ComputeGradStats(grads);
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_TRUE(AdamUpdate(plain_chunks, LossScaledParams()).ok());
    for (SimdLevel level : SupportedSimdLevels()) {
      for (int threads : {1, 3}) {
        const std::string context = absl::StrCat(SimdLevelName(level), ", ", threads,
                                                 " threads, grad ", DTypeName(grad_dtype));
        std::vector<State> states = measured;
        std::vector<AdamChunk> chunks;
        for (State& s : states) chunks.push_back(ChunkOf(s, grad_dtype, true, DType::kBFloat16));
        ScopedSimd simd(level);
        SetKernelThreads(threads);
        const absl::StatusOr<double> norm =
            AdamUpdateMeasuringGradients(chunks, LossScaledParams());
        SetKernelThreads(0);
        ASSERT_TRUE(norm.ok()) << context << ": " << norm.status();
        EXPECT_EQ(std::bit_cast<uint64_t>(*norm), std::bit_cast<uint64_t>(stats->squared_norm))
            << context << ": " << *norm << " vs " << stats->squared_norm;
        for (size_t c = 0; c < states.size(); ++c) {
          ExpectBitEqual(states[c].param, plain[c].param, "param", context);
          ExpectBitEqual(states[c].exp_avg_sq, plain[c].exp_avg_sq, "exp_avg_sq", context);
          EXPECT_EQ(states[c].copy, plain[c].copy) << context;
        }
      }
    }
  }
  const absl::StatusOr<double> empty = AdamUpdateMeasuringGradients({}, {});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 0.0);
}

// lr = 0 leaves params unchanged, so the copy shows the conversion of chosen values.
TEST(AdamKernelTest, CopiesRoundLikeTheScalarConversionsIncludingDenormalsAndNan) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               1.00390625f,
                               1.01171875f,
                               65504.0f,
                               65520.0f,
                               1e-40f,
                               -3e-39f,
                               1.17e-38f,
                               6e-8f,
                               3e-8f,
                               1e30f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               std::bit_cast<float>(0x7f80'0001u),
                               3.4028235e38f};
  while (values.size() < 37) values.push_back(1e-39f * static_cast<float>(values.size()));
  for (SimdLevel level : SupportedSimdLevels()) {
    ScopedSimd simd(level);
    for (DType copy_dtype : {DType::kFloat16, DType::kBFloat16}) {
      State s = MakeState(static_cast<int64_t>(values.size()), DType::kFloat32, 1);
      s.param = values;
      std::fill(s.grad_f32.begin(), s.grad_f32.end(), 0.0f);
      AdamHyperParams hp;
      hp.lr = 0.0;
      ASSERT_TRUE(AdamUpdate(ChunkOf(s, DType::kFloat32, true, copy_dtype), hp).ok());
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t expected = copy_dtype == DType::kFloat16 ? FloatToHalfBits(values[i])
                                                                : FloatToBFloat16Bits(values[i]);
        EXPECT_EQ(s.copy[i], expected) << SimdLevelName(level) << " " << DTypeName(copy_dtype)
                                       << " value " << values[i] << " at " << i;
      }
    }
  }
}

// PatrickStar's compute-param chunk holds the fp16 gradients and receives the new fp16 params.
TEST(AdamKernelTest, CopyMayOverwriteTheSixteenBitGradientInPlace) {
  for (SimdLevel level : SupportedSimdLevels()) {
    ScopedSimd simd(level);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      State separate = MakeState(1037, dtype, 4);
      std::mt19937 rng(6);
      FillGrad(separate, dtype, rng);
      State aliased = separate;
      ASSERT_TRUE(AdamUpdate(ChunkOf(separate, dtype, true, dtype), LossScaledParams()).ok());
      AdamChunk chunk = ChunkOf(aliased, dtype, true, dtype);
      chunk.param_copy = aliased.grad16.data();
      ASSERT_TRUE(AdamUpdate(chunk, LossScaledParams()).ok());
      ExpectBitEqual(aliased.param, separate.param, "param", "aliased grad/copy");
      EXPECT_EQ(aliased.grad16, separate.copy) << SimdLevelName(level) << DTypeName(dtype);
    }
  }
}

TEST(AdamKernelTest, TrafficBoundTouchesTheSameElements) {
  for (SimdLevel level : SupportedSimdLevels()) {
    ScopedSimd simd(level);
    State s = MakeState(45, DType::kFloat32, 1);
    std::fill(s.grad_f32.begin(), s.grad_f32.end(), 1.0f);
    const std::vector<float> before = s.param;
    ASSERT_TRUE(AdamTrafficBound({ChunkOf(s, DType::kFloat32, true, DType::kBFloat16)}).ok());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(s.param[i], before[i] + 1.0f);
      EXPECT_EQ(s.exp_avg[i], 1.0f);
      EXPECT_EQ(s.copy[i], std::bit_cast<uint32_t>(s.param[i]) >> 16);
    }
  }
}

TEST(AdamKernelTest, RejectsBadArgumentsNamingThem) {
  State s = MakeState(8, DType::kFloat32, 1);
  AdamChunk chunk = ChunkOf(s, DType::kFloat32, false, DType::kFloat16);
  AdamHyperParams hp;
  hp.lr = -1.0;
  absl::Status status = AdamUpdate(chunk, hp);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("lr"), std::string::npos) << status;
  hp = {};
  hp.step = 0;
  EXPECT_NE(AdamUpdate(chunk, hp).message().find("step"), std::string::npos);
  hp = {};
  hp.beta2 = 1.0;
  EXPECT_NE(AdamUpdate(chunk, hp).message().find("beta2"), std::string::npos);
  hp = {};
  hp.grad_scale = 0.0;
  EXPECT_NE(AdamUpdate(chunk, hp).message().find("grad_scale"), std::string::npos);
  AdamChunk bad = chunk;
  bad.param_copy = s.copy.data();
  bad.copy_dtype = DType::kFloat32;
  status = AdamUpdate(bad, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("float16 or bfloat16"), std::string::npos) << status;
  bad = chunk;
  bad.exp_avg = nullptr;
  status = AdamUpdate(std::vector<AdamChunk>{chunk, bad}, {});
  EXPECT_NE(status.message().find("chunk 1"), std::string::npos) << status;
  bad = chunk;
  bad.count = -1;
  EXPECT_EQ(AdamUpdate(bad, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(AdamKernelTest, SimdLevelsParseAndTheBestIsDetected) {
  for (SimdLevel level :
       {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512, SimdLevel::kAvx512Bf16}) {
    absl::StatusOr<SimdLevel> parsed = ParseSimdLevel(SimdLevelName(level));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, level);
  }
  EXPECT_EQ(*ParseSimdLevel("AVX2"), SimdLevel::kAvx2);
  EXPECT_EQ(ParseSimdLevel("sse9").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CpuSupports(SimdLevel::kScalar));
  EXPECT_EQ(DetectedSimdLevel(), SupportedSimdLevels().back());
  ASSERT_TRUE(ForceSimdLevel(SimdLevel::kScalar).ok());
  EXPECT_EQ(ActiveSimdLevel(), SimdLevel::kScalar);
  ClearForcedSimdLevel();
}

TEST(HybridAdamTest, HostChunksMatchAdamUpdateAndDeviceChunksNeedAGpu) {
  State a = MakeState(1001, DType::kFloat16, 2), b = MakeState(77, DType::kFloat32, 3);
  std::mt19937 rng(4);
  FillGrad(a, DType::kFloat16, rng);
  FillGrad(b, DType::kFloat32, rng);
  State a_ref = a, b_ref = b;
  const AdamHyperParams hp = LossScaledParams();
  std::vector<AdamChunkUpdate> updates = {
      {ChunkOf(a, DType::kFloat16, true, DType::kFloat16), ChunkLocation::kHost},
      {ChunkOf(b, DType::kFloat32, false, DType::kFloat16), ChunkLocation::kHost}};
  absl::StatusOr<HybridAdamReport> report = HybridAdamStep(updates, hp, {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->host_chunks, 2);
  EXPECT_EQ(report->host_elements, 1078);
  EXPECT_EQ(report->device_chunks, 0);
  ReferenceStep(a_ref, hp, true, DType::kFloat16);
  ReferenceStep(b_ref, hp, false, DType::kFloat16);
  ExpectBitEqual(a.param, a_ref.param, "param", "hybrid host chunk a");
  ExpectBitEqual(b.param, b_ref.param, "param", "hybrid host chunk b");
  EXPECT_EQ(a.copy, a_ref.copy);

  if (gpu::DeviceCount() == 0) {
    // Without a GPU, a device chunk is refused before anything is touched.
    updates[1].location = ChunkLocation::kDevice;
    const std::vector<float> before = a.param;
    report = HybridAdamStep(updates, hp, {});
    EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition) << report.status();
    EXPECT_EQ(a.param, before);
  }
}

}  // namespace
}  // namespace ps::kernels
