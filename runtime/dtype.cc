#include "runtime/dtype.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ps {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "float32" || lower == "fp32" || lower == "float") return DType::kFloat32;
  if (lower == "float16" || lower == "fp16" || lower == "half") return DType::kFloat16;
  if (lower == "bfloat16" || lower == "bf16") return DType::kBFloat16;
  if (lower == "uint8") return DType::kUInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected float32, float16, bfloat16 or uint8"));
}

}  // namespace ps
