// A memory tier: a byte budget and a slab pool of chunk-sized blocks.
//
// Note [Tier slab pool]
// Chunks have a fixed size (plus the rare chunk made for one oversized tensor), so each tier
// keeps a free list per block size and carves blocks out of slabs it reserves from its backing
// store (mimalloc, cudaHostAlloc, cudaMalloc, or a range of a file), each size's slabs growing
// with its use (Note [Slabs grow with their size's use] in tier.cc). A freed block goes back to
// its free list, never to the backing store, so steady-state training allocates nothing. The
// budget bounds the *reserved* bytes, which is what the process really holds: when a new block
// size does not fit, fully free slabs of other sizes are returned first, and only then is the
// request refused with ResourceExhausted carrying the numbers.
//
// Note [Block pins and validity]
// A block can be pinned: by the copy engine while a copy reads or writes it, and by a tensor view
// handed to Python. Free() refuses a pinned block (FailedPrecondition), so memory is never
// recycled under an in-flight DMA or a live view. A block is *valid* when its bytes are a complete
// copy of something: memory tiers hand out valid blocks (they are directly writable), a new NVMe
// slot is invalid until a write completes, and a copy marks its destination invalid until it
// succeeds, so a failed or torn copy is never mistaken for data.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "runtime/memory_stats.h"

namespace ps {

// Every block's capacity and start are multiples of this, which O_DIRECT requires.
inline constexpr int64_t kBlockAlignment = 4096;

constexpr int64_t RoundUpToAlignment(int64_t bytes) {
  return (bytes + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;
}

// What the placement logic sees.
enum class TierKind { kDevice, kHost, kNvme };
// How bytes are reached, which decides how the copy engine moves them.
enum class AddressSpace { kHostMemory, kDeviceMemory, kFile };

// The one spelling of each tier kind ("device", "host", "nvme"): what the bindings take and
// report, and (upper-cased) the names of the bound `_C.TierKind` values.
absl::string_view TierKindName(TierKind kind);
// The kind spelled `name`, nullopt for any other name.
std::optional<TierKind> TierKindFromName(absl::string_view name);
inline constexpr TierKind kAllTierKinds[] = {TierKind::kDevice, TierKind::kHost, TierKind::kNvme};

class Tier;

// A handle to a block; plain value, owned by the tier until Free().
struct Block {
  Tier* tier = nullptr;
  uint64_t id = 0;       // unique within its tier; 0 means "no block"
  int64_t bytes = 0;     // capacity, a multiple of kBlockAlignment
  uint64_t address = 0;  // a pointer (host or device memory) or a file offset

  bool is_null() const { return id == 0; }
  void* data() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }
};

class Tier {
 public:
  struct Options {
    std::string name;
    int64_t budget_bytes = 0;                // 0 means no limit beyond the backing store
    int64_t slab_target_bytes = 64ll << 20;  // a slab holds max(1, this / block size) blocks
  };

  virtual ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  const std::string& name() const { return options_.name; }
  TierKind kind() const { return kind_; }
  AddressSpace address_space() const { return address_space_; }
  int64_t budget_bytes() const;
  // Changing the budget never frees in-use blocks; a budget below the reserved bytes makes the
  // next growth fail until blocks are freed and Trim() returns slabs.
  absl::Status SetBudget(int64_t budget_bytes);

  // A block of at least `bytes` (rounded up to kBlockAlignment), from the pool when one is free.
  absl::StatusOr<Block> Allocate(int64_t bytes);
  // Returns the block to the pool. Fails on an unknown block or a pinned one.
  absl::Status Free(const Block& block);
  // Returns fully free slabs to the backing store; returns the bytes released.
  int64_t Trim();

  TierStats stats() const;
  void ResetPeakStats();

  // Pins (see Note [Block pins and validity]).
  absl::Status Pin(const Block& block);
  void Unpin(const Block& block);
  absl::StatusOr<int> PinCount(const Block& block) const;
  absl::StatusOr<bool> IsValid(const Block& block) const;
  absl::Status SetValid(const Block& block, bool valid);
  // Pins `block` and marks it invalid, for the destination of a copy about to start.
  absl::Status BeginWrite(const Block& block);
  // Unpins and sets validity from the copy's outcome.
  void EndWrite(const Block& block, bool succeeded);

  std::string DebugString() const;

 protected:
  Tier(TierKind kind, AddressSpace address_space, Options options, bool blocks_start_valid);

  // Reserves `bytes` from the backing store; returns the base address (pointer or offset).
  virtual absl::StatusOr<uint64_t> ReserveRegion(int64_t bytes) = 0;
  virtual void ReleaseRegion(uint64_t base, int64_t bytes) = 0;
  // Free() refuses a block that queued device work still uses (the device tier asks the GPU
  // runtime, which only the strict device can answer: Note [Strict device]).
  virtual absl::Status CheckBlockIdle(uint64_t, int64_t) const { return absl::OkStatus(); }

  // Derived destructors call this: the base destructor can no longer reach ReleaseRegion.
  void ReleaseAllRegions();
  // Instead of ReleaseAllRegions in a process forked from the creator: forgets the regions
  // without releasing them, taking no lock and logging nothing (Note [Tier teardown in a forked
  // child]).
  void ForgetAllRegionsInForkedChild() ABSL_NO_THREAD_SAFETY_ANALYSIS;

 private:
  struct Slab {
    int64_t bytes = 0;
    int64_t block_bytes = 0;
    int64_t free_blocks = 0;
    int64_t total_blocks = 0;
  };
  struct BlockRecord {
    uint64_t address = 0;
    int64_t bytes = 0;
    int pins = 0;
    bool valid = false;
  };

  absl::StatusOr<uint64_t> GrowLocked(int64_t block_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Blocks of `block_bytes` in all slabs of that size (Note [Slabs grow with their size's use]).
  int64_t PooledBlocksLocked(int64_t block_bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  int64_t TrimLocked(int64_t keep_block_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::StatusOr<BlockRecord*> FindLocked(const Block& block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  const BlockRecord* FindLocked(const Block& block) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::map<uint64_t, Slab>::iterator SlabOf(uint64_t address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::string DescribeBlockLocked(const Block& block) const;

  const TierKind kind_;
  const AddressSpace address_space_;
  Options options_;
  const bool blocks_start_valid_;

  mutable absl::Mutex mutex_;
  uint64_t next_id_ ABSL_GUARDED_BY(mutex_) = 1;
  std::map<uint64_t, Slab> slabs_ ABSL_GUARDED_BY(mutex_);  // by base address
  absl::flat_hash_map<int64_t, std::vector<uint64_t>> free_lists_ ABSL_GUARDED_BY(mutex_);
  absl::flat_hash_map<uint64_t, BlockRecord> blocks_ ABSL_GUARDED_BY(mutex_);
  TierStats stats_ ABSL_GUARDED_BY(mutex_);
};

std::string FormatBytes(int64_t bytes);

}  // namespace ps
