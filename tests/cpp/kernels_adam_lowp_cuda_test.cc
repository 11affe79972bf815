// The GPU kernel's low-precision variants (issue 21) against the CPU kernel (which
// kernels_adam_lowp_test.cc checks against a scalar reference): int8 and bf16 state, bf16 params
// with Kahan compensation or stochastic rounding, mixed with fp32 chunks in one call and across
// launch tables. Skipped without a GPU; under the strict emulated device
// (PATRICKSTAR_STRICT_DEVICE=1) it checks the launch path, the memory ranges and the device-side
// pointers of every new field.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/quantization.h"
#include "runtime/gpu.h"
#include "tests/cpp/kernels_test_util.h"

namespace ps::kernels {
namespace {

using GpuLowpTest = kernel_testing::GpuKernelTest;

// Host storage of one chunk of any variant (the unused vectors stay empty).
struct HostChunk {
  DType param_dtype;
  StateDType state;
  DType grad_dtype;
  bool with_copy;
  bool stochastic;
  int64_t n;
  std::vector<float> param32, m32, v32, grad32, m_scale, v_scale;
  std::vector<uint16_t> param16, comp, m16, v16, grad16, copy;
  std::vector<uint8_t> m8, v8;

  AdamChunk View() {
    AdamChunk c;
    c.count = n;
    c.param_dtype = param_dtype;
    c.state_dtype = state;
    c.grad_dtype = grad_dtype;
    c.param = param_dtype == DType::kFloat32 ? param32.data()
                                             : reinterpret_cast<float*>(param16.data());
    if (param_dtype == DType::kBFloat16 && !stochastic) c.param_compensation = comp.data();
    if (stochastic) c.param_rounding = ParamRounding::kStochastic;
    c.rounding_seed = static_cast<uint64_t>(n) * 7919;
    c.grad = grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data())
                                           : static_cast<const void*>(grad16.data());
    if (state == StateDType::kFloat32) {
      c.exp_avg = m32.data();
      c.exp_avg_sq = v32.data();
    } else if (state == StateDType::kBFloat16) {
      c.exp_avg = reinterpret_cast<float*>(m16.data());
      c.exp_avg_sq = reinterpret_cast<float*>(v16.data());
    } else {
      c.exp_avg = reinterpret_cast<float*>(m8.data());
      c.exp_avg_sq = reinterpret_cast<float*>(v8.data());
      c.exp_avg_scale = m_scale.data();
      c.exp_avg_sq_scale = v_scale.data();
    }
    if (with_copy) {
      c.param_copy = copy.data();
      c.copy_dtype = DType::kBFloat16;
    }
    return c;
  }
};

HostChunk MakeChunk(int64_t n, int variant, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostChunk c;
  c.n = n;
  c.param_dtype = variant % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
  c.state = static_cast<StateDType>(variant % 3);
  c.grad_dtype = variant % 5 == 0 ? DType::kFloat16 : DType::kBFloat16;
  c.with_copy = c.param_dtype == DType::kFloat32 && variant % 4 == 0;
  c.stochastic = c.param_dtype == DType::kBFloat16 && (variant / 2) % 2 == 0;
  for (int64_t i = 0; i < n; ++i) {
    const float p = normal(rng), g = 100.0f * normal(rng);
    c.param32.push_back(p);
    c.param16.push_back(FloatToBFloat16Bits(p));
    c.grad32.push_back(g);
    c.grad16.push_back(c.grad_dtype == DType::kFloat16 ? FloatToHalfBits(g)
                                                       : FloatToBFloat16Bits(g));
    c.m32.push_back(0.01f * normal(rng));
    c.v32.push_back(1e-4f * std::fabs(normal(rng)));
    c.m16.push_back(FloatToBFloat16Bits(c.m32.back()));
    c.v16.push_back(FloatToBFloat16Bits(c.v32.back()));
  }
  c.comp.assign(n, 0);
  c.copy.assign(n, 0);
  c.m8.resize(n);
  c.v8.resize(n);
  c.m_scale.resize(NumQuantizationBlocks(n));
  c.v_scale.resize(NumQuantizationBlocks(n));
  EXPECT_TRUE(QuantizeBlockwise(c.m32.data(), n, QuantizationMap::kSigned, c.m8.data(),
                                c.m_scale.data())
                  .ok());
  EXPECT_TRUE(QuantizeBlockwise(c.v32.data(), n, QuantizationMap::kUnsigned, c.v8.data(),
                                c.v_scale.data())
                  .ok());
  return c;
}

TEST_F(GpuLowpTest, EveryVariantEqualsTheCpuKernelAcrossLaunchTables) {
  std::mt19937 rng(1);
  std::vector<HostChunk> cpu;
  // 70 chunks of six variants: more than one table of low-precision chunks (32), sizes that
  // leave partial quantization blocks, one chunk of many blocks.
  for (int i = 0; i < 70; ++i) {
    const int64_t n = i == 5 ? 300007 : (i % 7 == 0 ? 1 : 37 * i + 2040);
    cpu.push_back(MakeChunk(n, i, rng));
  }
  std::vector<HostChunk> images = cpu;
  std::vector<AdamChunk> device;
  for (HostChunk& c : images) {
    AdamChunk view = c.View();
    view.param = c.param_dtype == DType::kFloat32
                     ? ToDevice(c.param32)
                     : reinterpret_cast<float*>(ToDevice(c.param16));
    if (c.param_dtype == DType::kBFloat16 && !c.stochastic) {
      view.param_compensation = ToDevice(c.comp);
    }
    view.grad = c.grad_dtype == DType::kFloat32 ? static_cast<const void*>(ToDevice(c.grad32))
                                                : static_cast<const void*>(ToDevice(c.grad16));
    if (c.state == StateDType::kFloat32) {
      view.exp_avg = ToDevice(c.m32);
      view.exp_avg_sq = ToDevice(c.v32);
    } else if (c.state == StateDType::kBFloat16) {
      view.exp_avg = reinterpret_cast<float*>(ToDevice(c.m16));
      view.exp_avg_sq = reinterpret_cast<float*>(ToDevice(c.v16));
    } else {
      view.exp_avg = reinterpret_cast<float*>(ToDevice(c.m8));
      view.exp_avg_sq = reinterpret_cast<float*>(ToDevice(c.v8));
      view.exp_avg_scale = ToDevice(c.m_scale);
      view.exp_avg_sq_scale = ToDevice(c.v_scale);
    }
    if (c.with_copy) view.param_copy = ToDevice(c.copy);
    device.push_back(view);
  }
  for (int64_t step = 1; step <= 3; ++step) {
    AdamHyperParams hp;
    hp.lr = 1e-2;
    hp.weight_decay = 0.01;
    hp.decoupled_weight_decay = step % 2 == 0;
    hp.grad_scale = 128.0;
    hp.step = step;
    std::vector<AdamChunk> host_views;
    for (HostChunk& c : cpu) host_views.push_back(c.View());
    ASSERT_TRUE(AdamUpdate(host_views, hp).ok());
    const absl::Status status = AdamUpdateOnDevice(device, hp, stream_);
    ASSERT_TRUE(status.ok()) << status;
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const HostChunk& c = cpu[i];
    const AdamChunk& d = device[i];
    const size_t n = c.n;
    if (c.param_dtype == DType::kFloat32) {
      EXPECT_EQ(ToHost<float>(d.param, n), c.param32) << "chunk " << i;
    } else {
      EXPECT_EQ(ToHost<uint16_t>(d.param, n), c.param16) << "chunk " << i;
      if (!c.stochastic) {
        EXPECT_EQ(ToHost<uint16_t>(d.param_compensation, n), c.comp) << "chunk " << i;
      }
    }
    if (c.state == StateDType::kFloat32) {
      EXPECT_EQ(ToHost<float>(d.exp_avg, n), c.m32) << "chunk " << i;
      EXPECT_EQ(ToHost<float>(d.exp_avg_sq, n), c.v32) << "chunk " << i;
    } else if (c.state == StateDType::kBFloat16) {
      EXPECT_EQ(ToHost<uint16_t>(d.exp_avg, n), c.m16) << "chunk " << i;
      EXPECT_EQ(ToHost<uint16_t>(d.exp_avg_sq, n), c.v16) << "chunk " << i;
    } else {
      EXPECT_EQ(ToHost<uint8_t>(d.exp_avg, n), c.m8) << "chunk " << i;
      EXPECT_EQ(ToHost<uint8_t>(d.exp_avg_sq, n), c.v8) << "chunk " << i;
      EXPECT_EQ(ToHost<float>(d.exp_avg_scale, c.m_scale.size()), c.m_scale) << "chunk " << i;
      EXPECT_EQ(ToHost<float>(d.exp_avg_sq_scale, c.v_scale.size()), c.v_scale) << "chunk " << i;
    }
    if (c.with_copy) {
      EXPECT_EQ(ToHost<uint16_t>(d.param_copy, n), c.copy) << "chunk " << i;
    }
  }
}

TEST_F(GpuLowpTest, InconsistentDeviceChunksAreRefusedBeforeLaunch) {
  std::mt19937 rng(2);
  HostChunk c = MakeChunk(100, 3, rng);  // bf16 param with Kahan, fp32 state
  AdamChunk view = c.View();
  view.param_compensation = nullptr;
  const absl::Status status = AdamUpdateOnDevice({view}, AdamHyperParams{}, stream_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("param_compensation"), std::string::npos) << status;
}

}  // namespace
}  // namespace ps::kernels
