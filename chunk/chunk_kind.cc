#include "chunk/chunk_kind.h"

namespace ps {

absl::string_view ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kComputeParam: return "compute_param";
    case ChunkKind::kMasterParam: return "master_param";
    case ChunkKind::kMomentum: return "momentum";
    case ChunkKind::kVariance: return "variance";
    case ChunkKind::kGradient: return "gradient";
    case ChunkKind::kMomentumScale: return "momentum_scale";
    case ChunkKind::kVarianceScale: return "variance_scale";
    case ChunkKind::kParamCompensation: return "param_compensation";
  }
  return "unknown";
}

}  // namespace ps
