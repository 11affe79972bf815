// The GPU update kernels against the CPU kernels (which tests/cpp/kernels_adam_test.cc checks
// against torch's formulas): multi-chunk fused Adam/AdamW with 16-bit gradients and copies,
// gradient scaling, the overflow flag and the norm, and hybrid placement. Skipped without a GPU.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/grad_stats.h"
#include "runtime/gpu.h"
#include "tests/cpp/kernels_test_util.h"

namespace ps::kernels {
namespace {

using GpuTest = kernel_testing::GpuKernelTest;

struct HostChunk {
  std::vector<float> param, exp_avg, exp_avg_sq, grad32;
  std::vector<uint16_t> grad16, copy;
  DType grad_dtype;
  bool with_copy;
  DType copy_dtype;

  AdamChunk View() {
    return {param.data(),
            grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data())
                                          : static_cast<const void*>(grad16.data()),
            grad_dtype,
            exp_avg.data(),
            exp_avg_sq.data(),
            with_copy ? copy.data() : nullptr,
            copy_dtype,
            static_cast<int64_t>(param.size())};
  }
};

HostChunk MakeChunk(int64_t n, int variant, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostChunk c;
  c.grad_dtype =
      variant % 3 == 0 ? DType::kFloat32 : (variant % 3 == 1 ? DType::kFloat16 : DType::kBFloat16);
  c.with_copy = variant % 4 != 3;
  c.copy_dtype = variant % 2 == 0 ? DType::kBFloat16 : DType::kFloat16;
  for (int64_t i = 0; i < n; ++i) {
    c.param.push_back(normal(rng));
    c.exp_avg.push_back(0.01f * normal(rng));
    c.exp_avg_sq.push_back(1e-4f * std::fabs(normal(rng)));
    const float g = 100.0f * normal(rng);
    c.grad32.push_back(g);
    c.grad16.push_back(c.grad_dtype == DType::kFloat16 ? FloatToHalfBits(g)
                                                       : FloatToBFloat16Bits(g));
  }
  c.copy.assign(n, 0);
  return c;
}

TEST_F(GpuTest, FusedMultiChunkAdamEqualsTheCpuKernel) {
  std::mt19937 rng(1);
  std::vector<HostChunk> cpu;
  // 53 chunks: more than one launch table (48), sizes that leave tails, one large chunk.
  for (int i = 0; i < 53; ++i) {
    const int64_t n = i == 5 ? 1000003 : (i % 7 == 0 ? 1 : 17 * i + 15);
    cpu.push_back(MakeChunk(n, i, rng));
  }
  std::vector<HostChunk> gpu_side = cpu;  // host images of the device chunks
  std::vector<AdamChunk> device;
  for (HostChunk& c : gpu_side) {
    AdamChunk view = c.View();
    view.param = ToDevice(c.param);
    view.exp_avg = ToDevice(c.exp_avg);
    view.exp_avg_sq = ToDevice(c.exp_avg_sq);
    view.grad = c.grad_dtype == DType::kFloat32 ? static_cast<const void*>(ToDevice(c.grad32))
                                                : static_cast<const void*>(ToDevice(c.grad16));
    view.param_copy = c.with_copy ? ToDevice(c.copy) : nullptr;
    device.push_back(view);
  }
  for (bool adamw : {false, true}) {
    for (int64_t step = 1; step <= 3; ++step) {
      AdamHyperParams hp;
      hp.lr = 1e-2;
      hp.weight_decay = 0.01;
      hp.decoupled_weight_decay = adamw;
      hp.grad_scale = 128.0;
      hp.clip_coef = 0.5;
      hp.step = step;
      std::vector<AdamChunk> host_views;
      for (HostChunk& c : cpu) host_views.push_back(c.View());
      ASSERT_TRUE(AdamUpdate(host_views, hp).ok());
      ASSERT_TRUE(AdamUpdateOnDevice(device, hp, stream_).ok());
    }
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const size_t n = cpu[i].param.size();
    EXPECT_EQ(ToHost(device[i].param, n), cpu[i].param) << "chunk " << i;
    EXPECT_EQ(ToHost(device[i].exp_avg, n), cpu[i].exp_avg) << "chunk " << i;
    EXPECT_EQ(ToHost(device[i].exp_avg_sq, n), cpu[i].exp_avg_sq) << "chunk " << i;
    if (cpu[i].with_copy) {
      EXPECT_EQ(ToHost(static_cast<uint16_t*>(device[i].param_copy), n), cpu[i].copy)
          << "chunk " << i;
    }
  }
}

TEST_F(GpuTest, NormOverflowAndScaleMatchTheCpu) {
  std::mt19937 rng(2);
  HostChunk a = MakeChunk(100003, 1, rng), b = MakeChunk(33, 0, rng);
  const std::vector<GradChunk> host = {{a.grad16.data(), DType::kFloat16, 100003},
                                       {b.grad32.data(), DType::kFloat32, 33}};
  const double cpu_norm = *SquaredL2Norm(host);
  uint16_t* a_dev = ToDevice(a.grad16);
  float* b_dev = ToDevice(b.grad32);
  double* norm = ToDevice(std::vector<double>{0.0});
  int32_t* overflow = ToDevice(std::vector<int32_t>{0});
  const std::vector<GradChunk> dev = {{a_dev, DType::kFloat16, 100003},
                                      {b_dev, DType::kFloat32, 33}};
  ASSERT_TRUE(GradStatsOnDevice(dev, norm, overflow, stream_).ok());
  EXPECT_NEAR(ToHost(norm, 1)[0], cpu_norm, 1e-12 * cpu_norm);  // atomics: order differs
  EXPECT_EQ(ToHost(overflow, 1)[0], 0);

  ASSERT_TRUE(ScaleGradsOnDevice(dev, 0.25f, overflow, stream_).ok());
  const std::vector<uint16_t> a_scaled = ToHost(a_dev, 100003);
  const std::vector<float> b_scaled = ToHost(b_dev, 33);
  for (size_t i = 0; i < a.grad16.size(); ++i) {
    ASSERT_EQ(a_scaled[i], FloatToHalfBits(HalfBitsToFloat(a.grad16[i]) * 0.25f)) << i;
  }
  for (size_t i = 0; i < b.grad32.size(); ++i) ASSERT_EQ(b_scaled[i], b.grad32[i] * 0.25f);
  EXPECT_EQ(ToHost(overflow, 1)[0], 0);

  // 65504 * 2 overflows fp16: the scale flags it, and so does the stats kernel afterwards.
  std::vector<uint16_t> big(40, 0x7bff);
  uint16_t* big_dev = ToDevice(big);
  ASSERT_TRUE(ScaleGradsOnDevice({{big_dev, DType::kFloat16, 40}}, 2.0f, overflow, stream_).ok());
  EXPECT_EQ(ToHost(overflow, 1)[0], 1);
  int32_t* overflow2 = ToDevice(std::vector<int32_t>{0});
  ASSERT_TRUE(
      GradStatsOnDevice({{big_dev, DType::kFloat16, 40}}, nullptr, overflow2, stream_).ok());
  EXPECT_EQ(ToHost(overflow2, 1)[0], 1);
}

TEST_F(GpuTest, HybridStepUpdatesDeviceAndHostChunksLikeTheCpu) {
  std::mt19937 rng(3);
  std::vector<HostChunk> reference, mixed;
  for (int i = 0; i < 6; ++i) reference.push_back(MakeChunk(4099 + 1000 * i, i, rng));
  mixed = reference;
  std::vector<AdamChunkUpdate> updates;
  for (size_t i = 0; i < mixed.size(); ++i) {
    AdamChunk view = mixed[i].View();
    ChunkLocation where = ChunkLocation::kHost;
    if (i % 2 == 0) {  // state of even chunks on the device
      where = ChunkLocation::kDevice;
      view.param = ToDevice(mixed[i].param);
      view.exp_avg = ToDevice(mixed[i].exp_avg);
      view.exp_avg_sq = ToDevice(mixed[i].exp_avg_sq);
      view.grad = mixed[i].grad_dtype == DType::kFloat32
                      ? static_cast<const void*>(ToDevice(mixed[i].grad32))
                      : static_cast<const void*>(ToDevice(mixed[i].grad16));
      view.param_copy = mixed[i].with_copy ? ToDevice(mixed[i].copy) : nullptr;
    }
    updates.push_back({view, where});
  }
  ASSERT_TRUE(gpu::SynchronizeStream(stream_).ok());
  AdamHyperParams hp;
  hp.decoupled_weight_decay = true;
  hp.weight_decay = 0.1;
  HybridAdamOptions options;
  options.stream = stream_;
  absl::StatusOr<HybridAdamReport> report = HybridAdamStep(updates, hp, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->device_chunks, 3);
  EXPECT_EQ(report->host_chunks, 3);
  for (size_t i = 0; i < reference.size(); ++i) {
    ASSERT_TRUE(AdamUpdate(reference[i].View(), hp).ok());
    const size_t n = reference[i].param.size();
    const std::vector<float> param =
        i % 2 == 0 ? ToHost(updates[i].chunk.param, n) : mixed[i].param;
    EXPECT_EQ(param, reference[i].param) << "chunk " << i;
  }
}

}  // namespace
}  // namespace ps::kernels
