// The direct NCCL back end on one GPU (a world of one rank: the collectives still run through
// NCCL, with the group batching of Note [NCCL group calls]). Skips without NCCL or a GPU.
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/communicator.h"
#include "runtime/gpu.h"

namespace ps {
namespace {

using ::testing::HasSubstr;

TEST(NcclCommunicatorTest, WithoutNcclOrAGpuCreationIsAClearError) {
  if (NcclAvailable() && gpu::DeviceCount() > 0 && !gpu::StrictDevice()) {
    GTEST_SKIP() << "NCCL and a GPU are present";
  }
  auto communicator = CreateNcclCommunicator(0, 1, 0, std::string(128, '\0'));
  ASSERT_FALSE(communicator.ok());
  EXPECT_EQ(communicator.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(NcclCommunicatorTest, OneRankCollectivesOnTheDevice) {
  if (!NcclAvailable()) GTEST_SKIP() << "built without NCCL";
  if (gpu::DeviceCount() == 0 || gpu::StrictDevice()) {
    GTEST_SKIP() << "no GPU (the strict device has no NCCL): " << gpu::UnavailableReason();
  }
  auto id = NcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto created = CreateNcclCommunicator(0, 1, 0, *id);
  ASSERT_TRUE(created.ok()) << created.status();
  Communicator& comm = **created;
  EXPECT_EQ(comm.address_space(), AddressSpace::kDeviceMemory);
  constexpr int64_t kCount = 1 << 16;
  std::vector<float> host(kCount);
  for (int64_t i = 0; i < kCount; ++i) host[i] = static_cast<float>(i % 1000);
  auto device = gpu::DeviceMalloc(0, kCount * sizeof(float));
  ASSERT_TRUE(device.ok()) << device.status();
  auto stream = gpu::CreateStream(0);
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(gpu::CopyAsync(*device, host.data(), kCount * sizeof(float), *stream).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(*stream).ok());
  std::vector<void*> group{*device};
  ASSERT_TRUE(comm.AllGather(group, kCount, DType::kFloat32, "test").Wait(absl::Seconds(60)).ok());
  ASSERT_TRUE(comm.ReduceScatter(group, kCount, DType::kFloat32, ReduceOp::kAvg, "test")
                  .Wait(absl::Seconds(60))
                  .ok());
  ASSERT_TRUE(comm.AllReduce(*device, kCount, DType::kFloat32, ReduceOp::kSum, "test")
                  .Wait(absl::Seconds(60))
                  .ok());
  ASSERT_TRUE(
      comm.Broadcast(*device, kCount, DType::kFloat32, 0, "test").Wait(absl::Seconds(60)).ok());
  std::vector<float> back(kCount);
  ASSERT_TRUE(gpu::CopyAsync(back.data(), *device, kCount * sizeof(float), *stream).ok());
  ASSERT_TRUE(gpu::SynchronizeStream(*stream).ok());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), kCount * sizeof(float)), 0);
  // A null buffer (padding) is gathered into scratch.
  std::vector<void*> padded{nullptr};
  EXPECT_TRUE(comm.AllGather(padded, kCount, DType::kFloat32, "pad").Wait(absl::Seconds(60)).ok());
  auto bad = comm.AllGather({}, kCount, DType::kFloat32, "bad").Wait(absl::Seconds(1));
  EXPECT_THAT(bad.message(), HasSubstr("allgather takes 1 buffers"));
  gpu::DestroyStream(*stream);
  gpu::DeviceFree(0, *device);
}

}  // namespace
}  // namespace ps
