// Internal: the per-SIMD-path CPU kernels behind kernels/adam.h and kernels/grad_stats.h.
#pragma once

#include <cstdint>

#include "kernels/adam.h"
#include "kernels/internal/stochastic_rounding.h"
#include "kernels/quantization.h"
#include "kernels/simd.h"
#include "runtime/dtype.h"

namespace ps::kernels::internal {

// The per-step scalars of the update, rounded to float once (Note [Adam arithmetic]). The GPU
// kernel receives the same struct, so both sides compute with the same constants.
struct AdamConstants {
  float grad_mul;     // clip_coef / grad_scale
  float l2_decay;     // weight_decay, added to the gradient (Adam); 0 when unused
  float param_decay;  // 1 - lr * weight_decay (AdamW); 1 when unused
  float lerp_coeff;   // torch's lerp: 1 - beta1, or (1 - beta1) - 1 when 1 - beta1 >= 0.5
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float inverse_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^step): int8 state only (Note [One
                                        // division fewer for int8 state] in kernels/adam.cc)
  float neg_step_size;  // -lr / (1 - beta1^step)
  float eps;
  int32_t l2;              // add l2_decay * param to the gradient
  int32_t decoupled;       // multiply param by param_decay
  int32_t lerp_from_grad;  // lerp base is the gradient (1 - beta1 >= 0.5)
  int64_t step;            // for stochastic rounding's random bits (Note [Stochastic rounding])
};
AdamConstants MakeAdamConstants(const AdamHyperParams& params);

// Elements per block of the norm reduction. Block boundaries are fixed relative to the chunk
// start so that the summation order does not depend on threads (Note [Deterministic norm]).
inline constexpr int64_t kNormBlock = int64_t{1} << 15;
// Elements per block of the update (elementwise, so a scheduling choice; the same as the norm's
// so that the update can measure the norm block by block: Note [The norm the update measures]).
inline constexpr int64_t kAdamBlock = kNormBlock;

struct CpuPath {
  // Updates elements [begin, end) of `chunk`.
  void (*adam)(const AdamChunk& chunk, const AdamConstants& k, int64_t begin, int64_t end);
  // `adam` on one norm block [begin, end) (Note [Deterministic norm]), returning the sum of
  // squares of its gradient as stored, the bits of `sum_squares` (Note [The norm the update
  // measures] in kernels/adam.cc).
  double (*adam_measuring)(const AdamChunk& chunk, const AdamConstants& k, int64_t begin,
                           int64_t end);
  // AdamTrafficBound's kernel on [begin, end).
  void (*traffic)(const AdamChunk& chunk, int64_t begin, int64_t end);
  // Sum of squares of elements [begin, end), end - begin <= kNormBlock, in 16 double lanes
  // (element i into lane (i - begin) % 16) added in a fixed tree order.
  double (*sum_squares)(const void* data, DType dtype, int64_t begin, int64_t end);
  // True when some element of [begin, end) is inf or NaN.
  bool (*has_inf_or_nan)(const void* data, DType dtype, int64_t begin, int64_t end);
  // Nearest codes of already normalized values, with the int8 update's search (tests).
  void (*quantize_normalized)(QuantizationMap map, const float* values, int64_t n,
                              uint8_t* codes);
  // fp32 -> `dtype` (kFloat16 or kBFloat16) exactly as the update's param_copy stores it.
  void (*cast_to_16)(const float* src, uint16_t* dst, int64_t n, DType dtype);
};

const CpuPath& GetCpuPath(SimdLevel level);

// Tests: false makes the AVX-512 paths gather the int8 code values even where the CPU has VBMI
// (Note [Dequantization by byte tables] in kernels/cpu_paths.cc), so both variants are checked.
void AllowVbmiForTesting(bool allowed);

}  // namespace ps::kernels::internal
