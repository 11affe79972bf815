#include "runtime/tier.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/logging.h"
#include "runtime/status.h"

namespace ps {

absl::string_view TierKindName(TierKind kind) {
  switch (kind) {
    case TierKind::kDevice:
      return "device";
    case TierKind::kHost:
      return "host";
    case TierKind::kNvme:
      return "nvme";
  }
  return "unknown";
}

std::optional<TierKind> TierKindFromName(absl::string_view name) {
  for (TierKind kind : kAllTierKinds) {
    if (TierKindName(kind) == name) return kind;
  }
  return std::nullopt;
}

std::string FormatBytes(int64_t bytes) {
  const double value = static_cast<double>(bytes);
  if (bytes >= (1ll << 30))
    return absl::StrFormat("%d bytes (%.2f GiB)", bytes, value / (1ll << 30));
  if (bytes >= (1ll << 20))
    return absl::StrFormat("%d bytes (%.2f MiB)", bytes, value / (1ll << 20));
  return absl::StrFormat("%d bytes", bytes);
}

Tier::Tier(TierKind kind, AddressSpace address_space, Options options, bool blocks_start_valid)
    : kind_(kind),
      address_space_(address_space),
      options_(std::move(options)),
      blocks_start_valid_(blocks_start_valid) {
  PS_CHECK(options_.budget_bytes >= 0, "negative budget for tier ", options_.name);
  PS_CHECK(options_.slab_target_bytes > 0, "slab_target_bytes must be positive");
  stats_.budget_bytes = options_.budget_bytes;
}

Tier::~Tier() {
  // A derived class that reserved regions must have called ReleaseAllRegions().
  PS_CHECK(slabs_.empty(), "tier ", options_.name, " destroyed with slabs still reserved");
}

void Tier::ReleaseAllRegions() {
  absl::MutexLock lock(&mutex_);
  if (!blocks_.empty()) {
    PS_LOG(kWarning, "tier %s: destroyed with %d blocks still allocated (%s)", options_.name,
           blocks_.size(), FormatBytes(stats_.bytes.current));
  }
  for (const auto& [base, slab] : slabs_) ReleaseRegion(base, slab.bytes);
  slabs_.clear();
  free_lists_.clear();
  blocks_.clear();
  stats_.reserved_bytes = 0;
  stats_.slabs = 0;
}

// Note [Tier teardown in a forked child]
// fork() copies every lock in the state some thread of the parent left it in, and only the
// forking thread runs in the child. A parent IO thread that was inside a mutex's unlock (absl
// takes a spin bit in the mutex word to wake a waiter), or the logger's sink lock, at the moment
// of the fork leaves that lock held forever in the child, so a child that locks it hangs, and
// the parent's waitpid with it (seen once in NvmeTierTest's fork test under a loaded machine).
// The child's copy of a tier owns nothing to give back (Note [Swap files across fork]), so its
// destructor clears the bookkeeping without locking: the child is single-threaded here, as no
// thread of the parent exists in it.
void Tier::ForgetAllRegionsInForkedChild() {
  slabs_.clear();
  free_lists_.clear();
  blocks_.clear();
}

int64_t Tier::budget_bytes() const {
  absl::MutexLock lock(&mutex_);
  return options_.budget_bytes;
}

absl::Status Tier::SetBudget(int64_t budget_bytes) {
  if (budget_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", options_.name, ": budget must be >= 0, got ", budget_bytes));
  }
  absl::MutexLock lock(&mutex_);
  options_.budget_bytes = budget_bytes;
  stats_.budget_bytes = budget_bytes;
  return absl::OkStatus();
}

absl::StatusOr<Block> Tier::Allocate(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", options_.name, ": block size must be positive, got ", bytes));
  }
  const int64_t block_bytes = RoundUpToAlignment(bytes);
  absl::MutexLock lock(&mutex_);
  std::vector<uint64_t>& free_list = free_lists_[block_bytes];
  uint64_t address = 0;
  if (!free_list.empty()) {
    address = free_list.back();
    free_list.pop_back();
  } else {
    PS_ASSIGN_OR_RETURN(address, GrowLocked(block_bytes));
  }
  Slab& slab = SlabOf(address)->second;
  slab.free_blocks -= 1;
  const int64_t granted_bytes = slab.block_bytes;  // larger than asked after a fallback
  const uint64_t id = next_id_++;
  blocks_[id] = BlockRecord{address, granted_bytes, 0, blocks_start_valid_};
  stats_.bytes.Increase(granted_bytes);
  stats_.blocks.Increase(1);
  return Block{this, id, granted_bytes, address};
}

// Note [Slabs grow with their size's use]
// A size's next slab holds as many blocks as its slabs already hold (one block for its first),
// doubling up to a slab of min(slab_target_bytes, budget / 8). Every first slab used to take the
// full eighth of the budget: a tier holding blocks of more than eight sizes (fp32 params and
// grads, uint8 moments, the small float scale chunks of int8 state, bf16 compensation, each in
// a few sizes) reserved its whole budget in mostly free slabs, so a host holding 12.5 MiB of
// chunks and activations evicted at a budget of 607 MiB. Doubling keeps a size's free blocks
// below its blocks in use (plus one), and the slab count per size logarithmic.
int64_t Tier::PooledBlocksLocked(int64_t block_bytes) const {
  int64_t blocks = 0;
  for (const auto& [base, slab] : slabs_) {
    if (slab.block_bytes == block_bytes) blocks += slab.total_blocks;
  }
  return blocks;
}

absl::StatusOr<uint64_t> Tier::GrowLocked(int64_t block_bytes) {
  const int64_t budget = options_.budget_bytes;
  auto blocks_that_fit = [&]() -> int64_t {
    int64_t slab_bytes = options_.slab_target_bytes;
    // One slab never takes more than an eighth of a budget, so one block size cannot starve the
    // others while its slab is only partly used.
    if (budget > 0) slab_bytes = std::min(slab_bytes, budget / 8);
    const int64_t wanted =
        std::min(std::max<int64_t>(1, slab_bytes / block_bytes),
                 std::max<int64_t>(1, PooledBlocksLocked(block_bytes)));
    if (budget == 0) return wanted;
    return std::min(wanted, std::max<int64_t>(0, budget - stats_.reserved_bytes) / block_bytes);
  };
  int64_t count = blocks_that_fit();
  if (count == 0) {
    TrimLocked(/*keep_block_bytes=*/0);
    count = blocks_that_fit();
  }
  if (count == 0) {
    // Last resort before refusing: a free pooled block of a larger size (at most twice the
    // request, so the waste stays bounded).
    std::optional<int64_t> best_size;
    for (const auto& [size, list] : free_lists_) {
      if (size > block_bytes && size <= 2 * block_bytes && !list.empty() &&
          (!best_size || size < *best_size)) {
        best_size = size;
      }
    }
    if (best_size) {
      const uint64_t address = free_lists_[*best_size].back();
      free_lists_[*best_size].pop_back();
      return address;
    }
    int64_t pooled_free = 0;
    for (const auto& [size, list] : free_lists_)
      pooled_free += size * static_cast<int64_t>(list.size());
    return absl::ResourceExhaustedError(absl::StrCat(
        "tier '", options_.name, "' (", TierKindName(kind_), "): cannot allocate a block of ",
        FormatBytes(block_bytes), ": budget ", FormatBytes(budget), ", in use ",
        FormatBytes(stats_.bytes.current), " in ", stats_.blocks.current, " blocks, reserved ",
        FormatBytes(stats_.reserved_bytes), " (", FormatBytes(pooled_free),
        " free in pooled blocks of other sizes)"));
  }
  const int64_t slab_bytes = count * block_bytes;
  absl::StatusOr<uint64_t> base = ReserveRegion(slab_bytes);
  if (!base.ok() && count > 1) {
    // The backing store may still hold one block even if not a whole slab.
    count = 1;
    base = ReserveRegion(block_bytes);
  }
  if (!base.ok()) {
    return Annotate(base.status(), absl::StrCat("tier '", options_.name, "': reserving ",
                                                FormatBytes(count * block_bytes)));
  }
  slabs_[*base] = Slab{count * block_bytes, block_bytes, count, count};
  stats_.reserved_bytes += count * block_bytes;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  stats_.slabs += 1;
  std::vector<uint64_t>& free_list = free_lists_[block_bytes];
  // Pushed in reverse so blocks are handed out in address order.
  for (int64_t i = count - 1; i >= 1; --i) free_list.push_back(*base + i * block_bytes);
  return *base;
}

std::map<uint64_t, Tier::Slab>::iterator Tier::SlabOf(uint64_t address) {
  auto it = slabs_.upper_bound(address);
  PS_CHECK(it != slabs_.begin(), "address outside every slab of tier ", options_.name);
  --it;
  PS_CHECK(address < it->first + it->second.bytes, "address outside every slab of tier ",
           options_.name);
  return it;
}

int64_t Tier::TrimLocked(int64_t keep_block_bytes) {
  int64_t released = 0;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    const Slab& slab = it->second;
    if (slab.free_blocks != slab.total_blocks || slab.block_bytes == keep_block_bytes) {
      ++it;
      continue;
    }
    const uint64_t base = it->first;
    const uint64_t end = base + slab.bytes;
    std::vector<uint64_t>& list = free_lists_[slab.block_bytes];
    list.erase(
        std::remove_if(list.begin(), list.end(), [&](uint64_t a) { return a >= base && a < end; }),
        list.end());
    ReleaseRegion(base, slab.bytes);
    released += slab.bytes;
    stats_.reserved_bytes -= slab.bytes;
    stats_.slabs -= 1;
    it = slabs_.erase(it);
  }
  return released;
}

int64_t Tier::Trim() {
  absl::MutexLock lock(&mutex_);
  return TrimLocked(/*keep_block_bytes=*/0);
}

std::string Tier::DescribeBlockLocked(const Block& block) const {
  return absl::StrCat("tier '", options_.name, "': block ", block.id, " (", block.bytes,
                      " bytes at 0x", absl::Hex(block.address), ")");
}

absl::StatusOr<Tier::BlockRecord*> Tier::FindLocked(const Block& block) {
  if (block.tier != this) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBlockLocked(block), " belongs to another tier"));
  }
  auto it = blocks_.find(block.id);
  if (it == blocks_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBlockLocked(block), " is not allocated (freed twice?)"));
  }
  return &it->second;
}

const Tier::BlockRecord* Tier::FindLocked(const Block& block) const {
  if (block.tier != this) return nullptr;
  auto it = blocks_.find(block.id);
  return it == blocks_.end() ? nullptr : &it->second;
}

absl::Status Tier::Free(const Block& block) {
  absl::MutexLock lock(&mutex_);
  PS_ASSIGN_OR_RETURN(BlockRecord * record, FindLocked(block));
  if (record->pins > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(DescribeBlockLocked(block), " cannot be freed: ", record->pins,
                     " pin(s) held by copies in flight or tensor views still alive"));
  }
  const uint64_t address = record->address;
  const int64_t bytes = record->bytes;
  if (absl::Status idle = CheckBlockIdle(address, bytes); !idle.ok()) {
    return Annotate(idle, absl::StrCat(DescribeBlockLocked(block), " cannot be freed"));
  }
  blocks_.erase(block.id);
  free_lists_[bytes].push_back(address);
  SlabOf(address)->second.free_blocks += 1;
  stats_.bytes.Decrease(bytes);
  stats_.blocks.Decrease(1);
  return absl::OkStatus();
}

TierStats Tier::stats() const {
  absl::MutexLock lock(&mutex_);
  return stats_;
}

void Tier::ResetPeakStats() {
  absl::MutexLock lock(&mutex_);
  stats_.bytes.ResetPeak();
  stats_.blocks.ResetPeak();
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

absl::Status Tier::Pin(const Block& block) {
  absl::MutexLock lock(&mutex_);
  PS_ASSIGN_OR_RETURN(BlockRecord * record, FindLocked(block));
  record->pins += 1;
  return absl::OkStatus();
}

void Tier::Unpin(const Block& block) {
  absl::MutexLock lock(&mutex_);
  auto it = blocks_.find(block.id);
  PS_CHECK(it != blocks_.end() && it->second.pins > 0, "unbalanced Unpin of ",
           DescribeBlockLocked(block));
  it->second.pins -= 1;
}

absl::StatusOr<int> Tier::PinCount(const Block& block) const {
  absl::MutexLock lock(&mutex_);
  const BlockRecord* record = FindLocked(block);
  if (record == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBlockLocked(block), " is not allocated"));
  }
  return record->pins;
}

absl::StatusOr<bool> Tier::IsValid(const Block& block) const {
  absl::MutexLock lock(&mutex_);
  const BlockRecord* record = FindLocked(block);
  if (record == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(DescribeBlockLocked(block), " is not allocated"));
  }
  return record->valid;
}

absl::Status Tier::SetValid(const Block& block, bool valid) {
  absl::MutexLock lock(&mutex_);
  PS_ASSIGN_OR_RETURN(BlockRecord * record, FindLocked(block));
  record->valid = valid;
  return absl::OkStatus();
}

absl::Status Tier::BeginWrite(const Block& block) {
  absl::MutexLock lock(&mutex_);
  PS_ASSIGN_OR_RETURN(BlockRecord * record, FindLocked(block));
  record->pins += 1;
  record->valid = false;
  return absl::OkStatus();
}

void Tier::EndWrite(const Block& block, bool succeeded) {
  absl::MutexLock lock(&mutex_);
  auto it = blocks_.find(block.id);
  PS_CHECK(it != blocks_.end() && it->second.pins > 0, "unbalanced EndWrite of ",
           DescribeBlockLocked(block));
  it->second.pins -= 1;
  it->second.valid = succeeded;
}

std::string Tier::DebugString() const {
  const TierStats s = stats();
  return absl::StrCat(
      "Tier(", options_.name, ", ", TierKindName(kind_), ", in use ", FormatBytes(s.bytes.current),
      " in ", s.blocks.current, " blocks, reserved ", FormatBytes(s.reserved_bytes), ", budget ",
      s.budget_bytes == 0 ? std::string("unlimited") : FormatBytes(s.budget_bytes), ")");
}

}  // namespace ps
