// NvmeTier: files, slots, io_uring and pread/pwrite back ends, and every fault path.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "runtime/host_memory.h"
#include "runtime/nvme_tier.h"
#include "runtime/status.h"
#include "test_util.h"

namespace ps {
namespace {

using ::ps::testing::TempDir;
using ::testing::HasSubstr;

struct AlignedBuffer {
  explicit AlignedBuffer(int64_t n) : bytes(n), data(AlignedHostAlloc(n, kBlockAlignment)) {}
  ~AlignedBuffer() { AlignedHostFree(data); }
  int64_t bytes;
  void* data;
};

NvmeTierOptions Options(const std::string& dir, bool io_uring, int64_t budget = 64 << 20) {
  NvmeTierOptions options;
  options.tier = Tier::Options{"nvme", budget, 1 << 20};
  options.directory = dir;
  options.use_io_uring = io_uring;
  options.io_block_bytes = 64 << 10;  // several pieces per block
  return options;
}

class NvmeTierTest : public ::testing::TestWithParam<bool> {
 protected:
  bool io_uring() const { return GetParam(); }
  TempDir dir_;
};

TEST_P(NvmeTierTest, WriteThenReadRoundTripsRandomBytes) {
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir_.path(), io_uring())));
  EXPECT_EQ(tier->uses_io_uring(), io_uring());
  EXPECT_TRUE(tier->direct_io());  // /tmp is ext4
  EXPECT_TRUE(std::filesystem::exists(tier->path()));
  constexpr int64_t kBytes = 300 << 10;
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(kBytes));
  EXPECT_FALSE(*tier->IsValid(block));  // a new slot holds nothing yet
  AlignedBuffer out(block.bytes), in(block.bytes);
  testing::FillRandom(out.data, block.bytes, 42);
  PS_ASSERT_OK(tier->Write(block, out.data, block.bytes));
  EXPECT_TRUE(*tier->IsValid(block));
  PS_ASSERT_OK(tier->Read(block, in.data, block.bytes));
  EXPECT_TRUE(testing::SameBytes(out.data, in.data, block.bytes));
  PS_ASSERT_OK(tier->Free(block));
}

TEST_P(NvmeTierTest, ManyConcurrentRequestsAllComplete) {
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir_.path(), io_uring())));
  constexpr int kBlocks = 24;
  std::vector<Block> blocks;
  std::vector<std::unique_ptr<AlignedBuffer>> buffers;
  std::atomic<int> finished{0};
  std::atomic<int> failures{0};
  for (int i = 0; i < kBlocks; ++i) {
    PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(128 << 10));
    blocks.push_back(block);
    buffers.push_back(std::make_unique<AlignedBuffer>(block.bytes));
    testing::FillRandom(buffers.back()->data, block.bytes, i);
    PS_ASSERT_OK(tier->BeginWrite(block));
    tier->SubmitWrite(block, buffers.back()->data, block.bytes, [&, block](absl::Status s) {
      if (!s.ok()) failures++;
      tier->EndWrite(block, s.ok());
      finished++;
    });
  }
  while (finished.load() < kBlocks) std::this_thread::yield();
  EXPECT_EQ(failures.load(), 0);
  for (int i = 0; i < kBlocks; ++i) {
    AlignedBuffer in(blocks[i].bytes);
    PS_ASSERT_OK(tier->Read(blocks[i], in.data, in.bytes));
    EXPECT_TRUE(testing::SameBytes(in.data, buffers[i]->data, in.bytes)) << "block " << i;
  }
}

TEST_P(NvmeTierTest, FileIsRemovedOnCleanShutdown) {
  std::string path;
  {
    PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir_.path(), io_uring())));
    path = tier->path();
    PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(4096));
    EXPECT_GE(tier->file_bytes(), 4096);  // slots are preallocated
    (void)block;
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

// Note [Swap files across fork]: a child that destroys its copy of the tier (an engine's exit
// hook in a forked process) leaves the parent's file, contents and IO as they were. Before, the
// child unlinked the file, punched a hole over the block and stopped the parent's io_uring
// reaper through the shared ring.
TEST_P(NvmeTierTest, AForkedChildDestroyingItsCopyLeavesTheParentsFileAndIo) {
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir_.path(), io_uring())));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(256 << 10));
  AlignedBuffer out(block.bytes), in(block.bytes);
  testing::FillRandom(out.data, block.bytes, 7);
  PS_ASSERT_OK(tier->Write(block, out.data, block.bytes));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    tier.reset();
    _exit(0);
  }
  // A child stuck on a lock copied in its held state fails here, not at ctest's timeout.
  int status = 0;
  pid_t reaped = 0;
  for (int i = 0; i < 30000 && reaped == 0; ++i) {
    reaped = waitpid(child, &status, WNOHANG);
    if (reaped == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (reaped == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the forked child did not exit within 30 s of destroying its tier";
  }
  ASSERT_EQ(reaped, child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_TRUE(std::filesystem::exists(tier->path()));
  PS_ASSERT_OK(tier->Read(block, in.data, block.bytes));
  EXPECT_TRUE(testing::SameBytes(out.data, in.data, block.bytes));
  // Asynchronous IO still completes: the parent's reaper (io_uring) was not stopped.
  std::atomic<bool> done{false};
  PS_ASSERT_OK(tier->BeginWrite(block));
  tier->SubmitWrite(block, out.data, block.bytes, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    tier->EndWrite(block, s.ok());
    done = true;
  });
  for (int i = 0; i < 10000 && !done.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(done.load()) << "the write did not complete within 10 s";
  PS_ASSERT_OK(tier->Free(block));
}

TEST_P(NvmeTierTest, InjectedEnospcFailsTheWriteNamingFileOffsetAndBytes) {
  NvmeTierOptions options = Options(dir_.path(), io_uring());
  options.fault_injector = [](IoOp op, int64_t offset, int64_t bytes) {
    return op == IoOp::kWrite && offset > 0 ? IoFault{ENOSPC, -1} : IoFault{};
  };
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(256 << 10));
  AlignedBuffer out(block.bytes);
  testing::FillRandom(out.data, block.bytes, 1);
  absl::Status status = tier->Write(block, out.data, block.bytes);
  ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr(tier->path()));
  EXPECT_THAT(status.message(), HasSubstr("write of 65536 bytes at offset"));
  EXPECT_THAT(status.message(), HasSubstr("No space left on device"));
  EXPECT_EQ(StatusErrno(status), ENOSPC);
  // The torn slot is not valid, so nobody reads it as data.
  EXPECT_FALSE(*tier->IsValid(block));
  AlignedBuffer in(block.bytes);
  absl::Status read = tier->Read(block, in.data, in.bytes);
  EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(read.message(), HasSubstr("holds no complete data"));
}

TEST_P(NvmeTierTest, InjectedShortWriteIsDataLossAndLeavesSlotInvalid) {
  NvmeTierOptions options = Options(dir_.path(), io_uring());
  options.fault_injector = [](IoOp op, int64_t, int64_t) {
    return op == IoOp::kWrite ? IoFault{0, 2048} : IoFault{};
  };
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(4096));
  AlignedBuffer out(block.bytes);
  absl::Status status = tier->Write(block, out.data, block.bytes);
  ASSERT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("short write: 2048 of 4096 bytes"));
  EXPECT_THAT(status.message(), HasSubstr(tier->path()));
  EXPECT_FALSE(*tier->IsValid(block));
}

TEST_P(NvmeTierTest, InjectedEioOnReadIsReported) {
  NvmeTierOptions options = Options(dir_.path(), io_uring());
  options.fault_injector = [](IoOp op, int64_t, int64_t) {
    return op == IoOp::kRead ? IoFault{EIO, -1} : IoFault{};
  };
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(4096));
  AlignedBuffer buffer(block.bytes);
  PS_ASSERT_OK(tier->Write(block, buffer.data, block.bytes));
  absl::Status status = tier->Read(block, buffer.data, block.bytes);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr("Input/output error"));
  EXPECT_EQ(*tier->PinCount(block), 0);  // pins are released on failure too
}

// Note [NVMe checksums]: a byte changed in the file behind the tier's back fails the read of its
// piece, naming the file and the piece's offset; with verification off the changed byte comes
// back silently.
TEST_P(NvmeTierTest, BytesChangedInTheFileFailTheReadNamingFileAndOffset) {
  for (bool verify : {true, false}) {
    NvmeTierOptions options = Options(dir_.path(), io_uring());
    options.verify_checksums = verify;
    PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
    PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(300 << 10));
    AlignedBuffer out(block.bytes), in(block.bytes);
    testing::FillRandom(out.data, block.bytes, 7);
    PS_ASSERT_OK(tier->Write(block, out.data, block.bytes));
    PS_ASSERT_OK(tier->Read(block, in.data, block.bytes));  // unchanged: reads fine
    EXPECT_EQ(tier->verified_reads(), verify ? 5 : 0);       // 300 KiB in 64 KiB pieces
    // A buffered write by another descriptor; the tier's direct read sees it (the kernel
    // writes dirty pages back before direct IO of their range).
    const int64_t changed_at = static_cast<int64_t>(block.address) + 70000;
    const char flipped = static_cast<char>(static_cast<const char*>(out.data)[70000] ^ 0x10);
    const int fd = open(tier->path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pwrite(fd, &flipped, 1, changed_at), 1);
    close(fd);
    absl::Status read = tier->Read(block, in.data, block.bytes);
    if (verify) {
      ASSERT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
      EXPECT_THAT(read.message(), HasSubstr("checksum mismatch: the 65536 bytes read at offset " +
                                            std::to_string(block.address + 65536)));
      EXPECT_THAT(read.message(), HasSubstr(tier->path()));
      EXPECT_EQ(*tier->PinCount(block), 0);
    } else {
      PS_ASSERT_OK(read);
      EXPECT_EQ(static_cast<const char*>(in.data)[70000], flipped);
    }
    // A new write of the block makes it readable again.
    PS_ASSERT_OK(tier->Write(block, out.data, block.bytes));
    PS_ASSERT_OK(tier->Read(block, in.data, block.bytes));
    EXPECT_TRUE(testing::SameBytes(out.data, in.data, block.bytes));
    PS_ASSERT_OK(tier->Free(block));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, NvmeTierTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "IoUring" : "Posix"; });

TEST(NvmeTierCreateTest, MissingDirectoryIsNotFound) {
  absl::StatusOr<std::unique_ptr<NvmeTier>> tier =
      NvmeTier::Create(Options("/nonexistent/patrickstar", true));
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tier.status().message(), HasSubstr("/nonexistent/patrickstar"));
}

TEST(NvmeTierCreateTest, PathThatIsAFileIsRefused) {
  TempDir dir;
  const std::string file = dir.path() + "/plain-file";
  std::ofstream(file) << "x";
  absl::StatusOr<std::unique_ptr<NvmeTier>> tier = NvmeTier::Create(Options(file, true));
  EXPECT_FALSE(tier.ok());
  EXPECT_THAT(tier.status().message(), HasSubstr("plain-file"));
  EXPECT_THAT(tier.status().message(), HasSubstr("Not a directory"));
}

TEST(NvmeTierCreateTest, UnwritableDirectoryIsPermissionDenied) {
  if (geteuid() == 0) {
    // root ignores directory permissions; a read-only filesystem refuses root as well.
    absl::StatusOr<std::unique_ptr<NvmeTier>> tier = NvmeTier::Create(Options("/proc", true));
    ASSERT_FALSE(tier.ok());
    EXPECT_THAT(tier.status().message(), HasSubstr("/proc/patrickstar-"));
    return;
  }
  TempDir dir;
  ASSERT_EQ(chmod(dir.path().c_str(), 0500), 0);
  absl::StatusOr<std::unique_ptr<NvmeTier>> tier = NvmeTier::Create(Options(dir.path(), true));
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kPermissionDenied);
  chmod(dir.path().c_str(), 0700);
}

TEST(NvmeTierCreateTest, BadOptionsAreInvalidArgument) {
  TempDir dir;
  NvmeTierOptions options = Options(dir.path(), true);
  options.queue_depth = 0;
  EXPECT_THAT(NvmeTier::Create(options).status().message(), HasSubstr("queue_depth"));
  options = Options(dir.path(), true);
  options.io_block_bytes = 1000;
  EXPECT_THAT(NvmeTier::Create(options).status().message(), HasSubstr("block_size"));
  options = Options("", true);
  EXPECT_EQ(NvmeTier::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NvmeTierCreateTest, DiskFullDuringPreallocationIsResourceExhausted) {
  // A budget far beyond the disk makes fallocate fail for real (ENOSPC/EFBIG).
  TempDir dir;
  NvmeTierOptions options = Options(dir.path(), true, /*budget=*/int64_t{1} << 60);
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  absl::StatusOr<Block> block = tier->Allocate(int64_t{1} << 55);
  ASSERT_FALSE(block.ok());
  EXPECT_EQ(block.status().code(), absl::StatusCode::kResourceExhausted) << block.status();
  EXPECT_THAT(block.status().message(), HasSubstr(tier->path()));
  EXPECT_EQ(tier->stats().reserved_bytes, 0);
  // The tier still works after the failure.
  PS_ASSERT_OK_AND_ASSIGN(Block small, tier->Allocate(4096));
  PS_ASSERT_OK(tier->Free(small));
}

TEST(NvmeTierCreateTest, BudgetDefaultsToFreeSpaceAndIsEnforced) {
  TempDir dir;
  PS_ASSERT_OK_AND_ASSIGN(auto unlimited, NvmeTier::Create(Options(dir.path(), true, 0)));
  EXPECT_GT(unlimited->budget_bytes(), 0);
  PS_ASSERT_OK_AND_ASSIGN(auto tight, NvmeTier::Create(Options(dir.path(), true, 8192)));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tight->Allocate(8192));
  EXPECT_EQ(tight->Allocate(4096).status().code(), absl::StatusCode::kResourceExhausted);
  PS_ASSERT_OK(tight->Free(block));
}

TEST(NvmeTierCreateTest, BufferedFallbackWhenDirectIoIsOff) {
  TempDir dir;
  NvmeTierOptions options = Options(dir.path(), false);
  options.use_direct_io = false;
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  EXPECT_FALSE(tier->direct_io());
  EXPECT_THAT(tier->fallback_note(), HasSubstr("io_uring disabled"));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(4096));
  std::vector<char> unaligned(4096 + 1, 'z');  // fine without O_DIRECT
  PS_ASSERT_OK(tier->Write(block, unaligned.data() + 1, 4096));
}

TEST(NvmeTierCreateTest, UnalignedBufferWithDirectIoIsInvalidArgument) {
  TempDir dir;
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir.path(), true)));
  PS_ASSERT_OK_AND_ASSIGN(Block block, tier->Allocate(8192));
  AlignedBuffer buffer(8192 + 4096);
  absl::Status status = tier->Write(block, static_cast<char*>(buffer.data) + 8, 4096);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("aligned to 4096"));
  status = tier->Write(block, buffer.data, 3000);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  status = tier->Write(block, buffer.data, 3 * 8192);
  EXPECT_THAT(status.message(), HasSubstr("does not fit block"));
}

TEST(NvmeTierCreateTest, UnlockedSwapFilesAreStaleWhateverTheirPid) {
  // Note [Swap file ownership]: a file nobody holds locked is stale, even one that carries this
  // process's own pid (a restarted container reuses small pids).
  TempDir dir;
  const std::string dead = dir.path() + "/patrickstar-4194305-0.swap";
  const std::string own_pid = dir.path() + "/patrickstar-" + std::to_string(getpid()) + "-0.swap";
  const std::string half_made = dir.path() + "/patrickstar-4194305-1.swap.new";
  const std::string unrelated = dir.path() + "/notes.txt";
  for (const std::string& path : {dead, own_pid, half_made, unrelated}) {
    std::ofstream(path) << "x";
  }
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir.path(), true)));
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_FALSE(std::filesystem::exists(own_pid));
  EXPECT_FALSE(std::filesystem::exists(half_made));
  EXPECT_TRUE(std::filesystem::exists(unrelated));
  EXPECT_TRUE(std::filesystem::exists(tier->path()));
}

TEST(NvmeTierCreateTest, ALockedFileIsLiveEvenWhenItsPidIsNotRunningHere) {
  // A process of another pid namespace: its pid means nothing here, its lock does.
  TempDir dir;
  const std::string other = dir.path() + "/patrickstar-4194305-feed.swap";
  std::ofstream(other) << "x";
  const int held = open(other.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(held, 0);
  ASSERT_EQ(flock(held, LOCK_EX | LOCK_NB), 0);
  {
    PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(dir.path(), true)));
    EXPECT_TRUE(std::filesystem::exists(other));
    // Each tier's own file is locked too: a second tier's cleanup leaves the first one alone.
    PS_ASSERT_OK_AND_ASSIGN(auto second, NvmeTier::Create(Options(dir.path(), true)));
    EXPECT_NE(second->path(), tier->path());
    EXPECT_TRUE(std::filesystem::exists(tier->path()));
    EXPECT_TRUE(RemoveStaleSwapFiles(dir.path()).empty());
  }
  close(held);  // the owner is gone: now the file is stale
  EXPECT_EQ(RemoveStaleSwapFiles(dir.path()), std::vector<std::string>{other});
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(NvmeTierCreateTest, FreedSlotsAreReusedAndFileRangesRecycled) {
  TempDir dir;
  NvmeTierOptions options = Options(dir.path(), true);
  options.tier.slab_target_bytes = 4096;  // one block per slab, so Trim returns ranges
  PS_ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(options));
  PS_ASSERT_OK_AND_ASSIGN(Block a, tier->Allocate(8192));
  PS_ASSERT_OK(tier->Free(a));
  EXPECT_EQ(tier->Trim(), 8192);
  PS_ASSERT_OK_AND_ASSIGN(Block b, tier->Allocate(8192));
  EXPECT_EQ(b.address, a.address);  // the released file range is reused
  EXPECT_EQ(tier->file_bytes(), 8192);
}

}  // namespace
}  // namespace ps
