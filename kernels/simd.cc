#include "kernels/simd.h"

#include <atomic>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "runtime/logging.h"

namespace ps::kernels {
namespace {

constexpr int kNotForced = -1;
std::atomic<int> forced_level{kNotForced};

SimdLevel FromEnvironmentOrDetection() {
  static const SimdLevel level = [] {
    const SimdLevel detected = DetectedSimdLevel();
    const char* value = std::getenv("PS_ADAM_SIMD");
    if (value == nullptr || *value == '\0') return detected;
    absl::StatusOr<SimdLevel> parsed = ParseSimdLevel(value);
    if (!parsed.ok()) {
      PS_LOG(kWarning, "PS_ADAM_SIMD: %s; using %s", parsed.status().message(),
             SimdLevelName(detected));
      return detected;
    }
    if (!CpuSupports(*parsed)) {
      PS_LOG(kWarning, "PS_ADAM_SIMD=%s: this CPU does not support it; using %s", value,
             SimdLevelName(detected));
      return detected;
    }
    PS_LOG(kInfo, "PS_ADAM_SIMD=%s", SimdLevelName(*parsed));
    return *parsed;
  }();
  return level;
}

}  // namespace

absl::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

absl::StatusOr<SimdLevel> ParseSimdLevel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (SimdLevel level :
       {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512, SimdLevel::kAvx512Bf16}) {
    if (lower == SimdLevelName(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown SIMD level '", name, "': expected scalar, avx2, avx512 or avx512bf16"));
}

bool CpuSupports(SimdLevel level) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (level) {
    case SimdLevel::kScalar:
      return true;
    case SimdLevel::kAvx2:
      return avx2;
    case SimdLevel::kAvx512:
      return avx512;
    case SimdLevel::kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

std::vector<SimdLevel> SupportedSimdLevels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level :
       {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512, SimdLevel::kAvx512Bf16}) {
    if (CpuSupports(level)) levels.push_back(level);
  }
  return levels;
}

SimdLevel DetectedSimdLevel() { return SupportedSimdLevels().back(); }

SimdLevel ActiveSimdLevel() {
  const int forced = forced_level.load(std::memory_order_relaxed);
  if (forced != kNotForced) return static_cast<SimdLevel>(forced);
  return FromEnvironmentOrDetection();
}

absl::Status ForceSimdLevel(SimdLevel level) {
  if (!CpuSupports(level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SIMD level ", SimdLevelName(level), " is not supported by this CPU"));
  }
  forced_level.store(static_cast<int>(level), std::memory_order_relaxed);
  return absl::OkStatus();
}

void ClearForcedSimdLevel() { forced_level.store(kNotForced, std::memory_order_relaxed); }

}  // namespace ps::kernels
