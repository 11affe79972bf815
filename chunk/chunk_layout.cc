#include "chunk/chunk_layout.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/status.h"

namespace ps {
namespace {

constexpr int kNumChunkKinds = 8;

// FNV-1a over the bytes of integers and strings, fed in a fixed order.
class Fnv1a {
 public:
  void AddInt(int64_t value) {
    for (int i = 0; i < 8; ++i)
      AddByte(static_cast<uint8_t>(static_cast<uint64_t>(value) >> (8 * i)));
  }
  void AddString(absl::string_view text) {
    AddInt(static_cast<int64_t>(text.size()));
    for (char c : text) AddByte(static_cast<uint8_t>(c));
  }
  uint64_t digest() const { return hash_; }

 private:
  void AddByte(uint8_t byte) {
    hash_ ^= byte;
    hash_ *= 1099511628211ull;
  }
  uint64_t hash_ = 14695981039346656037ull;
};

// Note [Scale lists mirror their moments]
// The blockwise scales of 8-bit optimizer state (kMomentumScale, kVarianceScale) must sit on the
// rank that owns the moments they scale, and a rank owns chunk c of every list when c is its
// member of the group (Note [Oversize groups]). First-fit packing of the much smaller scale
// tensors would put them in other chunks, so a scale list is not packed: its chunk c holds the
// scales of the tensors of its moment list's chunk c, in the same order. The k-th scale tensor
// registered scales the k-th moment tensor (the engine registers them in one loop), so the
// mapping needs no ids. Every chunk of the list gets the capacity of the fullest one, keeping a
// group's chunks equal as every list's are.
std::optional<ChunkKind> MirroredKind(ChunkKind kind) {
  if (kind == ChunkKind::kMomentumScale) return ChunkKind::kMomentum;
  if (kind == ChunkKind::kVarianceScale) return ChunkKind::kVariance;
  return std::nullopt;
}

absl::Status PlanMirroredList(absl::Span<const TensorSpec> specs, const PlannedList& moments,
                              PlannedList& list) {
  std::vector<int64_t> scales;  // spec indices of this kind, in registration order
  std::vector<int64_t> moment_ordinal(specs.size(), -1);
  int64_t moment_count = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(specs.size()); ++i) {
    if (specs[i].kind == list.kind) scales.push_back(i);
    if (specs[i].kind == moments.kind) moment_ordinal[i] = moment_count++;
  }
  if (static_cast<int64_t>(scales.size()) != moment_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        ChunkKindName(list.kind), " has ", scales.size(), " tensors but ",
        ChunkKindName(moments.kind), " has ", moment_count,
        ": a scale list holds one tensor per moment tensor, registered in the same order"));
  }
  int64_t capacity = 1;
  for (const PlannedChunk& moment_chunk : moments.chunks) {
    PlannedChunk chunk;
    chunk.padding = moment_chunk.tensors.empty();
    for (int64_t moment : moment_chunk.tensors) {
      const int64_t scale = scales[static_cast<size_t>(moment_ordinal[moment])];
      PS_ASSIGN_OR_RETURN(const int64_t numel, NumElements(specs[scale].shape));
      chunk.tensors.push_back(scale);
      chunk.offsets.push_back(chunk.used_elements);
      chunk.used_elements += numel;
    }
    capacity = std::max(capacity, chunk.used_elements);
    list.chunks.push_back(std::move(chunk));
  }
  for (PlannedChunk& chunk : list.chunks) chunk.capacity_elements = capacity;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] has a negative dimension"));
    }
    if (dim != 0 && numel > std::numeric_limits<int64_t>::max() / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] overflows int64 elements"));
    }
    numel *= dim;
  }
  return numel;
}

absl::StatusOr<LayoutPlan> PlanLayout(absl::Span<const TensorSpec> specs, int64_t chunk_elements,
                                      int world_size) {
  if (chunk_elements <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk size must be positive, got ", chunk_elements, " elements"));
  }
  if (world_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be positive, got ", world_size));
  }
  LayoutPlan plan;
  plan.chunk_elements = chunk_elements;
  plan.world_size = world_size;
  std::vector<int64_t> rank_bytes(static_cast<size_t>(world_size), 0);
  for (int kind_index = 0; kind_index < kNumChunkKinds; ++kind_index) {
    const auto kind = static_cast<ChunkKind>(kind_index);
    PlannedList list;
    list.kind = kind;
    int64_t first_of_kind = -1;
    int64_t oversize_groups = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(specs.size()); ++i) {
      const TensorSpec& spec = specs[i];
      if (spec.kind != kind) continue;
      if (first_of_kind < 0) {
        first_of_kind = i;
        list.dtype = spec.dtype;
      } else if (spec.dtype != list.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", spec.name, "' of kind ", ChunkKindName(kind), " is ", DTypeName(spec.dtype),
            " but '", specs[first_of_kind].name, "' of the same kind is ", DTypeName(list.dtype),
            ": one chunk list holds one dtype"));
      }
      if (MirroredKind(kind).has_value()) continue;  // placed after the loop
      PS_ASSIGN_OR_RETURN(const int64_t numel, NumElements(spec.shape));
      if (numel == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", spec.name, "' has no elements; nothing to place"));
      }
      if (numel > chunk_elements) {
        // Note [Oversize groups]: with world_size > 1 the tensor's chunk gets a group of its
        // own, padded with empty chunks of its size; which member holds it rotates with each
        // oversize group of the list, so large embeddings spread over the ranks.
        while (list.chunks.size() % world_size != 0) {
          list.chunks.push_back(PlannedChunk{chunk_elements, 0, {}, {}, false, true});
        }
        const int64_t holder = oversize_groups % world_size;
        for (int r = 0; r < world_size; ++r) {
          PlannedChunk own;
          own.capacity_elements = numel;
          own.oversize = true;
          own.padding = r != holder;
          if (r == holder) {
            own.used_elements = numel;
            own.tensors = {i};
            own.offsets = {0};
          }
          list.chunks.push_back(std::move(own));
        }
        oversize_groups += 1;
        plan.oversize_tensors.push_back(i);
        continue;
      }
      PlannedChunk* target = nullptr;
      for (PlannedChunk& chunk : list.chunks) {
        if (!chunk.oversize && chunk.capacity_elements - chunk.used_elements >= numel) {
          target = &chunk;
          break;
        }
      }
      if (target == nullptr) {
        list.chunks.push_back(PlannedChunk{chunk_elements, 0, {}, {}, false, false});
        target = &list.chunks.back();
      }
      target->padding = false;  // padding before an oversize group takes tensors like any chunk
      target->tensors.push_back(i);
      target->offsets.push_back(target->used_elements);
      target->used_elements += numel;
    }
    if (first_of_kind < 0) continue;
    if (const std::optional<ChunkKind> moment_kind = MirroredKind(kind)) {
      const auto moments =
          std::find_if(plan.lists.begin(), plan.lists.end(),
                       [&](const PlannedList& planned) { return planned.kind == *moment_kind; });
      if (moments == plan.lists.end()) {
        return absl::InvalidArgumentError(absl::StrCat(ChunkKindName(kind), " tensors need ",
                                                       ChunkKindName(*moment_kind),
                                                       " tensors to scale"));
      }
      PS_RETURN_IF_ERROR(PlanMirroredList(specs, *moments, list));
    }
    while (list.chunks.size() % world_size != 0) {
      list.chunks.push_back(PlannedChunk{chunk_elements, 0, {}, {}, false, true});
    }
    std::vector<int64_t> group_bytes(list.chunks.size() / static_cast<size_t>(world_size), 0);
    for (size_t c = 0; c < list.chunks.size(); ++c) {
      const PlannedChunk& chunk = list.chunks[c];
      // A chunk without tensors (padding) never gets a payload, on any rank: it is not memory.
      if (chunk.tensors.empty()) continue;
      plan.wasted_bytes +=
          (chunk.capacity_elements - chunk.used_elements) * ElementSize(list.dtype);
      // Chunk c is member c % world_size of its group (oversize groups start at a multiple).
      const int64_t bytes = chunk.capacity_elements * ElementSize(list.dtype);
      rank_bytes[c % static_cast<size_t>(world_size)] += bytes;
      group_bytes[c / static_cast<size_t>(world_size)] += bytes;
    }
    for (int64_t bytes : group_bytes) {
      plan.largest_group_bytes = std::max(plan.largest_group_bytes, bytes);
    }
    plan.lists.push_back(std::move(list));
  }
  plan.largest_rank_bytes = *std::max_element(rank_bytes.begin(), rank_bytes.end());
  return plan;
}

int64_t EstimatedRankPeak(const LayoutPlan& plan) {
  // One process gathers nothing: its chunks are its memory. Under data parallelism a rank holds
  // its own chunks plus gathered groups: the one in use and the one started ahead (or a
  // gradient group filling while the previous one is reduce-scattered).
  if (plan.world_size == 1) return plan.largest_rank_bytes;
  return plan.largest_rank_bytes + 2 * plan.largest_group_bytes;
}

absl::StatusOr<ChunkSizeSearchResult> SearchChunkSize(absl::Span<const TensorSpec> specs,
                                                      const ChunkSizeSearch& search,
                                                      int world_size) {
  if (search.min_elements <= 0 || search.step_elements <= 0 ||
      search.max_elements < search.min_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk size search range is empty or malformed: min ", search.min_elements,
                     ", max ", search.max_elements, ", step ", search.step_elements, " elements"));
  }
  if (search.floor_elements < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk size search floor must not be negative, got ", search.floor_elements));
  }
  // Ascending: the powers of two of the floor below the range, then the range itself.
  std::vector<int64_t> sizes;
  if (search.floor_elements > 0) {
    for (int64_t size = search.floor_elements; size < search.min_elements; size *= 2) {
      sizes.push_back(size);
    }
  }
  for (int64_t size = search.min_elements; size <= search.max_elements;
       size += search.step_elements) {
    sizes.push_back(size);
  }
  ChunkSizeSearchResult result;
  bool have_best = false;
  for (const int64_t size : sizes) {
    PS_ASSIGN_OR_RETURN(LayoutPlan plan, PlanLayout(specs, size, world_size));
    ++result.candidates;
    // Note [Chunk-size search].
    const int64_t peak = EstimatedRankPeak(plan);
    const int64_t best = have_best ? EstimatedRankPeak(result.plan) : 0;
    if (!have_best || peak < best ||
        (peak == best && plan.wasted_bytes < result.plan.wasted_bytes)) {
      result.plan = std::move(plan);
      have_best = true;
    }
  }
  return result;
}

uint64_t LayoutHash(const LayoutPlan& plan, absl::Span<const TensorSpec> specs) {
  Fnv1a hash;
  hash.AddInt(plan.chunk_elements);
  hash.AddInt(plan.world_size);
  for (const PlannedList& list : plan.lists) {
    hash.AddInt(static_cast<int64_t>(list.kind));
    hash.AddInt(static_cast<int64_t>(list.dtype));
    hash.AddInt(static_cast<int64_t>(list.chunks.size()));
    for (const PlannedChunk& chunk : list.chunks) {
      hash.AddInt(chunk.capacity_elements);
      hash.AddInt(static_cast<int64_t>(chunk.tensors.size()));
      for (size_t t = 0; t < chunk.tensors.size(); ++t) {
        const TensorSpec& spec = specs[chunk.tensors[t]];
        hash.AddString(spec.name);
        hash.AddInt(chunk.offsets[t]);
        hash.AddInt(static_cast<int64_t>(spec.shape.size()));
        for (int64_t dim : spec.shape) hash.AddInt(dim);
      }
    }
  }
  return hash.digest();
}

}  // namespace ps
