#include "kernels/adam.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kernels/internal/cpu_paths.h"
#include "kernels/parallel.h"
#include "kernels/quantization.h"
#include "kernels/simd.h"
#include "runtime/status.h"

namespace ps::kernels {

// Note [Adam arithmetic]
// The update reproduces torch.optim.Adam / AdamW with foreach=False (torch/optim/adam.py,
// _single_tensor_adam) operation by operation, with torch's CPU kernels' roundings:
//   g  = grad * grad_mul                      grad_mul = float(clip_coef / grad_scale)
//   Adam:  g = fma(p, float(wd), g)           grad.add(param, alpha=wd) (vec::fmadd)
//   AdamW: p = p * float(1 - lr * wd)         param.mul_(1 - lr * wd)
//   m  = fma(c, g - m, base)                  exp_avg.lerp_(grad, 1 - beta1): c = w, base = m
//                                             when |w| < 0.5, else c = w - 1, base = g
//   v  = fma(float(1 - beta2) * g, g, v * float(beta2))     mul_(beta2).addcmul_(g, g, 1 - beta2):
//                                             torch's build contracts addcmul's vector code
//                                             (self + value * t1 * t2) into this FMA
//   d  = sqrt(v) / float(sqrt(1 - beta2^t)) + float(eps)     (exp_avg_sq.sqrt() / bc2).add_(eps)
//   p  = p + (float(-lr / (1 - beta1^t)) * m) / d            param.addcdiv_(m, d, -step_size)
// The per-step scalars are computed in double (Python floats) and rounded to float once
// (internal::AdamConstants). With grad_scale = clip_coef = 1 the multiply is exact. One known
// difference remains: torch 2.13's CPU sqrt of a large float tensor goes through MKL's vsSqrt,
// (or a vectorized sqrt of similar accuracy), which is not correctly rounded (seen: 0.63 ulp),
// while every path here uses the IEEE sqrt. The denominators then differ by an ulp in a few
// percent of the elements, so params differ from torch's by about 1e-7 relative; exp_avg and
// exp_avg_sq stay bit-equal for AdamW. The tests ask for 1e-6 relative after 10 steps.
//
// Note [Identical rounding on every path]
// The scalar, AVX2, AVX-512 and CUDA kernels perform the same IEEE operations in the same order:
// +, -, *, / and sqrt are correctly rounded everywhere, the one fused multiply-add per use is an
// explicit fma on every path (std::fma, vfmadd, __fmaf_rn), nothing else may be contracted
// (-ffp-contract=off; __fmul_rn/__fadd_rn on the GPU), the 16-bit conversions are round to
// nearest even with the same NaN rule, and tails run through the same vector code on
// zero-padded copies. The results are therefore bit-identical across paths, which the tests
// check with exact equality by forcing each path.

// Note [Low-precision Adam]
// Issue 21 adds two independent choices to the chunk, handled by the same one-pass kernel:
//  - state_dtype: the moments are loaded as bf16 (exact widening) or as 8-bit codes (code value
//    times the block's old scale, one multiply), the update runs in fp32 exactly as in Note [Adam
//    arithmetic], the param update uses the fp32 moments just computed (as bitsandbytes'
//    blockwise 8-bit Adam does), and the new moments are stored rounded to nearest even (bf16)
//    or requantized (int8: the block's new fp32 moments go to a 2048-element stack buffer, then
//    the new scale is taken and the codes written from the buffer, Note [Blockwise
//    quantization]). Main memory is read and written once per element either way.
//  - param_dtype bf16 without an fp32 master, Kahan-compensated ("Revisiting BFloat16 Training",
//    optimi's kahan_sum): with p the widened bf16 param and c the widened compensation,
//        q  = the fp32 Adam result from p (Note [Adam arithmetic], decay included)
//        y  = (q - p) + c                the intended change plus the error carried so far
//        s  = p + y;  p' = bf16(s)       round to nearest even
//        c' = bf16(y - (float(p') - p))  what this rounding lost, for the next step
//    so updates far below the bf16 ulp of p accumulate in c until they move p. q - p and
//    float(p') - p are exact (Sterbenz) whenever q and p' are within a factor 2 of p.
// int8 state's denominator multiplies by 1 / sqrt(bc2) instead of dividing by sqrt(bc2) (Note
// [One division fewer for int8 state]).
// All of it is +, -, *, /, sqrt, one fma per use and table lookups by integer index, so every
// path (and the CUDA kernel) rounds identically (Note [Identical rounding on every path]).
//
// Note [One division fewer for int8 state]
// With int8 state the denominator is d = sqrt(v) * float(1 / sqrt(1 - beta2^t)) + float(eps)
// (the reciprocal computed in double once per step, AdamConstants::inverse_bias_correction2_sqrt)
// instead of Note [Adam arithmetic]'s sqrt(v) / float(sqrt(1 - beta2^t)): a multiply where the
// division was, so two divider operations per element (the square root and p's division) instead
// of three. The int8 update's loop is bound by the divider; in cache, one thread, this made the
// int8-state kernel 6-8% faster (docs/kernels_lowp.md, "Performance"). The two forms differ by
// at most an ulp of d. Torch-exactness means nothing here: torch has no 8-bit Adam, and the
// moments (which alone decide the codes and scales) are untouched, still torch's bit for bit;
// the references (kernels_adam_lowp_test, tests/python/test_adam_lowp.py) encode this formula.
// fp32 and bf16 state keep the division, so that the fp32 path stays torch's operation for
// operation and bf16 state keeps its bit-exact comparison with torch.optim.AdamW rounded to
// bf16 (those kernels are near their memory bound when the machine is quiet). Every path, the
// CUDA kernel included, multiplies where the state is int8 (Note [Identical rounding on every
// path] still holds: one correctly rounded multiply).
//
// Note [Stochastic rounding]
// The alternative to Kahan for bf16 params (param_rounding kStochastic, no compensation buffer):
// p' = bf16 of q rounded up with probability (the 16 dropped bits) / 2^16, unbiased, so that
// updates below the bf16 ulp still move p on average. The random bits are a function of
// (rounding_seed, step, element index) only (internal::RoundingBits: lowbias32 of the index
// under a per-step key), not of a stateful generator, so the result is the same on every SIMD
// path, thread split and on the GPU, and a step can be replayed. Indices are taken mod 2^32.

absl::string_view StateDTypeName(StateDType dtype) {
  switch (dtype) {
    case StateDType::kFloat32:
      return "fp32";
    case StateDType::kBFloat16:
      return "bf16";
    case StateDType::kInt8:
      return "int8";
  }
  return "unknown";
}

absl::StatusOr<StateDType> ParseStateDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "fp32" || lower == "float32" || lower == "float") return StateDType::kFloat32;
  if (lower == "bf16" || lower == "bfloat16") return StateDType::kBFloat16;
  if (lower == "int8" || lower == "8bit") return StateDType::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown Adam state dtype '", name, "': expected fp32, bf16 or int8"));
}

namespace internal {

AdamConstants MakeAdamConstants(const AdamHyperParams& p) {
  const double step = static_cast<double>(p.step);
  const double bias_correction1 = p.bias_correction ? 1.0 - std::pow(p.beta1, step) : 1.0;
  const double bias_correction2 = p.bias_correction ? 1.0 - std::pow(p.beta2, step) : 1.0;
  const float lerp_weight = static_cast<float>(1.0 - p.beta1);
  const bool lerp_from_grad = !(std::fabs(lerp_weight) < 0.5f);
  AdamConstants k;
  k.grad_mul = static_cast<float>(p.clip_coef / p.grad_scale);
  k.l2 = !p.decoupled_weight_decay && p.weight_decay != 0.0;
  k.decoupled = p.decoupled_weight_decay && p.weight_decay != 0.0;
  k.l2_decay = k.l2 ? static_cast<float>(p.weight_decay) : 0.0f;
  k.param_decay = k.decoupled ? static_cast<float>(1.0 - p.lr * p.weight_decay) : 1.0f;
  k.lerp_from_grad = lerp_from_grad;
  k.lerp_coeff = lerp_from_grad ? lerp_weight - 1.0f : lerp_weight;
  k.beta2 = static_cast<float>(p.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  k.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  k.inverse_bias_correction2_sqrt = static_cast<float>(1.0 / std::pow(bias_correction2, 0.5));
  k.neg_step_size = static_cast<float>(-(p.lr / bias_correction1));
  k.eps = static_cast<float>(p.eps);
  k.step = p.step;
  return k;
}

}  // namespace internal

absl::Status ValidateAdamHyperParams(const AdamHyperParams& p) {
  auto check = [](bool ok, absl::string_view name, double value, absl::string_view expected) {
    if (ok && std::isfinite(value)) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("Adam: invalid ", name, " ", value, ": expected ", expected));
  };
  PS_RETURN_IF_ERROR(check(p.lr >= 0.0, "lr", p.lr, ">= 0"));
  PS_RETURN_IF_ERROR(check(p.beta1 >= 0.0 && p.beta1 < 1.0, "beta1", p.beta1, "in [0, 1)"));
  PS_RETURN_IF_ERROR(check(p.beta2 >= 0.0 && p.beta2 < 1.0, "beta2", p.beta2, "in [0, 1)"));
  PS_RETURN_IF_ERROR(check(p.eps >= 0.0, "eps", p.eps, ">= 0"));
  PS_RETURN_IF_ERROR(check(p.weight_decay >= 0.0, "weight_decay", p.weight_decay, ">= 0"));
  PS_RETURN_IF_ERROR(check(p.grad_scale > 0.0, "grad_scale", p.grad_scale, "> 0"));
  PS_RETURN_IF_ERROR(check(p.clip_coef >= 0.0, "clip_coef", p.clip_coef, ">= 0"));
  if (p.step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Adam: invalid step ", p.step, ": expected >= 1 (the count after increment)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateAdamChunk(const AdamChunk& c) {
  if (c.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Adam chunk: negative count ", c.count));
  }
  if (c.grad_dtype != DType::kFloat32 && c.grad_dtype != DType::kFloat16 &&
      c.grad_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("Adam chunk: unknown grad dtype ", static_cast<int>(c.grad_dtype)));
  }
  if (c.param_copy != nullptr && c.copy_dtype != DType::kFloat16 &&
      c.copy_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Adam chunk: the param copy must be float16 or bfloat16, not ", DTypeName(c.copy_dtype)));
  }
  if (c.count > 0 && (c.param == nullptr || c.grad == nullptr || c.exp_avg == nullptr ||
                      c.exp_avg_sq == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Adam chunk of ", c.count, " elements: null param, grad, exp_avg or exp_avg_sq"));
  }
  if (c.param_dtype != DType::kFloat32 && c.param_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Adam chunk: param_dtype must be float32 or bfloat16, not ", DTypeName(c.param_dtype)));
  }
  if (c.param_dtype == DType::kBFloat16) {
    if (c.param_copy != nullptr) {
      return absl::InvalidArgumentError(
          "Adam chunk: param_copy is set but param_dtype is bfloat16 (the param is the compute "
          "copy: there is no fp32 master to copy from)");
    }
    if (c.count > 0 && c.param_compensation == nullptr &&
        c.param_rounding == ParamRounding::kKahan) {
      return absl::InvalidArgumentError(
          "Adam chunk: param_compensation is null but param_dtype is bfloat16 (the Kahan "
          "compensation buffer of count bf16 elements is required)");
    }
  } else if (c.param_compensation != nullptr) {
    return absl::InvalidArgumentError(
        "Adam chunk: param_compensation is set but param_dtype is float32");
  }
  if (c.param_rounding != ParamRounding::kKahan &&
      c.param_rounding != ParamRounding::kStochastic) {
    return absl::InvalidArgumentError(absl::StrCat("Adam chunk: unknown param_rounding ",
                                                   static_cast<int>(c.param_rounding)));
  }
  if (c.param_rounding == ParamRounding::kStochastic) {
    if (c.param_dtype != DType::kBFloat16) {
      return absl::InvalidArgumentError(
          "Adam chunk: param_rounding is stochastic but param_dtype is float32 (stochastic "
          "rounding is for bf16 params without a master)");
    }
    if (c.param_compensation != nullptr) {
      return absl::InvalidArgumentError(
          "Adam chunk: param_compensation is set but param_rounding is stochastic (the "
          "compensation buffer belongs to Kahan)");
    }
  }
  switch (c.state_dtype) {
    case StateDType::kFloat32:
    case StateDType::kBFloat16:
      if (c.exp_avg_scale != nullptr || c.exp_avg_sq_scale != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Adam chunk: exp_avg_scale/exp_avg_sq_scale are set but state_dtype is ",
            StateDTypeName(c.state_dtype), " (scales belong to int8 state)"));
      }
      break;
    case StateDType::kInt8:
      if (c.count > 0 && (c.exp_avg_scale == nullptr || c.exp_avg_sq_scale == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Adam chunk: state_dtype is int8 but exp_avg_scale or exp_avg_sq_scale is null (",
            NumQuantizationBlocks(c.count), " scales each are needed)"));
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("Adam chunk: unknown state_dtype ", static_cast<int>(c.state_dtype)));
  }
  return absl::OkStatus();
}

namespace {

absl::Status ValidateChunks(absl::Span<const AdamChunk> chunks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    absl::Status status = ValidateAdamChunk(chunks[i]);
    if (!status.ok()) return Annotate(status, absl::StrCat("chunk ", i));
  }
  return absl::OkStatus();
}

std::vector<int64_t> Counts(absl::Span<const AdamChunk> chunks) {
  std::vector<int64_t> counts;
  for (const AdamChunk& chunk : chunks) counts.push_back(chunk.count);
  return counts;
}

// Runs fn(chunk, begin, end) over every chunk split into kAdamBlock-element blocks, spread over
// the kernel threads.
template <typename Fn>
void ForEachBlock(absl::Span<const AdamChunk> chunks, const Fn& fn) {
  ParallelForChunkBlocks(
      Counts(chunks), internal::kAdamBlock,
      [&](size_t c, int64_t, int64_t begin, int64_t end) { fn(chunks[c], begin, end); });
}

}  // namespace

absl::Status AdamUpdate(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params) {
  PS_RETURN_IF_ERROR(ValidateAdamHyperParams(params));
  PS_RETURN_IF_ERROR(ValidateChunks(chunks));
  const internal::AdamConstants constants = internal::MakeAdamConstants(params);
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  ForEachBlock(chunks, [&](const AdamChunk& chunk, int64_t begin, int64_t end) {
    path.adam(chunk, constants, begin, end);
  });
  return absl::OkStatus();
}

absl::Status AdamUpdate(const AdamChunk& chunk, const AdamHyperParams& params) {
  return AdamUpdate(absl::MakeConstSpan(&chunk, 1), params);
}

// Note [The norm the update measures]
// DeepSpeed's engines report the gradient norm of every step (get_global_grad_norm), clipping or
// not. A separate pass for it (grad_stats) costs 20-30% of the update's time here: it reads the
// gradient from memory again, and squares in double. Instead the update's own vector loop, which
// has the gradient in a register as stored, adds its squares into the norm's 16 double lanes as
// it goes, where a memory-bound loop has idle arithmetic slots. The update blocks are the norm's
// blocks (kAdamBlock == kNormBlock, the same fixed offsets), a vector's squares go to the lanes of
// its place in its group of 16 (the tail's zero padding adds zeros), and the lanes and then the
// block sums are added in sum_squares' order, so the result is ComputeGradStats' bit for bit
// (Note [Deterministic norm] in kernels/grad_stats.cc) on every path and thread count. Each
// vector's squares are of the gradient it loaded, before its stores, so the sum is of the
// gradient before the step even where param_copy overwrites a 16-bit gradient in place.
absl::StatusOr<double> AdamUpdateMeasuringGradients(absl::Span<const AdamChunk> chunks,
                                                    const AdamHyperParams& params) {
  static_assert(internal::kAdamBlock == internal::kNormBlock,
                "the update's blocks must be the norm's (Note [The norm the update measures])");
  PS_RETURN_IF_ERROR(ValidateAdamHyperParams(params));
  PS_RETURN_IF_ERROR(ValidateChunks(chunks));
  const internal::AdamConstants constants = internal::MakeAdamConstants(params);
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  const std::vector<int64_t> counts = Counts(chunks);
  std::vector<double> block_sums(NumChunkBlocks(counts, internal::kNormBlock), 0.0);
  ParallelForChunkBlocks(
      counts, internal::kAdamBlock, [&](size_t c, int64_t block, int64_t begin, int64_t end) {
        block_sums[block] = path.adam_measuring(chunks[c], constants, begin, end);
      });
  double squared_norm = 0.0;
  for (double sum : block_sums) squared_norm += sum;
  return squared_norm;
}

absl::Status AdamTrafficBound(absl::Span<const AdamChunk> chunks) {
  PS_RETURN_IF_ERROR(ValidateChunks(chunks));
  const internal::CpuPath& path = internal::GetCpuPath(ActiveSimdLevel());
  ForEachBlock(chunks, [&](const AdamChunk& chunk, int64_t begin, int64_t end) {
    path.traffic(chunk, begin, end);
  });
  return absl::OkStatus();
}

absl::StatusOr<HybridAdamReport> HybridAdamStep(absl::Span<const AdamChunkUpdate> updates,
                                                const AdamHyperParams& params,
                                                const HybridAdamOptions& options) {
  PS_RETURN_IF_ERROR(ValidateAdamHyperParams(params));
  HybridAdamReport report;
  std::vector<AdamChunk> host, device;
  for (size_t i = 0; i < updates.size(); ++i) {
    const AdamChunk& chunk = updates[i].chunk;
    absl::Status status = ValidateAdamChunk(chunk);
    if (!status.ok()) return Annotate(status, absl::StrCat("hybrid Adam update ", i));
    if (updates[i].location == ChunkLocation::kDevice) {
      device.push_back(chunk);
      ++report.device_chunks;
      report.device_elements += chunk.count;
    } else {
      host.push_back(chunk);
      ++report.host_chunks;
      report.host_elements += chunk.count;
    }
  }
  // Enqueue the GPU work first: it runs while this thread and the pool update the host chunks.
  if (!device.empty()) {
    PS_RETURN_IF_ERROR(
        Annotate(AdamUpdateOnDevice(device, params, options.stream), "hybrid Adam, device chunks"));
  }
  absl::Status host_status = AdamUpdate(host, params);
  if (!device.empty() && options.synchronize) {
    absl::Status device_status = gpu::SynchronizeStream(options.stream);
    if (!device_status.ok()) return Annotate(device_status, "hybrid Adam, device chunks");
  }
  if (!host_status.ok()) return Annotate(host_status, "hybrid Adam, host chunks");
  return report;
}

}  // namespace ps::kernels
