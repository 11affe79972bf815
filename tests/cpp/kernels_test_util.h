// Shared pieces of the kernel tests: a scope that forces a SIMD path, and a fixture that owns a
// stream and device allocations for the GPU kernel tests (skipped without a GPU; under the
// strict emulated device the allocations are its device memory).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/simd.h"
#include "runtime/gpu.h"

namespace ps::kernels::kernel_testing {

// Forces a SIMD level for the duration of a scope.
class ScopedSimd {
 public:
  explicit ScopedSimd(SimdLevel level) { EXPECT_TRUE(ForceSimdLevel(level).ok()); }
  ~ScopedSimd() { ClearForcedSimdLevel(); }
};

class GpuKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu::DeviceCount() == 0) GTEST_SKIP() << "no GPU: " << gpu::UnavailableReason();
    absl::StatusOr<gpu::Stream> stream = gpu::CreateStream(0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *stream;
  }
  void TearDown() override {
    for (void* p : allocations_) gpu::DeviceFree(0, p);
    if (stream_.handle != nullptr) gpu::DestroyStream(stream_);
  }
  // A device copy of `host` (any trivially copyable element type).
  template <typename T>
  T* ToDevice(const std::vector<T>& host) {
    const int64_t bytes = std::max<int64_t>(1, host.size() * sizeof(T));
    absl::StatusOr<void*> p = gpu::DeviceMalloc(0, bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    allocations_.push_back(*p);
    if (!host.empty()) {
      EXPECT_TRUE(gpu::CopyAsync(*p, host.data(), bytes, stream_).ok());
    }
    return static_cast<T*>(*p);
  }
  // `n` elements of device memory, copied back after the stream's work.
  template <typename T>
  std::vector<T> ToHost(const void* device, size_t n) {
    std::vector<T> host(n);
    if (n > 0) {
      EXPECT_TRUE(gpu::CopyAsync(host.data(), device, n * sizeof(T), stream_).ok());
    }
    EXPECT_TRUE(gpu::SynchronizeStream(stream_).ok());
    return host;
  }
  template <typename T>
  std::vector<T> ToHost(const T* device, size_t n) {
    return ToHost<T>(static_cast<const void*>(device), n);
  }

  gpu::Stream stream_;
  std::vector<void*> allocations_;
};

}  // namespace ps::kernels::kernel_testing
