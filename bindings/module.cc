// patrickstar._C: the one extension module. torch must be imported before it (the Python package
// does so) because it links against LibTorch.
#include <pybind11/pybind11.h>

#include "bindings/init.h"
#include "bindings/status_exceptions.h"

PYBIND11_MODULE(_C, module) {
  module.doc() = "PatrickStar-C++ runtime: memory tiers, chunks and update kernels";
  ps::bindings::RegisterStatusExceptions(module);
  ps::bindings::InitRuntime(module);
  ps::bindings::InitChunk(module);
  ps::bindings::InitKernels(module);
  ps::bindings::InitComm(module);
  ps::bindings::InitParameterSlots(module);
}
