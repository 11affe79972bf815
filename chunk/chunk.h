// A chunk: a fixed-capacity payload of one dtype and kind, with the tensors packed in it.
//
// Note [Chunk payload residency]
// A chunk's payload lives in exactly one tier (a Block of that tier) or nowhere ("released":
// nothing of it is materialized on this rank). While a prefetch copy is in flight the payload is
// still the source block and the destination block is only *pending*; the chunk switches tiers
// when the copy is found complete, so no reader ever sees half-copied bytes. A chunk with any
// tensor in COMPUTE, or with a copy in flight, is pinned: it is never chosen as an eviction victim
// and MoveChunk refuses it.
//
// Note [Block sizes]
// A payload block is at least bytes() but may be larger: a tier's pool can hand out a larger free
// block when it has no room to grow (Note [Tier slab pool]). So every byte count the manager
// keeps (chunk bytes per tier, bytes moved) uses the blocks' real sizes, and a move asks for a
// destination as large as the source block, because the copy engine copies whole blocks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "chunk/chunk_kind.h"
#include "chunk/tensor_state.h"
#include "runtime/copy_engine.h"
#include "runtime/dtype.h"
#include "runtime/tier.h"

namespace ps {

using TensorId = int64_t;
using ChunkId = int64_t;

// A registered tensor and where it was packed.
struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  ChunkKind kind = ChunkKind::kComputeParam;
  DType dtype = DType::kFloat32;
  ChunkId chunk = -1;  // -1 until the chunk lists are built
  int64_t offset = 0;  // in elements, within the chunk
  TensorState state = TensorState::kFree;
};

class Chunk {
 public:
  ChunkId id() const { return id_; }
  ChunkKind kind() const { return kind_; }
  DType dtype() const { return dtype_; }
  int64_t capacity_elements() const { return capacity_elements_; }
  // Bytes of its payload block (capacity rounded up to kBlockAlignment).
  int64_t bytes() const { return RoundUpToAlignment(capacity_elements_ * ElementSize(dtype_)); }
  int64_t index_in_list() const { return index_in_list_; }
  int64_t group() const { return group_; }
  int owner_rank() const { return owner_rank_; }
  bool oversize() const { return oversize_; }
  bool padding() const { return padding_; }
  const std::vector<TensorId>& tensors() const { return tensors_; }

  bool has_payload() const { return !payload_.is_null(); }
  const Block& payload() const { return payload_; }
  int tier_index() const { return tier_index_; }  // -1 when released
  int compute_tensors() const { return compute_tensors_; }
  bool prefetch_in_flight() const { return pending_.has_value(); }
  // The tier a copy in flight is bringing the payload to (where the next Access settles it);
  // -1 when none is.
  int pending_tier_index() const { return pending_.has_value() ? pending_->tier_index : -1; }
  bool pinned() const { return compute_tensors_ > 0 || pending_.has_value(); }

 private:
  friend class ChunkManager;

  struct PendingCopy {
    Block destination;
    int tier_index = -1;
    CopyHandle handle;
  };

  ChunkId id_ = -1;
  ChunkKind kind_ = ChunkKind::kComputeParam;
  DType dtype_ = DType::kFloat32;
  int64_t capacity_elements_ = 0;
  int64_t index_in_list_ = 0;
  int64_t group_ = 0;
  int owner_rank_ = 0;
  bool oversize_ = false;
  bool padding_ = false;
  std::vector<TensorId> tensors_;

  Block payload_;
  int tier_index_ = -1;
  int compute_tensors_ = 0;
  int64_t last_use_ = 0;      // LRU clock of the latest access
  int prefetched_tier_ = -1;  // the tier a completed prefetch brought it to, until used or moved
  std::optional<PendingCopy> pending_;
};

}  // namespace ps
