// Element types of chunk payloads.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ps {

enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int64_t ElementSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

absl::string_view DTypeName(DType dtype);  // "float32", "float16", "bfloat16"
// Accepts the names above and torch's aliases ("fp32", "float", "half", "fp16", "bf16").
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace ps
