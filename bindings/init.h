// Each layer's part of the patrickstar._C module.
#pragma once

#include <pybind11/pybind11.h>

namespace ps::bindings {

void InitRuntime(pybind11::module_& module);
void InitChunk(pybind11::module_& module);
void InitKernels(pybind11::module_& module);
void InitComm(pybind11::module_& module);
void InitParameterSlots(pybind11::module_& module);

}  // namespace ps::bindings
