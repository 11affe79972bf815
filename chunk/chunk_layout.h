// Packing tensors into chunk lists: first-fit in registration order, oversized tensors in chunks
// of their own, and the chunk-size search that minimizes wasted bytes.
//
// Note [Oversize groups]
// A tensor larger than the chunk size gets a chunk of exactly its size. With data parallelism a
// group's chunks must have equal sizes (one allgather / reduce-scatter of world_size equal
// buffers), so the tensor's chunk starts a group of its own: the list is first padded to a
// multiple of world_size (those padding chunks take later tensors by first-fit like any chunk),
// then world_size chunks of the tensor's size follow, one holding the tensor and the others
// empty padding that never gets a payload (a null buffer in the collective: zeros sent, nothing
// kept). The holder is member k % world_size of the list's k-th oversize group, so several
// large tensors spread over the ranks; every list (compute, gradient, optimizer state) sees the
// same sequence of sizes and so gives each parameter the same owner in all of them. The price
// is collective bandwidth (a gather moves world_size buffers of the tensor's size) and balance
// (one rank owns the whole tensor and its optimizer state), not memory. Sharding one tensor over
// several chunks would balance it but breaks the one-tensor-one-view rule the engine relies on.
//
// Note [Deterministic layout]
// Every rank must arrive at the same chunks with the same tensors at the same offsets, because a
// collective moves a whole chunk and the receiver reads tensors at the offsets it computed
// itself. The layout is a pure function of (tensor specs in registration order, chunk size,
// world size): no hash-map iteration order, no addresses, no timing. LayoutHash() digests exactly
// that function's output so ranks can compare one number before training starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "chunk/chunk_kind.h"
#include "runtime/dtype.h"

namespace ps {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // empty for a scalar
  ChunkKind kind = ChunkKind::kComputeParam;
  DType dtype = DType::kFloat32;
};

// The product of `shape`; InvalidArgument for a negative dimension or an overflow.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape);

// One chunk of a planned list.
struct PlannedChunk {
  int64_t capacity_elements = 0;
  int64_t used_elements = 0;
  std::vector<int64_t> tensors;  // indices into the specs, in packing order
  std::vector<int64_t> offsets;  // element offset of each tensor in the chunk
  bool oversize = false;         // sized for one tensor larger than the chunk size
  bool padding = false;          // empty, added so groups are whole (Note [Oversize groups])
};

// The chunks of one kind.
struct PlannedList {
  ChunkKind kind = ChunkKind::kComputeParam;
  DType dtype = DType::kFloat32;
  std::vector<PlannedChunk> chunks;
};

struct LayoutPlan {
  int64_t chunk_elements = 0;
  int world_size = 1;
  std::vector<PlannedList> lists;         // in ChunkKind order, only kinds that have tensors
  // Unused capacity of the chunks that hold tensors: padding chunks never get a payload (a
  // null buffer in the collectives), so under data parallelism a small chunk size that makes
  // large tensors oversize costs no memory (Note [One holder, one broadcast] in
  // group_collectives.h moves only their bytes).
  int64_t wasted_bytes = 0;
  std::vector<int64_t> oversize_tensors;  // spec indices that got a chunk of their own
  // The chunk bytes of the rank that owns the most (chunks holding tensors, all lists): with
  // world_size 1 every chunk's.
  int64_t largest_rank_bytes = 0;
  // The bytes of the largest group of any list (its chunks holding tensors): what a gather or
  // a full-size gradient group adds to a rank.
  int64_t largest_group_bytes = 0;
};

// The search's estimate of a rank's peak chunk bytes (Note [Chunk-size search]).
int64_t EstimatedRankPeak(const LayoutPlan& plan);

// First-fit packing of `specs` into chunks of `chunk_elements`, one list per kind, each list
// padded with empty chunks to a multiple of `world_size` (and oversize tensors in padded groups
// of their own when world_size > 1: Note [Oversize groups]). InvalidArgument when a kind mixes
// dtypes, a tensor has no elements, or the sizes are not positive.
absl::StatusOr<LayoutPlan> PlanLayout(absl::Span<const TensorSpec> specs, int64_t chunk_elements,
                                      int world_size);

struct ChunkSizeSearch {
  int64_t min_elements = 0;
  int64_t max_elements = 0;
  int64_t step_elements = 0;  // candidates are min, min + step, ... <= max
  // When positive, floor, 2 floor, 4 floor, ... below min_elements are candidates too (Note
  // [Chunk-size search]: small chunks spread small tensors over the ranks).
  int64_t floor_elements = 0;
};

struct ChunkSizeSearchResult {
  LayoutPlan plan;         // the winner's plan
  int64_t candidates = 0;  // how many sizes were evaluated
};

// Note [Chunk-size search]
// Plans every candidate size and keeps the one with the smallest estimated peak of a rank
// (EstimatedRankPeak), then the fewest wasted bytes, then the smallest size (moves stay small).
// The linear range suits one process, where a chunk smaller than a quarter of the largest tensor
// only adds chunks. Under data parallelism the search also tries powers of two times
// floor_elements below the range: there every tensor larger than the chunk is an oversize group
// of its own anyway, and what the chunk size still decides is how the small tensors (biases,
// norms) spread. With chunks of a quarter of the largest tensor (262,144 elements for the
// 50M-parameter block stack of docs/benchmarks.md) every LayerNorm and bias of the model sat in
// one chunk, a third full, on one rank in every kind: 4 MiB more on that rank than on the others
// in fp32. Chunks of 4,096 elements put them in the padding chunks before each oversize group,
// which belong to every rank in turn. Powers of two keep it to a few candidates (a linear step
// that fine would plan thousands of layouts).
// With one rank the estimate is the total of the chunks, so this is the least waste. With
// several it is the busiest rank's own chunk bytes plus two of the largest group: waste alone
// preferred one chunk holding the whole model next to padding (no waste, one rank owning
// everything), and owned bytes alone chunks so large that a gathered group was half the model.
// InvalidArgument for an empty or malformed range.
absl::StatusOr<ChunkSizeSearchResult> SearchChunkSize(absl::Span<const TensorSpec> specs,
                                                      const ChunkSizeSearch& search,
                                                      int world_size);

// FNV-1a digest of the plan and the specs it places (Note [Deterministic layout]).
uint64_t LayoutHash(const LayoutPlan& plan, absl::Span<const TensorSpec> specs);

}  // namespace ps
