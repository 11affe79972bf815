// Helpers shared by the ChunkManager's source files (chunk_manager*.cc); not a public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "chunk/chunk_kind.h"
#include "chunk/chunk_layout.h"

namespace ps::chunk_manager_internal {

// A tier budget of 0 means "no limit".
inline constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

inline bool IsOptimizerState(ChunkKind kind) {
  return kind == ChunkKind::kMasterParam || kind == ChunkKind::kMomentum ||
         kind == ChunkKind::kVariance || kind == ChunkKind::kMomentumScale ||
         kind == ChunkKind::kVarianceScale || kind == ChunkKind::kParamCompensation;
}

inline bool Contains(absl::Span<const ChunkId> ids, ChunkId id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

inline std::vector<ChunkId> With(absl::Span<const ChunkId> ids, ChunkId id) {
  std::vector<ChunkId> result(ids.begin(), ids.end());
  result.push_back(id);
  return result;
}

}  // namespace ps::chunk_manager_internal
