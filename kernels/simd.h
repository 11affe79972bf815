// Run-time choice of the SIMD code path used by the CPU update kernels (kernels/adam.h).
//
// The binary is built for baseline x86-64; the AVX2 and AVX-512 paths are compiled with
// per-function target options and only entered when the CPU reports the features, so one build
// runs on every x86-64 CPU. The path is the best one the CPU supports unless overridden by the
// environment variable PS_ADAM_SIMD (scalar|avx2|avx512|avx512bf16) read at first use, or by
// ForceSimdLevel() (tests and benchmarks force each path in turn).
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ps::kernels {

enum class SimdLevel : int {
  kScalar = 0,      // portable C++ (std::fma), any CPU
  kAvx2 = 1,        // AVX2 + FMA + F16C
  kAvx512 = 2,      // AVX-512 F/BW/VL/DQ + the above; bf16 rounding done with integer ops
  kAvx512Bf16 = 3,  // kAvx512 + AVX-512 BF16 (vcvtneps2bf16 for the bf16 copy)
};

absl::string_view SimdLevelName(SimdLevel level);  // "scalar", "avx2", "avx512", "avx512bf16"
absl::StatusOr<SimdLevel> ParseSimdLevel(absl::string_view name);

// True when this CPU can run `level`.
bool CpuSupports(SimdLevel level);
// Every level this CPU can run, lowest first.
std::vector<SimdLevel> SupportedSimdLevels();
// The best level this CPU supports.
SimdLevel DetectedSimdLevel();

// The level the kernels use now: the forced one, else PS_ADAM_SIMD, else DetectedSimdLevel().
// A PS_ADAM_SIMD naming an unknown or unsupported level is logged once and ignored.
SimdLevel ActiveSimdLevel();
// Forces `level` for every later kernel call in the process; InvalidArgument when the CPU lacks
// it. Not meant to race with running kernels (a call in flight keeps the path it started with).
absl::Status ForceSimdLevel(SimdLevel level);
// Drops the forced level (back to PS_ADAM_SIMD or detection).
void ClearForcedSimdLevel();

}  // namespace ps::kernels
