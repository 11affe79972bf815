// Tier slab pool, budgets and statistics, on the host and emulated device tiers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "runtime/gpu.h"
#include "runtime/host_memory.h"
#include "runtime/host_tier.h"
#include "test_util.h"

namespace ps {
namespace {

using ::testing::HasSubstr;

Tier::Options Options(const char* name, int64_t budget, int64_t slab = 64ll << 20) {
  return Tier::Options{name, budget, slab};
}

TEST(TierTest, EveryTierKindNameParsesBackToItsKind) {
  for (TierKind kind : kAllTierKinds) {
    EXPECT_EQ(TierKindFromName(TierKindName(kind)), kind) << TierKindName(kind);
  }
  EXPECT_EQ(TierKindFromName("host"), TierKind::kHost);
  EXPECT_EQ(TierKindFromName("Host"), std::nullopt);
  EXPECT_EQ(TierKindFromName("gpu"), std::nullopt);
  EXPECT_EQ(TierKindFromName(""), std::nullopt);
}

TEST(TierTest, AllocateRoundsUpToAlignmentAndCountsStats) {
  HostTier tier(HostTierOptions{Options("host", 0)});
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier.Allocate(5000));
  EXPECT_EQ(block.bytes, 8192);
  EXPECT_EQ(block.address % kBlockAlignment, 0u);
  EXPECT_EQ(block.tier, &tier);
  TierStats stats = tier.stats();
  EXPECT_EQ(stats.bytes.current, 8192);
  EXPECT_EQ(stats.blocks.current, 1);
  EXPECT_EQ(stats.blocks.allocated, 1);
  EXPECT_GE(stats.reserved_bytes, 8192);
  PS_ASSERT_OK(tier.Free(block));
  stats = tier.stats();
  EXPECT_EQ(stats.bytes.current, 0);
  EXPECT_EQ(stats.bytes.peak, 8192);
  EXPECT_EQ(stats.bytes.freed, 8192);
  EXPECT_EQ(stats.blocks.freed, 1);
}

TEST(TierTest, RejectsNonPositiveSizes) {
  HostTier tier(HostTierOptions{Options("host", 0)});
  EXPECT_EQ(tier.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.Allocate(-4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TierTest, FreedBlocksAreReusedFromThePool) {
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 0, 4 * 65536)});
  PS_ASSERT_OK_AND_ASSIGN(Block a, tier.Allocate(65536));
  PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
  const int64_t reserved = tier.stats().reserved_bytes;
  EXPECT_EQ(reserved, 2 * 65536);  // a slab of one block each (Note [Slabs grow with ...])
  PS_ASSERT_OK(tier.Free(a));
  PS_ASSERT_OK_AND_ASSIGN(Block c, tier.Allocate(65536));
  EXPECT_EQ(c.address, a.address);  // the freed block, not new memory
  EXPECT_NE(c.id, a.id);            // but a new handle
  EXPECT_EQ(tier.stats().reserved_bytes, reserved);
  PS_ASSERT_OK(tier.Free(b));
  PS_ASSERT_OK(tier.Free(c));
  EXPECT_EQ(tier.Trim(), reserved);
  EXPECT_EQ(tier.stats().reserved_bytes, 0);
  EXPECT_EQ(tier.stats().slabs, 0);
}

TEST(TierTest, BudgetExceededIsResourceExhaustedWithTheNumbers) {
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("tight", 3 * 65536)});
  PS_ASSERT_OK_AND_ASSIGN(Block a, tier.Allocate(65536));
  PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
  PS_ASSERT_OK_AND_ASSIGN(Block c, tier.Allocate(65536));
  absl::StatusOr<Block> d = tier.Allocate(65536);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(d.status().message(), HasSubstr("tier 'tight'"));
  EXPECT_THAT(d.status().message(), HasSubstr("block of 65536 bytes"));
  EXPECT_THAT(d.status().message(), HasSubstr("budget 196608 bytes"));
  EXPECT_THAT(d.status().message(), HasSubstr("in use 196608 bytes in 3 blocks"));
  EXPECT_LE(tier.stats().reserved_bytes, tier.stats().budget_bytes);
  for (const Block& block : {a, b, c}) PS_ASSERT_OK(tier.Free(block));
}

TEST(TierTest, NewSizeClassReclaimsFreeSlabsOfOtherSizes) {
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 4 * 65536, 65536)});
  std::vector<Block> small;
  for (int i = 0; i < 4; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
    small.push_back(b);
  }
  for (const Block& b : small) PS_ASSERT_OK(tier.Free(b));  // their slabs stay pooled
  EXPECT_EQ(tier.stats().reserved_bytes, 4 * 65536);
  PS_ASSERT_OK_AND_ASSIGN(Block big, tier.Allocate(3 * 65536));
  EXPECT_EQ(big.bytes, 3 * 65536);
  EXPECT_LE(tier.stats().reserved_bytes, 4 * 65536);
  PS_ASSERT_OK(tier.Free(big));
}

TEST(TierTest, SlabsGrowWithTheirSizesUseUpToTheTarget) {
  // Note [Slabs grow with their size's use]: slabs of 1, 1, 2, 4, 8 blocks, then of the
  // target's 8.
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 0, 8 * 65536)});
  std::vector<Block> blocks;
  const std::vector<std::pair<int64_t, int64_t>> reserved_and_slabs = {
      {1, 1}, {2, 2}, {4, 3}, {4, 3}, {8, 4}, {8, 4}, {8, 4}, {8, 4}, {16, 5}};
  for (const auto& [reserved_blocks, slabs] : reserved_and_slabs) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
    blocks.push_back(b);
    EXPECT_EQ(tier.stats().reserved_bytes, reserved_blocks * 65536) << blocks.size();
    EXPECT_EQ(tier.stats().slabs, slabs) << blocks.size();
  }
  for (int i = 0; i < 8; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
    blocks.push_back(b);
  }
  EXPECT_EQ(tier.stats().reserved_bytes, 24 * 65536);  // the sixth slab: the target, 8 blocks
  EXPECT_EQ(tier.stats().slabs, 6);
  for (const Block& b : blocks) PS_ASSERT_OK(tier.Free(b));
}

TEST(TierTest, SlabNeverTakesMoreThanAnEighthOfTheBudget) {
  // Budget 16 blocks, target 16: slabs of 1, 1, 2, then of 2 (an eighth), never 4.
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 16 * 65536, 16 * 65536)});
  std::vector<Block> blocks;
  for (int i = 0; i < 8; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(65536));
    blocks.push_back(b);
  }
  EXPECT_EQ(tier.stats().reserved_bytes, 8 * 65536);
  EXPECT_EQ(tier.stats().slabs, 5);
  for (const Block& b : blocks) PS_ASSERT_OK(tier.Free(b));
}

TEST(TierTest, TenBlockSizesFitABudgetTheirBlocksFit) {
  // One block each of 4, 8, ..., 40 KiB (220 KiB) under a 256 KiB budget. When every size's
  // first slab took an eighth of the budget, eight sizes reserved 224 KiB of mostly free
  // slabs and the ninth was refused.
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 256 << 10)});
  std::vector<Block> blocks;
  for (int64_t kib = 4; kib <= 40; kib += 4) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(kib << 10));
    blocks.push_back(b);
  }
  EXPECT_EQ(tier.stats().reserved_bytes, 220 << 10);
  for (const Block& b : blocks) PS_ASSERT_OK(tier.Free(b));
}

TEST(TierTest, FullBudgetFallsBackToALargerFreeBlock) {
  // Budget 8 blocks of 8 KiB, slabs of one block: fill it, free one, then ask for 4 KiB.
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 8 * 8192, 8192)});
  std::vector<Block> blocks;
  for (int i = 0; i < 8; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(8192));
    blocks.push_back(b);
  }
  PS_ASSERT_OK(tier.Free(blocks.back()));
  blocks.pop_back();
  // Trim would release the free slab, but it is the only room: the free 8 KiB block is reused.
  PS_ASSERT_OK_AND_ASSIGN(Block small, tier.Allocate(4096));
  EXPECT_LE(tier.stats().reserved_bytes, 8 * 8192);
  EXPECT_GE(small.bytes, 4096);
  PS_ASSERT_OK(tier.Free(small));
  for (const Block& b : blocks) PS_ASSERT_OK(tier.Free(b));
}

TEST(TierTest, LargerFreeBlockIsUsedWhenNothingElseFits) {
  // Slabs of 8 KiB blocks (1, 1, then two each) fill the budget; a 4 KiB request, with a free
  // 8 KiB block whose slab-mate is still live (so no slab can be returned), gets that block.
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 16 * 8192, 2 * 8192)});
  std::vector<Block> blocks;
  for (int i = 0; i < 16; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block b, tier.Allocate(8192));
    blocks.push_back(b);
  }
  EXPECT_EQ(tier.stats().slabs, 9);
  PS_ASSERT_OK(tier.Free(blocks[2]));  // the third slab holds blocks 2 and 3
  PS_ASSERT_OK_AND_ASSIGN(Block small, tier.Allocate(4096));
  EXPECT_EQ(small.bytes, 8192);
  EXPECT_EQ(small.address, blocks[2].address);
  EXPECT_EQ(tier.stats().bytes.current, 16 * 8192);
  EXPECT_EQ(tier.Allocate(4096).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(TierTest, DoubleFreeAndForeignBlocksAreRefused) {
  HostTier one(HostTierOptions{Options("one", 0)});
  HostTier two(HostTierOptions{Options("two", 0)});
  PS_ASSERT_OK_AND_ASSIGN(Block block, one.Allocate(4096));
  EXPECT_EQ(two.Free(block).code(), absl::StatusCode::kInvalidArgument);
  PS_ASSERT_OK(one.Free(block));
  absl::Status again = one.Free(block);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(again.message(), HasSubstr("not allocated"));
}

TEST(TierTest, PinnedBlockCannotBeFreed) {
  HostTier tier(HostTierOptions{Options("host", 0)});
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier.Allocate(4096));
  PS_ASSERT_OK(tier.Pin(block));
  absl::Status status = tier.Free(block);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("1 pin(s)"));
  tier.Unpin(block);
  PS_EXPECT_OK(tier.Free(block));
}

TEST(TierTest, ValidityFollowsWrites) {
  HostTier tier(HostTierOptions{Options("host", 0)});
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier.Allocate(4096));
  EXPECT_TRUE(*tier.IsValid(block));  // memory tiers hand out writable, valid blocks
  PS_ASSERT_OK(tier.BeginWrite(block));
  EXPECT_FALSE(*tier.IsValid(block));
  EXPECT_EQ(*tier.PinCount(block), 1);
  tier.EndWrite(block, /*succeeded=*/false);
  EXPECT_FALSE(*tier.IsValid(block));
  EXPECT_EQ(*tier.PinCount(block), 0);
  PS_ASSERT_OK(tier.BeginWrite(block));
  tier.EndWrite(block, /*succeeded=*/true);
  EXPECT_TRUE(*tier.IsValid(block));
  PS_ASSERT_OK(tier.Free(block));
}

TEST(TierTest, SetBudgetValidatesAndApplies) {
  EmulatedDeviceTier tier(EmulatedDeviceTierOptions{Options("dev", 0, 65536)});
  EXPECT_EQ(tier.SetBudget(-1).code(), absl::StatusCode::kInvalidArgument);
  PS_ASSERT_OK(tier.SetBudget(65536));
  PS_ASSERT_OK_AND_ASSIGN(Block a, tier.Allocate(65536));
  EXPECT_EQ(tier.Allocate(4096).status().code(), absl::StatusCode::kResourceExhausted);
  PS_ASSERT_OK(tier.Free(a));
}

TEST(TierTest, ConcurrentAllocateAndFreeKeepStatsConsistent) {
  HostTier tier(HostTierOptions{Options("host", 0, 1 << 20)});
  constexpr int kThreads = 4;
  constexpr int kRounds = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&tier, t] {
      for (int i = 0; i < kRounds; ++i) {
        absl::StatusOr<Block> block = tier.Allocate(4096 * (1 + (i + t) % 3));
        ASSERT_TRUE(block.ok()) << block.status();
        static_cast<unsigned char*>(block->data())[0] = static_cast<unsigned char>(i);
        ASSERT_TRUE(tier.Free(*block).ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const TierStats stats = tier.stats();
  EXPECT_EQ(stats.bytes.current, 0);
  EXPECT_EQ(stats.blocks.allocated, kThreads * kRounds);
  EXPECT_EQ(stats.blocks.freed, kThreads * kRounds);
  EXPECT_EQ(stats.bytes.allocated, stats.bytes.freed);
}

TEST(TierTest, PinnedHostTierFallsBackWithoutGpu) {
  HostTierOptions options{Options("pinned", 0)};
  options.pinned = true;
  HostTier tier(options);
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier.Allocate(4096));
  std::memset(block.data(), 7, 4096);
  PS_ASSERT_OK(tier.Free(block));
  if (gpu::DeviceCount() == 0) EXPECT_FALSE(tier.pinned());
}

TEST(HostMemoryTest, AlignedAllocationsComeFromMimalloc) {
#ifdef PS_SANITIZE_BUILD
  EXPECT_THAT(HostAllocatorName(), HasSubstr("sanitizer build"));
#else
  EXPECT_THAT(HostAllocatorName(), HasSubstr("mimalloc"));
#endif
  void* pointer = AlignedHostAlloc(12345, 4096);
  ASSERT_NE(pointer, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pointer) % 4096, 0u);
  AlignedHostFree(pointer);
}

}  // namespace
}  // namespace ps
