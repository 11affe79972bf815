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
  // Blockwise scales of 8-bit moments (float32, one per 2048 elements; Note [Scale lists
  // mirror their moments] in chunk_layout.cc).
  kMomentumScale = 5,
  kVarianceScale = 6,
  // bf16 training without an fp32 master (bf16.master_weights false): the Kahan compensation
  // of each bf16 parameter's updates (bf16, zero-initialized), optimizer state like a master.
  kParamCompensation = 7,
};

absl::string_view ChunkKindName(ChunkKind kind);

}  // namespace ps
