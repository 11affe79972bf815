// The kinds of chunk the runtime manages.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

namespace ps {

enum class ChunkKind : uint8_t {
  kComputeParam = 0,  // fp16/bf16 (or fp32 in fp32 mode) params seen by the model
  kMasterParam = 1,   // fp32 master copy for mixed precision
  kMomentum = 2,
  kVariance = 3,
  kGradient = 4,  // separate gradient chunks (gradient accumulation)
};

absl::string_view ChunkKindName(ChunkKind kind);

}  // namespace ps
