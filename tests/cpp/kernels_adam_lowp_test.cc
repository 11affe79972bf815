// Adam with low-precision state (bf16, blockwise int8) and bf16 params with Kahan compensation
// (issue 21): every SIMD path forced in turn and compared bit for bit with a scalar reference
// built from the fp32 reference step, DequantizeBlockwise and QuantizeBlockwise; thread-count
// independence, the traffic twin, argument checks, and that compensation keeps small updates.
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/grad_stats.h"
#include "kernels/internal/cpu_paths.h"
#include "kernels/internal/stochastic_rounding.h"
#include "kernels/parallel.h"
#include "kernels/quantization.h"
#include "kernels/simd.h"
#include "tests/cpp/kernels_test_util.h"

namespace ps::kernels {
namespace {

using kernel_testing::ScopedSimd;

// One chunk's storage in every form the kernel may use.
struct State {
  int64_t n = 0;
  DType param_dtype = DType::kFloat32;
  StateDType state_dtype = StateDType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  int copy = 0;  // 0 none, 1 fp16, 2 bf16
  bool stochastic = false;  // bf16 params: stochastic rounding instead of Kahan
  uint64_t seed = 0x1234567890abcdefull;
  std::vector<float> param32, m32, v32, grad32;
  std::vector<uint16_t> param16, comp, m16, v16, grad16, copy16;
  std::vector<uint8_t> m8, v8;
  std::vector<float> m_scale, v_scale;

  AdamChunk Chunk() {
    AdamChunk c;
    c.count = n;
    c.param_dtype = param_dtype;
    c.state_dtype = state_dtype;
    c.grad_dtype = grad_dtype;
    c.param = param_dtype == DType::kFloat32 ? param32.data()
                                             : reinterpret_cast<float*>(param16.data());
    if (param_dtype == DType::kBFloat16 && !stochastic) c.param_compensation = comp.data();
    if (stochastic) c.param_rounding = ParamRounding::kStochastic;
    c.rounding_seed = seed;
    c.grad = grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data())
                                           : static_cast<const void*>(grad16.data());
    switch (state_dtype) {
      case StateDType::kFloat32:
        c.exp_avg = m32.data();
        c.exp_avg_sq = v32.data();
        break;
      case StateDType::kBFloat16:
        c.exp_avg = reinterpret_cast<float*>(m16.data());
        c.exp_avg_sq = reinterpret_cast<float*>(v16.data());
        break;
      case StateDType::kInt8:
        c.exp_avg = reinterpret_cast<float*>(m8.data());
        c.exp_avg_sq = reinterpret_cast<float*>(v8.data());
        c.exp_avg_scale = m_scale.data();
        c.exp_avg_sq_scale = v_scale.data();
        break;
    }
    if (copy != 0) {
      c.param_copy = copy16.data();
      c.copy_dtype = copy == 1 ? DType::kFloat16 : DType::kBFloat16;
    }
    return c;
  }
};

State MakeState(int64_t n, DType param_dtype, StateDType state_dtype, DType grad_dtype, int copy,
                uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.n = n;
  s.param_dtype = param_dtype;
  s.state_dtype = state_dtype;
  s.grad_dtype = grad_dtype;
  s.copy = copy;
  s.param32.resize(n);
  for (float& p : s.param32) p = normal(rng);
  s.param16.resize(n);
  for (int64_t i = 0; i < n; ++i) s.param16[i] = FloatToBFloat16Bits(s.param32[i]);
  s.comp.assign(n, 0);
  s.m32.assign(n, 0.0f);
  s.v32.assign(n, 0.0f);
  s.m16.assign(n, 0);
  s.v16.assign(n, 0);
  s.m8.assign(n, 127);  // the signed map's zero
  s.v8.assign(n, 0);
  s.m_scale.assign(NumQuantizationBlocks(n), 1.0f);
  s.v_scale.assign(NumQuantizationBlocks(n), 1.0f);
  s.grad32.assign(n, 0.0f);
  s.grad16.assign(n, 0);
  s.copy16.assign(n, 0);
  return s;
}

void FillGrad(State& s, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (int64_t i = 0; i < s.n; ++i) {
    const float g = normal(rng) * 256.0f;
    if (s.grad_dtype == DType::kFloat16) {
      s.grad16[i] = FloatToHalfBits(g);
      s.grad32[i] = HalfBitsToFloat(s.grad16[i]);
    } else if (s.grad_dtype == DType::kBFloat16) {
      s.grad16[i] = FloatToBFloat16Bits(g);
      s.grad32[i] = BFloat16BitsToFloat(s.grad16[i]);
    } else {
      s.grad32[i] = g;
    }
  }
}

// torch's _single_tensor_adam on one element (Note [Adam arithmetic]); grad32 already widened.
// int8 state: sqrt(v) times float(1 / sqrt(bc2)) instead of divided by float(sqrt(bc2)) (Note
// [One division fewer for int8 state]).
void ReferenceElement(const AdamHyperParams& hp, float& p, float g, float& m, float& v,
                      bool int8) {
  const double t = static_cast<double>(hp.step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, t) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, t) : 1.0;
  const float weight = static_cast<float>(1.0 - hp.beta1);
  g = g * static_cast<float>(hp.clip_coef / hp.grad_scale);
  const bool use_wd = hp.weight_decay != 0.0;
  if (use_wd && !hp.decoupled_weight_decay) g = std::fma(p, static_cast<float>(hp.weight_decay), g);
  if (use_wd && hp.decoupled_weight_decay) p *= static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  m = std::fabs(weight) < 0.5f ? std::fma(weight, g - m, m) : std::fma(weight - 1.0f, g - m, g);
  v = std::fma(static_cast<float>(1.0 - hp.beta2) * g, g, v * static_cast<float>(hp.beta2));
  const float root = std::sqrt(v);
  const float denom = (int8 ? root * static_cast<float>(1.0 / std::pow(bc2, 0.5))
                            : root / static_cast<float>(std::pow(bc2, 0.5))) +
                      static_cast<float>(hp.eps);
  p = p + (static_cast<float>(-(hp.lr / bc1)) * m) / denom;
}

float Bf16(float x) { return BFloat16BitsToFloat(FloatToBFloat16Bits(x)); }

// The reference step of a whole state: dequantize / widen, the fp32 step, requantize / round.
void ReferenceStep(State& s, const AdamHyperParams& hp) {
  const int64_t n = s.n;
  std::vector<float> m(n), v(n);
  if (s.state_dtype == StateDType::kFloat32) {
    m = s.m32;
    v = s.v32;
  } else if (s.state_dtype == StateDType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) {
      m[i] = BFloat16BitsToFloat(s.m16[i]);
      v[i] = BFloat16BitsToFloat(s.v16[i]);
    }
  } else {
    ASSERT_TRUE(DequantizeBlockwise(s.m8.data(), s.m_scale.data(), n, QuantizationMap::kSigned,
                                    m.data())
                    .ok());
    ASSERT_TRUE(DequantizeBlockwise(s.v8.data(), s.v_scale.data(), n, QuantizationMap::kUnsigned,
                                    v.data())
                    .ok());
  }
  const bool int8 = s.state_dtype == StateDType::kInt8;
  for (int64_t i = 0; i < n; ++i) {
    if (s.param_dtype == DType::kFloat32) {
      ReferenceElement(hp, s.param32[i], s.grad32[i], m[i], v[i], int8);
      if (s.copy == 1) s.copy16[i] = FloatToHalfBits(s.param32[i]);
      if (s.copy == 2) s.copy16[i] = FloatToBFloat16Bits(s.param32[i]);
    } else if (s.stochastic) {  // Note [Stochastic rounding]
      float q = BFloat16BitsToFloat(s.param16[i]);
      ReferenceElement(hp, q, s.grad32[i], m[i], v[i], int8);
      const uint32_t random = internal::RoundingBits(internal::RoundingKey(s.seed, hp.step),
                                                     static_cast<uint32_t>(i));
      s.param16[i] = FloatToBFloat16Bits(internal::StochasticBf16(q, random));
    } else {  // Note [Low-precision Adam]: Kahan-compensated bf16 param
      const float p = BFloat16BitsToFloat(s.param16[i]);
      float q = p;
      ReferenceElement(hp, q, s.grad32[i], m[i], v[i], int8);
      const float y = (q - p) + BFloat16BitsToFloat(s.comp[i]);
      const float rounded = Bf16(p + y);
      s.param16[i] = FloatToBFloat16Bits(rounded);
      s.comp[i] = FloatToBFloat16Bits(y - (rounded - p));
    }
  }
  if (s.state_dtype == StateDType::kFloat32) {
    s.m32 = m;
    s.v32 = v;
  } else if (s.state_dtype == StateDType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) {
      s.m16[i] = FloatToBFloat16Bits(m[i]);
      s.v16[i] = FloatToBFloat16Bits(v[i]);
    }
  } else {
    ASSERT_TRUE(QuantizeBlockwise(m.data(), n, QuantizationMap::kSigned, s.m8.data(),
                                  s.m_scale.data())
                    .ok());
    ASSERT_TRUE(QuantizeBlockwise(v.data(), n, QuantizationMap::kUnsigned, s.v8.data(),
                                  s.v_scale.data())
                    .ok());
  }
}

template <typename T>
void ExpectBitEqual(const std::vector<T>& a, const std::vector<T>& b, const char* what,
                    const std::string& context) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      FAIL() << context << ": " << what << "[" << i << "] = " << +a[i] << " but reference "
             << +b[i];
    }
  }
}

void ExpectSameState(const State& a, const State& b, const std::string& context) {
  ExpectBitEqual(a.param32, b.param32, "param32", context);
  ExpectBitEqual(a.param16, b.param16, "param16", context);
  ExpectBitEqual(a.comp, b.comp, "compensation", context);
  ExpectBitEqual(a.m32, b.m32, "m32", context);
  ExpectBitEqual(a.v32, b.v32, "v32", context);
  ExpectBitEqual(a.m16, b.m16, "m16", context);
  ExpectBitEqual(a.v16, b.v16, "v16", context);
  ExpectBitEqual(a.m8, b.m8, "exp_avg codes", context);
  ExpectBitEqual(a.v8, b.v8, "exp_avg_sq codes", context);
  ExpectBitEqual(a.m_scale, b.m_scale, "exp_avg scales", context);
  ExpectBitEqual(a.v_scale, b.v_scale, "exp_avg_sq scales", context);
  ExpectBitEqual(a.copy16, b.copy16, "copy", context);
}

AdamHyperParams LossScaledParams() {
  AdamHyperParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.05;
  hp.grad_scale = 256.0;
  hp.clip_coef = 0.75;
  return hp;
}

std::string Name(const State& s, SimdLevel level, int64_t n, bool adamw) {
  return std::string(SimdLevelName(level)) + " n=" + std::to_string(n) +
         " param=" + std::string(DTypeName(s.param_dtype)) +
         (s.stochastic ? " stochastic" : "") +
         " state=" + std::string(StateDTypeName(s.state_dtype)) +
         " grad=" + std::string(DTypeName(s.grad_dtype)) + " copy=" + std::to_string(s.copy) +
         (adamw ? " AdamW" : " Adam");
}

// Every NaN as one canonical NaN (fp32 and bf16 fields): a NaN's sign and payload after
// arithmetic depend on the operand order and the form (p - a * b or p + (-a) * b) the compiler
// chose, which differs between optimization levels; a stored NaN must stay a NaN.
void CanonicalNans(State& s) {
  for (std::vector<float>* v : {&s.param32, &s.m32, &s.v32}) {
    for (float& x : *v) x = std::isnan(x) ? std::bit_cast<float>(0x7fc00000u) : x;
  }
  for (std::vector<uint16_t>* v : {&s.param16, &s.comp, &s.m16, &s.v16, &s.copy16}) {
    for (uint16_t& x : *v) x = (x & 0x7fff) > 0x7f80 ? uint16_t{0x7fc0} : x;
  }
}

// One step of the kernel on `ours` and of the reference on `ref`, then the same bits in both
// (every NaN alike with `nans_alike`).
void StepBoth(State& ours, State& ref, const AdamHyperParams& hp, const std::string& context,
              bool nans_alike = false) {
  const absl::Status status = AdamUpdate(ours.Chunk(), hp);
  ASSERT_TRUE(status.ok()) << context << ": " << status;
  ReferenceStep(ref, hp);
  if (nans_alike) {
    CanonicalNans(ours);
    CanonicalNans(ref);
  }
  ExpectSameState(ours, ref, context + " step " + std::to_string(hp.step));
}

void RunCase(int64_t n, DType param_dtype, StateDType state_dtype, DType grad_dtype, int copy,
             bool adamw, SimdLevel level, int steps = 6, bool stochastic = false) {
  ScopedSimd simd(level);
  State ours = MakeState(n, param_dtype, state_dtype, grad_dtype, copy, 7);
  ours.stochastic = stochastic;
  State ref = ours;
  const std::string context = Name(ours, level, n, adamw);
  std::mt19937 rng_ours(11), rng_ref(11);
  for (int64_t step = 1; step <= steps; ++step) {
    FillGrad(ours, rng_ours);
    FillGrad(ref, rng_ref);
    AdamHyperParams hp = LossScaledParams();
    hp.step = step;
    hp.decoupled_weight_decay = adamw;
    StepBoth(ours, ref, hp, context);
    if (testing::Test::HasFatalFailure()) return;
  }
}

struct Variant {
  DType param_dtype;
  StateDType state_dtype;
  bool stochastic = false;
};
const Variant kVariants[] = {{DType::kFloat32, StateDType::kBFloat16},
                             {DType::kFloat32, StateDType::kInt8},
                             {DType::kBFloat16, StateDType::kFloat32},
                             {DType::kBFloat16, StateDType::kBFloat16},
                             {DType::kBFloat16, StateDType::kInt8},
                             {DType::kBFloat16, StateDType::kFloat32, true},
                             {DType::kBFloat16, StateDType::kInt8, true}};

TEST(AdamLowpTest, EveryPathMatchesTheReferenceBitForBitOnTailsAndBlockEdges) {
  for (SimdLevel level : SupportedSimdLevels()) {
    for (const Variant& variant : kVariants) {
      for (int64_t n : {1, 15, 17, 100, 2047, 2048, 2049, 4133}) {
        for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
          const int max_copy = variant.param_dtype == DType::kFloat32 ? 2 : 0;
          for (int copy = 0; copy <= max_copy; ++copy) {
            for (bool adamw : {false, true}) {
              RunCase(n, variant.param_dtype, variant.state_dtype, grad, copy, adamw, level, 3,
                      variant.stochastic);
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(AdamLowpTest, EveryPathMatchesTheReferenceOnALargeChunkOverManySteps) {
  for (SimdLevel level : SupportedSimdLevels()) {
    for (const Variant& variant : kVariants) {
      RunCase(100003, variant.param_dtype, variant.state_dtype, DType::kBFloat16, 0, true, level,
              8, variant.stochastic);
      if (HasFatalFailure()) return;
    }
  }
}

// Note [vcvtneps2bf16 and denormals] in kernels/cpu_paths.cc: the conversions that instruction
// does (bf16 moments, Kahan's param and compensation, the bf16 copy) fall back to the integer
// rounding for a vector holding a denormal. Here about a third of the lanes make each value
// denormal: params near 1e-39 with a learning rate of 1e-40 (so that Kahan's sum and its
// compensation stay there), gradients of 1e-38 (a first moment of 1e-39) and of 1e-20 (a second
// moment of 1e-43). Every path must keep them as the reference does, not flush them to zero.
void RunDenormalCase(const Variant& variant, int copy, SimdLevel level) {
  ScopedSimd simd(level);
  constexpr int64_t n = 4133;
  State ours = MakeState(n, variant.param_dtype, variant.state_dtype, DType::kFloat32, copy, 5);
  ours.stochastic = variant.stochastic;
  for (int64_t i = 0; i < n; i += 3) {
    ours.param32[i] = static_cast<float>(i % 97 - 48) * 2.5e-41f;
    ours.param16[i] = FloatToBFloat16Bits(ours.param32[i]);
  }
  State ref = ours;
  const std::string context = "denormals " + Name(ours, level, n, true);
  for (int64_t step = 1; step <= 4; ++step) {
    for (State* s : {&ours, &ref}) {
      for (int64_t i = 0; i < n; ++i) {
        const float sign = (i * 7 + step) % 2 == 0 ? 1.0f : -1.0f;
        s->grad32[i] = sign * (i % 5 == 0 ? 1e-38f : i % 5 == 1 ? 1e-20f : 0.25f);
      }
    }
    AdamHyperParams hp;
    hp.lr = variant.param_dtype == DType::kFloat32 ? 1e-3 : 1e-40;
    hp.weight_decay = 0.01;
    hp.decoupled_weight_decay = true;
    hp.step = step;
    StepBoth(ours, ref, hp, context);
    if (testing::Test::HasFatalFailure()) return;
  }
}

TEST(AdamLowpTest, EveryPathKeepsDenormalsAsTheReferenceDoes) {
  for (SimdLevel level : SupportedSimdLevels()) {
    for (const Variant& variant : kVariants) {
      const int max_copy = variant.param_dtype == DType::kFloat32 ? 2 : 0;
      for (int copy = 0; copy <= max_copy; copy += 2) {
        RunDenormalCase(variant, copy, level);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Note [Paired bf16 conversions on AVX2] in kernels/cpu_paths.cc (and the avx512bf16 pairs): a
// pair of vectors holding a NaN takes the one-vector conversion, whose NaN rule (quiet, sign and
// top payload kept) every path shares. A few lanes of each vector get NaN gradients, so the bf16
// moments, Kahan's params and compensations and the copies hold NaNs next to finite values;
// every path must store the reference's bits. One NaN, all payload bits set: rounded by the
// integer add it would carry into the sign (-0). Only one: which of two NaN operands an
// instruction propagates depends on the operand order the compiler chose, which no path fixes,
// and an infinity would make more NaNs (inf - inf) that meet the first. (int8 state is left out:
// a block holding a NaN has a NaN scale, Note [Blockwise quantization], a case of its own.)
void RunNanCase(const Variant& variant, int copy, SimdLevel level) {
  ScopedSimd simd(level);
  constexpr int64_t n = 4133;
  State ours = MakeState(n, variant.param_dtype, variant.state_dtype, DType::kFloat32, copy, 6);
  ours.stochastic = variant.stochastic;
  State ref = ours;
  const std::string context = "NaNs " + Name(ours, level, n, true);
  for (int64_t step = 1; step <= 3; ++step) {
    for (State* s : {&ours, &ref}) {
      for (int64_t i = 0; i < n; ++i) {
        s->grad32[i] = (i + step) % 37 == 0 ? std::bit_cast<float>(0x7fffffffu)
                                             : 0.25f * static_cast<float>(i % 7 - 3);
      }
    }
    AdamHyperParams hp;
    hp.weight_decay = 0.01;
    hp.decoupled_weight_decay = true;
    hp.step = step;
    StepBoth(ours, ref, hp, context, /*nans_alike=*/true);
    if (testing::Test::HasFatalFailure()) return;
  }
}

TEST(AdamLowpTest, EveryPathRoundsNansAsTheReferenceDoes) {
  for (SimdLevel level : SupportedSimdLevels()) {
    for (const Variant& variant : kVariants) {
      if (variant.state_dtype == StateDType::kInt8) continue;
      const int max_copy = variant.param_dtype == DType::kFloat32 ? 2 : 0;
      for (int copy = 0; copy <= max_copy; copy += 2) {
        RunNanCase(variant, copy, level);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The AVX-512 paths read int8 code values with VBMI byte-table lookups where the CPU has VBMI
// (Note [Dequantization by byte tables]); this runs them with scalar table reads instead, so both
// variants are checked on a VBMI machine.
TEST(AdamLowpTest, Int8WithoutVbmiMatchesTheReference) {
  internal::AllowVbmiForTesting(false);
  for (SimdLevel level : SupportedSimdLevels()) {
    if (level != SimdLevel::kAvx512 && level != SimdLevel::kAvx512Bf16) continue;
    for (DType param : {DType::kFloat32, DType::kBFloat16}) {
      for (int64_t n : {17, 2049, 70001}) {
        RunCase(n, param, StateDType::kInt8, DType::kFloat32, 0, true, level, 4);
        if (HasFatalFailure()) break;
      }
    }
  }
  internal::AllowVbmiForTesting(true);
}

TEST(AdamLowpTest, ResultsDoNotDependOnTheThreadCount) {
  for (const Variant& variant : kVariants) {
    State one = MakeState(300001, variant.param_dtype, variant.state_dtype, DType::kFloat32, 0, 9);
    one.stochastic = variant.stochastic;
    State three = one;
    for (int step = 1; step <= 3; ++step) {
      std::mt19937 rng1(step), rng3(step);
      FillGrad(one, rng1);
      FillGrad(three, rng3);
      AdamHyperParams hp;
      hp.step = step;
      SetKernelThreads(1);
      ASSERT_TRUE(AdamUpdate(one.Chunk(), hp).ok());
      SetKernelThreads(3);
      ASSERT_TRUE(AdamUpdate(three.Chunk(), hp).ok());
      SetKernelThreads(0);
    }
    ExpectSameState(one, three, "1 vs 3 threads");
  }
}

// Note [The norm the update measures] on the low-precision variants: the same state as
// AdamUpdate's and ComputeGradStats' sum bit for bit.
TEST(AdamLowpTest, MeasuringTheGradientsGivesTheNormOfGradStatsAndTheSameUpdate) {
  for (const Variant& variant : kVariants) {
    for (int64_t n : {1, 32768, 70001}) {
      State plain = MakeState(n, variant.param_dtype, variant.state_dtype, DType::kBFloat16, 0, 4);
      plain.stochastic = variant.stochastic;
      std::mt19937 rng(static_cast<uint32_t>(n));
      FillGrad(plain, rng);
      State measured = plain;
      const AdamChunk chunk = plain.Chunk();
      const absl::StatusOr<GradStats> stats =
          ComputeGradStats({{chunk.grad, chunk.grad_dtype, chunk.count}});
      ASSERT_TRUE(stats.ok()) << stats.status();
      AdamHyperParams hp;
      hp.step = 1;
      ASSERT_TRUE(AdamUpdate(chunk, hp).ok());
      for (SimdLevel level : SupportedSimdLevels()) {
        State ours = measured;
        ScopedSimd simd(level);
        SetKernelThreads(3);
        const absl::StatusOr<double> norm = AdamUpdateMeasuringGradients({ours.Chunk()}, hp);
        SetKernelThreads(0);
        const std::string context = Name(ours, level, n, false);
        ASSERT_TRUE(norm.ok()) << context << ": " << norm.status();
        EXPECT_EQ(std::bit_cast<uint64_t>(*norm), std::bit_cast<uint64_t>(stats->squared_norm))
            << context;
        ExpectSameState(ours, plain, context);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// bf16 params moved by steps far below their ulp: plain rounding loses every step; Kahan
// compensation keeps them and tracks an fp32 master closely.
TEST(AdamLowpTest, KahanCompensationKeepsUpdatesBelowTheBf16Ulp) {
  const int64_t n = 4096;
  State bf = MakeState(n, DType::kBFloat16, StateDType::kFloat32, DType::kFloat32, 0, 3);
  State master = MakeState(n, DType::kFloat32, StateDType::kFloat32, DType::kFloat32, 0, 3);
  for (int64_t i = 0; i < n; ++i) {
    bf.param16[i] = FloatToBFloat16Bits(1.0f);
    master.param32[i] = 1.0f;
    bf.grad32[i] = master.grad32[i] = 1.0f;  // every step moves each param by -lr
  }
  AdamHyperParams hp;
  hp.lr = 1e-4;  // the bf16 ulp of 1 is 2^-7 = 0.0078
  for (int64_t step = 1; step <= 200; ++step) {
    hp.step = step;
    ASSERT_TRUE(AdamUpdate(bf.Chunk(), hp).ok());
    ASSERT_TRUE(AdamUpdate(master.Chunk(), hp).ok());
  }
  for (int64_t i = 0; i < n; ++i) {
    const float p = BFloat16BitsToFloat(bf.param16[i]) + BFloat16BitsToFloat(bf.comp[i]);
    // 0.98 against plain rounding's 1.0 (which never moves); the residue is the bf16 rounding of
    // the compensation itself, about 2^-9 of it per step.
    ASSERT_NEAR(p, master.param32[i], 5e-4) << i;
    ASSERT_LT(BFloat16BitsToFloat(bf.param16[i]), 1.0f);
  }
}

// Stochastic rounding is unbiased: params at 1.0 moved by -lr (far below the bf16 ulp, 2^-7)
// end, on average, where an fp32 master does; and the seed changes the draws.
TEST(AdamLowpTest, StochasticRoundingIsUnbiasedAndSeeded) {
  const int64_t n = 1 << 16;
  State bf = MakeState(n, DType::kBFloat16, StateDType::kFloat32, DType::kFloat32, 0, 3);
  bf.stochastic = true;
  for (int64_t i = 0; i < n; ++i) {
    bf.param16[i] = FloatToBFloat16Bits(1.0f);
    bf.grad32[i] = 1.0f;
  }
  State other = bf;
  other.seed = 99;
  AdamHyperParams hp;
  hp.lr = 1e-4;
  for (int64_t step = 1; step <= 100; ++step) {
    hp.step = step;
    ASSERT_TRUE(AdamUpdate(bf.Chunk(), hp).ok());
    ASSERT_TRUE(AdamUpdate(other.Chunk(), hp).ok());
  }
  double sum = 0.0;
  for (uint16_t bits : bf.param16) sum += BFloat16BitsToFloat(bits);
  EXPECT_NEAR(sum / n, 1.0 - 100 * 1e-4, 2e-4);  // plain rounding would stay at 1
  EXPECT_NE(bf.param16, other.param16);
}

TEST(AdamLowpTest, TrafficBoundTouchesTheSameElements) {
  for (SimdLevel level : SupportedSimdLevels()) {
    ScopedSimd simd(level);
    for (const Variant& variant : kVariants) {
      State s = MakeState(2100, variant.param_dtype, variant.state_dtype, DType::kFloat32, 0, 1);
      s.stochastic = variant.stochastic;
      std::fill(s.grad32.begin(), s.grad32.end(), 1.0f);
      const State before = s;
      ASSERT_TRUE(AdamTrafficBound({s.Chunk()}).ok());
      for (int64_t i = 0; i < s.n; ++i) {
        if (variant.param_dtype == DType::kFloat32) {
          ASSERT_EQ(s.param32[i], before.param32[i] + 1.0f);
        } else {
          ASSERT_NE(s.param16[i], before.param16[i]) << i;
        }
      }
      if (variant.state_dtype == StateDType::kInt8) {
        EXPECT_NE(s.m_scale, before.m_scale);  // scales are read and written
        EXPECT_NE(s.m8, before.m8);
      }
    }
  }
}

TEST(AdamLowpTest, RejectsInconsistentChunksNamingTheField) {
  State s = MakeState(8, DType::kBFloat16, StateDType::kInt8, DType::kFloat32, 0, 1);
  auto message = [](const AdamChunk& c) {
    const absl::Status status = AdamUpdate(c, AdamHyperParams{});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    return std::string(status.message());
  };
  AdamChunk c = s.Chunk();
  ASSERT_TRUE(AdamUpdate(c, {}).ok());
  AdamChunk bad = c;
  bad.param_compensation = nullptr;
  EXPECT_NE(message(bad).find("param_compensation"), std::string::npos);
  bad = c;
  bad.param_copy = s.copy16.data();
  EXPECT_NE(message(bad).find("param_copy"), std::string::npos);
  bad = c;
  bad.exp_avg_sq_scale = nullptr;
  EXPECT_NE(message(bad).find("exp_avg_sq_scale"), std::string::npos);
  bad = c;
  bad.state_dtype = StateDType::kBFloat16;
  EXPECT_NE(message(bad).find("exp_avg_scale"), std::string::npos);
  bad = c;
  bad.param_dtype = DType::kFloat16;
  EXPECT_NE(message(bad).find("param_dtype"), std::string::npos);
  bad = c;
  bad.param_dtype = DType::kFloat32;
  EXPECT_NE(message(bad).find("param_compensation"), std::string::npos);
  bad = c;
  bad.param_rounding = ParamRounding::kStochastic;  // with a compensation buffer
  EXPECT_NE(message(bad).find("param_compensation is set but param_rounding"), std::string::npos);
  bad = s.Chunk();
  bad.param_dtype = DType::kFloat32;
  bad.param_compensation = nullptr;
  bad.param_rounding = ParamRounding::kStochastic;
  EXPECT_NE(message(bad).find("param_rounding"), std::string::npos);
  bad = c;
  bad.state_dtype = static_cast<StateDType>(7);
  EXPECT_NE(message(bad).find("state_dtype"), std::string::npos);
  EXPECT_EQ(*ParseStateDType("INT8"), StateDType::kInt8);
  EXPECT_EQ(*ParseStateDType("bf16"), StateDType::kBFloat16);
  EXPECT_EQ(ParseStateDType("int4").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ps::kernels
