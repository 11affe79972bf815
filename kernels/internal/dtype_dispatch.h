// The one dispatch between the two 16-bit dtypes, shared by the CPU and CUDA kernels.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "runtime/dtype.h"

namespace ps::kernels::internal {

// Note [One fp16/bf16 dispatch]
// An entry point that handles fp16 and bf16 alike (the CPU casts, the device casts) picks its
// instantiation here, so the dtype check and its error exist once. `body` is a generic lambda
// with the dtype as its template argument (`[&]<DType kDtype>() { ...; return status; }`);
// any other dtype is InvalidArgument "<what>: got <dtype>".
template <typename Body>
absl::Status DispatchHalfOrBFloat16(DType dtype, absl::string_view what, Body&& body) {
  switch (dtype) {
    case DType::kFloat16:
      return body.template operator()<DType::kFloat16>();
    case DType::kBFloat16:
      return body.template operator()<DType::kBFloat16>();
    default:
      return absl::InvalidArgumentError(absl::StrCat(what, ": got ", DTypeName(dtype)));
  }
}

}  // namespace ps::kernels::internal
