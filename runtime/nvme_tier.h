// NvmeTier: chunk slots in one file per process under a configured directory.
//
// Note [NVMe IO alignment]
// The file is opened with O_DIRECT so chunk traffic bypasses the page cache (which would
// otherwise double host memory use and defeat the host budget). O_DIRECT needs the buffer
// address, the file offset and the length aligned; every slot offset and capacity is a multiple
// of kBlockAlignment (4096) and every tier's slabs start aligned, so block-to-block copies always
// qualify. Direct callers with an unaligned buffer get InvalidArgument, not EINVAL from the
// kernel. Where O_DIRECT is refused (tmpfs) the file is opened buffered and a note is logged;
// where io_uring is refused (old kernels, seccomp) IO runs as pread/pwrite on worker threads.
//
// Note [NVMe write validity]
// A write pins the slot and marks it invalid before the first byte is submitted and marks it
// valid only after every piece completed in full. A failed or short write (ENOSPC, EIO, injected)
// leaves the slot invalid, so a later read of it fails with FailedPrecondition instead of
// returning torn data.
//
// Note [Swap file ownership]
// A swap file is `patrickstar-<pid>-<random token>.swap` and its owner holds an exclusive flock
// on it for as long as the tier lives. Liveness is the lock, not the pid: a restarted container
// reuses small pids, and processes in other pid namespaces sharing the directory have pids that
// mean nothing here (kill(pid, 0) would call a live file stale, or a stale one live). Start-up
// cleanup therefore removes exactly the files it can lock. A file never appears under its final
// name unlocked: it is created as `<name>.new`, locked, then renamed. A cleaner that locks a
// `.new` file first unlinks it, and the owner notices (its flock fails, or its rename finds no
// file) and retries with a fresh token. The destructor unlinks before it closes, so a cleaner
// never sees the file unlocked either. The token (getrandom) makes the name unique per process
// instance, so a stale file carrying this process's own pid is no obstacle. flock needs a local
// filesystem or an NFS/Lustre mount that forwards it; the NVMe tier is meant for local disks.
//
// Note [Swap files across fork]
// A child forked from the owner (os.fork, a multiprocessing worker) inherits the tier object,
// the file descriptor (one open file description, with its flock) and the io_uring ring, whose
// queues are memory shared with the parent. Destroying the tier there as its owner would unlink
// the parent's swap file, punch holes over the parent's chunks (zeroing its optimizer state)
// and post the reaper's stop NOP into the shared ring, where the parent's reaper thread takes
// it and stops, so the parent's next NVMe read never completes (found: a forked child ending
// normally ran the engine's exit hook, and the parent then hung in its next forward). In a
// process other than the creator the destructor therefore only closes its descriptor: the IO
// backend is left undestroyed (its ring and threads are the parent's; the child is a copy of
// memory whose threads do not run) and regions are forgotten without punching holes.
//
// Note [NVMe checksums]
// A week-long run reads its optimizer state back from the swap file thousands of times; a bit
// the disk, the filesystem or a bug of ours flipped there would come back as silently wrong
// weights. With verify_checksums (config memory.nvme.verify, on by default) every write piece
// (io_block_bytes of a request) is hashed (XXH3-64, ~20-30 GB/s per core, so small next to the
// disk's few GB/s) on the submitting thread before it is submitted, and the hash is recorded for
// its file range when the piece completes in full. A read piece whose range (offset and length)
// matches a recorded one is hashed on completion, and a different hash fails the read with
// DataLoss naming the file, offset and bytes, so the chunk's access fails instead of training
// on the bytes. A failed write records nothing, and a partly failed one leaves the block
// invalid (Note [NVMe write validity]), so stale hashes are never compared with data that a
// failed write left. Reads of another range (not the pieces of a whole-block write) are not
// checked. Released regions forget their hashes.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/btree_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runtime/tier.h"

namespace ps {

enum class IoOp { kRead, kWrite };

// What a fault injector may make of one IO piece: fail it with `error` (an errno), or pretend
// it transferred only `transferred` bytes (>= 0) and then made no progress.
struct IoFault {
  int error = 0;
  int64_t transferred = -1;
};
// Called once per piece where its IO would start: on an IO worker thread (pread/pwrite back end)
// or on the thread that submits to io_uring.
using IoFaultInjector = std::function<IoFault(IoOp op, int64_t file_offset, int64_t bytes)>;

struct NvmeTierOptions {
  Tier::Options tier;  // name defaults to "nvme"; budget 0 means the free space at creation
  std::string directory;
  int queue_depth = 32;
  int64_t io_block_bytes = 1 << 20;  // requests are split into pieces of this size
  bool use_io_uring = true;
  bool use_direct_io = true;
  bool verify_checksums = true;  // Note [NVMe checksums]
  IoFaultInjector fault_injector;  // tests only
};

// The hashes of the pieces written to one swap file, by file range (Note [NVMe checksums]).
class IoChecksums {
 public:
  static uint64_t Hash(const void* data, int64_t bytes);
  // A write of [offset, offset + bytes) completed with these bytes.
  void Record(int64_t offset, int64_t bytes, uint64_t hash);
  // A read of that range completed: DataLoss naming `path` if it was written with other bytes.
  absl::Status Verify(int64_t offset, int64_t bytes, uint64_t hash, absl::string_view path) const;
  // The ranges starting in [base, base + bytes) were released.
  void Forget(int64_t base, int64_t bytes);
  int64_t verified() const;  // reads checked so far

 private:
  struct Written {
    int64_t bytes;
    uint64_t hash;
  };
  mutable absl::Mutex mutex_;
  absl::btree_map<int64_t, Written> written_ ABSL_GUARDED_BY(mutex_);
  mutable int64_t verified_ ABSL_GUARDED_BY(mutex_) = 0;
};

class NvmeTier final : public Tier {
 public:
  using IoCallback = std::function<void(absl::Status)>;

  // Checks the directory, removes stale swap files, creates and locks this tier's file.
  static absl::StatusOr<std::unique_ptr<NvmeTier>> Create(NvmeTierOptions options);
  // Waits for IO in flight, closes and removes the file; in a forked child only closes its
  // descriptor (Note [Swap files across fork]).
  ~NvmeTier() override;

  const std::string& path() const { return path_; }
  bool direct_io() const { return direct_io_; }
  bool uses_io_uring() const;
  // Why a faster path (O_DIRECT, io_uring) is not in use; empty when both are.
  const std::string& fallback_note() const { return fallback_note_; }
  int64_t file_bytes() const;
  // Read pieces whose checksum was verified (Note [NVMe checksums]); 0 with verification off.
  int64_t verified_reads() const { return checksums_ == nullptr ? 0 : checksums_->verified(); }

  // Synchronous block IO that keeps pins and validity (Note [NVMe write validity]).
  absl::Status Write(const Block& block, const void* src, int64_t bytes);
  absl::Status Read(const Block& block, void* dst, int64_t bytes);

  // Raw asynchronous IO for the copy engine, which holds the pins and sets validity itself.
  // `done` runs on an IO thread. Errors name the file, offset and bytes.
  void SubmitWrite(const Block& block, const void* src, int64_t bytes, IoCallback done);
  void SubmitRead(const Block& block, void* dst, int64_t bytes, IoCallback done);
  // The same IO, waited for (the copy engine's staged routes run it on worker threads).
  absl::Status TransferAndWait(IoOp op, const Block& block, void* buffer, int64_t bytes);

  class IoBackend;

 protected:
  absl::StatusOr<uint64_t> ReserveRegion(int64_t bytes) override;
  void ReleaseRegion(uint64_t base, int64_t bytes) override;

 private:
  NvmeTier(NvmeTierOptions options, int fd, std::string path, bool direct_io);
  absl::Status CheckRange(const Block& block, const void* buffer, int64_t bytes,
                          absl::string_view op) const;
  void Submit(IoOp op, const Block& block, void* buffer, int64_t bytes, IoCallback done);

  // Whether this process created the tier (Note [Swap files across fork]).
  bool InCreatorProcess() const;

  NvmeTierOptions nvme_options_;
  const pid_t creator_pid_;
  int fd_ = -1;
  std::string path_;
  bool direct_io_ = false;
  std::string fallback_note_;
  std::unique_ptr<IoBackend> backend_;
  // Shared with requests in flight; null with verify_checksums off.
  std::shared_ptr<IoChecksums> checksums_;

  absl::Mutex region_mutex_;
  int64_t file_end_ ABSL_GUARDED_BY(region_mutex_) = 0;
  std::vector<std::pair<uint64_t, int64_t>> released_ranges_ ABSL_GUARDED_BY(region_mutex_);
};

// Removes `patrickstar-*.swap` (and `.swap.new`) files in `directory` that no live tier holds
// locked (Note [Swap file ownership]); returns the paths removed.
std::vector<std::string> RemoveStaleSwapFiles(const std::string& directory);

}  // namespace ps
