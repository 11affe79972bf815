// Python bindings of the chunk layer (chunk/).
#include "bindings/init.h"
#include "chunk/chunk_kind.h"

namespace py = pybind11;

namespace ps::bindings {

void InitChunk(py::module_& module) {
  py::enum_<ChunkKind>(module, "ChunkKind")
      .value("COMPUTE_PARAM", ChunkKind::kComputeParam)
      .value("MASTER_PARAM", ChunkKind::kMasterParam)
      .value("MOMENTUM", ChunkKind::kMomentum)
      .value("VARIANCE", ChunkKind::kVariance)
      .value("GRADIENT", ChunkKind::kGradient);
}

}  // namespace ps::bindings
