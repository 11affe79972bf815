// Element types of chunk payloads.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ps {

// kUInt8 holds the codes of 8-bit optimizer state (kernels/quantization.h): chunks of it are
// stored, moved and checkpointed, never reduced or converted as numbers.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kUInt8 = 3 };

constexpr int64_t ElementSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : (dtype == DType::kUInt8 ? 1 : 2);
}

absl::string_view DTypeName(DType dtype);  // "float32", "float16", "bfloat16", "uint8"
// Accepts the names above and torch's aliases ("fp32", "float", "half", "fp16", "bf16").
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace ps
