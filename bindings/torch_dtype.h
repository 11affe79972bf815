// DType <-> torch scalar types, for the bindings that wrap chunk memory in torch tensors.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include "runtime/dtype.h"

namespace ps::bindings {

inline at::ScalarType ToScalarType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kUInt8:
      return at::kByte;
  }
  throw pybind11::value_error("unknown dtype");
}

inline DType DTypeFromTorch(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      throw pybind11::value_error(std::string("collectives take float32, float16 or bfloat16 "
                                              "tensors, got ") +
                                  c10::toString(type));
  }
}

}  // namespace ps::bindings
