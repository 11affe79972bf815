// Fault injection (Note [Fault injection]): spec parsing, which operations fail, and that a
// failed copy or IO leaves pins, validity and statistics as a real failure would.
#include "runtime/fault_injection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>

#include "runtime/copy_engine.h"
#include "runtime/host_tier.h"
#include "runtime/nvme_tier.h"
#include "runtime/status.h"
#include "test_util.h"

namespace ps {
namespace {

using ::ps::testing::TempDir;
using ::testing::HasSubstr;

std::shared_ptr<FaultInjector> Parse(absl::string_view spec) {
  absl::StatusOr<std::shared_ptr<FaultInjector>> injector = FaultInjector::Parse(spec);
  EXPECT_TRUE(injector.ok()) << injector.status();
  return injector.ok() ? *injector : nullptr;
}

TEST(FaultInjectorTest, EmptySpecInjectsNothing) {
  EXPECT_EQ(Parse("  "), nullptr);
}

TEST(FaultInjectorTest, BadSpecsNameTheRule) {
  for (const char* spec : {"disk:after=1", "copy:after=x", "copy:p=2", "copy:when=3",
                           "nvme:errno=0"}) {
    absl::StatusOr<std::shared_ptr<FaultInjector>> injector = FaultInjector::Parse(spec);
    ASSERT_FALSE(injector.ok()) << spec;
    EXPECT_EQ(injector.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(injector.status().message(), HasSubstr(spec));
  }
}

TEST(FaultInjectorTest, AfterAndCountSelectTheFailingOperations) {
  std::shared_ptr<FaultInjector> faults = Parse("copy:after=2:count=2:errno=28; nvme_read");
  std::vector<int> copy_errors;
  for (int i = 0; i < 6; ++i) copy_errors.push_back(faults->Next(FaultSite::kCopy, 10).error);
  EXPECT_THAT(copy_errors, ::testing::ElementsAre(0, 0, 28, 28, 0, 0));
  EXPECT_EQ(faults->Next(FaultSite::kNvmeWrite, 10).error, 0);  // no rule for writes
  EXPECT_EQ(faults->Next(FaultSite::kNvmeRead, 10).error, EIO);
  EXPECT_EQ(faults->Next(FaultSite::kNvmeRead, 10).error, 0);
  EXPECT_EQ(faults->injected(), 3);
}

TEST(FaultInjectorTest, RandomFaultsRepeatWithTheSeed) {
  auto draw = [](absl::string_view spec) {
    std::shared_ptr<FaultInjector> faults = Parse(spec);
    std::vector<int> errors;
    for (int i = 0; i < 200; ++i) errors.push_back(faults->Next(FaultSite::kCopy, 1).error);
    return errors;
  };
  const std::vector<int> a = draw("any:p=0.1:seed=5");
  EXPECT_EQ(a, draw("any:p=0.1:seed=5"));
  EXPECT_NE(a, draw("any:p=0.1:seed=6"));
  const int64_t failed = std::count(a.begin(), a.end(), EIO);
  EXPECT_GT(failed, 0);
  EXPECT_LT(failed, 200);
}

TEST(FaultInjectorTest, FailedCopyReleasesPinsAndLeavesTheDestinationInvalid) {
  HostTier host(HostTierOptions{Tier::Options{"host", 8 << 20, 1 << 20}});
  CopyEngine engine(CopyEngine::Options{2, 0, Parse("copy:after=1")});
  PS_ASSERT_OK_AND_ASSIGN(Block a, host.Allocate(64 << 10));
  PS_ASSERT_OK_AND_ASSIGN(Block b, host.Allocate(64 << 10));
  PS_ASSERT_OK(engine.CopyAndWait(a, b));
  const absl::Status failed = engine.CopyAndWait(a, b);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(StatusErrno(failed), EIO);
  EXPECT_THAT(failed.message(), HasSubstr("injected copy fault"));
  EXPECT_THAT(failed.message(), HasSubstr("tier 'host'"));
  EXPECT_EQ(*host.PinCount(a), 0);
  EXPECT_EQ(*host.PinCount(b), 0);
  EXPECT_FALSE(*host.IsValid(b));  // never mistaken for a complete copy
  PS_ASSERT_OK(engine.CopyAndWait(a, b));  // count=1: the next copy runs again
  EXPECT_TRUE(*host.IsValid(b));
  PS_ASSERT_OK(host.Free(a));
  PS_ASSERT_OK(host.Free(b));
  EXPECT_EQ(host.stats().bytes.current, 0);
  EXPECT_EQ(engine.options().faults->injected(), 1);
}

TEST(FaultInjectorTest, NvmeHookFailsWritesWithTheChosenErrno) {
  TempDir dir;
  NvmeTierOptions options;
  options.tier = Tier::Options{"nvme", 16 << 20, 1 << 20};
  options.directory = dir.path();
  options.io_block_bytes = 64 << 10;
  options.fault_injector = NvmeFaultHook(Parse("nvme_write:after=1:errno=28"));
  PS_ASSERT_OK_AND_ASSIGN(std::unique_ptr<NvmeTier> nvme, NvmeTier::Create(options));
  HostTier host(HostTierOptions{Tier::Options{"host", 8 << 20, 1 << 20}});
  CopyEngine engine(CopyEngine::Options{2, 0});
  PS_ASSERT_OK_AND_ASSIGN(Block source, host.Allocate(256 << 10));  // 4 IO pieces
  PS_ASSERT_OK_AND_ASSIGN(Block slot, nvme->Allocate(256 << 10));
  const absl::Status failed = engine.CopyAndWait(source, slot);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(StatusErrno(failed), 28);
  EXPECT_THAT(failed.message(), HasSubstr(nvme->path()));
  EXPECT_FALSE(*nvme->IsValid(slot));
  EXPECT_EQ(*nvme->PinCount(slot), 0);
  PS_ASSERT_OK(nvme->Free(slot));
  PS_ASSERT_OK(host.Free(source));
  EXPECT_EQ(nvme->stats().bytes.current, 0);
}

}  // namespace
}  // namespace ps
