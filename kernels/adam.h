// Fused Adam / AdamW updates of optimizer-state chunks, on the CPU (AVX-512 / AVX2 / scalar,
// chosen at run time, see kernels/simd.h) and on the GPU (CUDA builds), plus the hybrid
// dispatcher that updates device-resident chunks with the GPU kernel and host-resident ones with
// the CPU kernel at the same time.
//
// One pass per chunk reads the fp32 master param, the gradient (fp32, fp16 or bf16), momentum
// and variance, and writes param, momentum, variance and, when asked, the fp16/bf16 compute
// copy of the param. The arithmetic is torch.optim.Adam / AdamW (foreach=False) operation for
// operation; see Note [Adam arithmetic] in adam.cc. The moments may instead be bf16 or blockwise
// 8-bit (kernels/quantization.h), and the param bf16 without an fp32 master, Kahan-compensated
// or stochastically rounded, in the same single pass (Note [Low-precision Adam]).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "runtime/dtype.h"
#include "runtime/gpu.h"

namespace ps::kernels {

struct AdamHyperParams {
  // Doubles, as Python floats are: the per-step constants are computed in double and rounded to
  // float once, as torch does (Note [Adam arithmetic]).
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW (param *= 1 - lr * weight_decay); false: Adam (grad += weight_decay * param).
  bool decoupled_weight_decay = false;
  bool bias_correction = true;
  // The step number after increment: 1 on the first update.
  int64_t step = 1;
  // Gradients are divided by `grad_scale` (the loss scale) and then multiplied by `clip_coef`
  // (the global-norm clipping coefficient, <= 1) inside the pass.
  double grad_scale = 1.0;
  double clip_coef = 1.0;
};

// How the Adam moments are stored (issue 21).
enum class StateDType : uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,  // bf16 bits; loaded exactly, updated in fp32, stored rounded to nearest even
  kInt8 = 2,      // 8-bit codes of the dynamic maps with one scale per 2048 elements
                  // (kernels/quantization.h): signed map for exp_avg, unsigned for exp_avg_sq
};
absl::string_view StateDTypeName(StateDType dtype);  // "fp32", "bf16", "int8"
absl::StatusOr<StateDType> ParseStateDType(absl::string_view name);
// Bytes per element of a moment (scales excluded).
constexpr int64_t StateElementSize(StateDType dtype) {
  return dtype == StateDType::kFloat32 ? 4 : (dtype == StateDType::kBFloat16 ? 2 : 1);
}

// How a bf16 param without an fp32 master (AdamChunk::param_dtype kBFloat16) takes its update.
enum class ParamRounding : uint8_t {
  kKahan = 0,       // round to nearest even; the error is carried in param_compensation
  kStochastic = 1,  // stochastic rounding with counter-based random bits of (rounding_seed,
                    // step, element index): no compensation buffer, results independent of
                    // threads and SIMD path (Note [Stochastic rounding] in adam.cc)
};

// One chunk to update. All pointers address `count` elements; they are host pointers for the
// CPU kernel and device pointers for the GPU kernel. `param_copy` may be null (no copy-out). A
// 16-bit `grad` and `param_copy` may be the same memory (PatrickStar writes the new compute
// params over the gradients they came from): every element's gradient is read before its copy
// is written, on every path. Other overlaps are not allowed.
struct AdamChunk {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param_copy = nullptr;
  DType copy_dtype = DType::kFloat16;  // kFloat16 or kBFloat16 when param_copy is set
  int64_t count = 0;

  // Low-precision params and state (issue 21; Note [Low-precision Adam] in adam.cc). `param`,
  // `exp_avg` and `exp_avg_sq` keep their float* type for the fp32 case; with another dtype they
  // address that dtype's elements (bf16 as uint16_t bits, int8 codes as uint8_t) and the caller
  // casts, e.g. reinterpret_cast<float*>(codes).
  //
  // kFloat32: `param` is the fp32 master. kBFloat16: `param` holds the bf16 params themselves
  // (no fp32 master, no `param_copy`); the update is computed in fp32 and added with Kahan
  // compensation, the rounding error carried in `param_compensation` (bf16, `count` elements,
  // zero-initialized by the owner with the params).
  DType param_dtype = DType::kFloat32;
  uint16_t* param_compensation = nullptr;
  // bf16 params only: kStochastic instead of Kahan (then param_compensation is null). The
  // random bits of element i at step t are a hash of (rounding_seed, t, i mod 2^32): give each
  // chunk its own seed (e.g. a global seed mixed with the chunk id).
  ParamRounding param_rounding = ParamRounding::kKahan;
  uint64_t rounding_seed = 0;
  StateDType state_dtype = StateDType::kFloat32;
  // kInt8 only: NumQuantizationBlocks(count) float scales per moment (4-byte aligned, in any
  // memory the kernel reads: a chunk of its own is fine). Quantization block b covers elements
  // [2048 b, 2048 (b + 1)) of this chunk, counted from `exp_avg` (Note [Blockwise quantization]).
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
};

// InvalidArgument naming the field when a value is out of range (torch's checks, plus
// grad_scale > 0 and clip_coef >= 0, both finite) or when the chunk's fields do not fit together
// (param_dtype bf16 with a param_copy or without param_compensation, state int8 without scales,
// scales or compensation given where they are unused).
absl::Status ValidateAdamHyperParams(const AdamHyperParams& params);
absl::Status ValidateAdamChunk(const AdamChunk& chunk);

// Updates `chunks` in place on the CPU with the kernel thread pool (kernels/parallel.h). The
// chunks are split into blocks that the pool's threads take in turn; results do not depend on
// the thread count or on the SIMD path (Note [Identical rounding on every path]).
absl::Status AdamUpdate(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params);
absl::Status AdamUpdate(const AdamChunk& chunk, const AdamHyperParams& params);

// AdamUpdate that also returns the squared L2 norm of the chunks' gradients as stored (before
// grad_scale and clip_coef), bit-identical to ComputeGradStats over the same gradients, without
// a second pass over memory (Note [The norm the update measures] in kernels/adam.cc).
absl::StatusOr<double> AdamUpdateMeasuringGradients(absl::Span<const AdamChunk> chunks,
                                                    const AdamHyperParams& params);

// The memory-traffic twin of AdamUpdate: exactly the same loads and stores (read param, grad,
// exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq and the copy when there is one; for the
// low-precision variants also the compensation and the scales, in their dtypes, with int8 moments
// staged through the same per-block buffer), the same SIMD path, blocks and threads, but trivial
// arithmetic. Benchmarks time it as the
// bandwidth bound of the update. It overwrites the chunk with meaningless values.
absl::Status AdamTrafficBound(absl::Span<const AdamChunk> chunks);

// The GPU kernel: all chunks (device pointers on `stream.device`) are updated by one fused
// launch per 48 chunks, enqueued on `stream` (asynchronous: the caller synchronizes).
// FailedPrecondition in a build without CUDA or without a device.
absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params,
                                gpu::Stream stream);

// Hybrid placement (PatrickStar's hybrid Adam with margin chunks): each update names where its
// chunk's memory lives. Device chunks go to the GPU kernel on `stream`, host chunks to the CPU
// kernel; the GPU work is enqueued first and runs while the CPU threads update the host chunks.
enum class ChunkLocation : uint8_t { kHost = 0, kDevice = 1 };
struct AdamChunkUpdate {
  AdamChunk chunk;
  ChunkLocation location = ChunkLocation::kHost;
};
struct HybridAdamOptions {
  gpu::Stream stream;  // used when some chunk is on the device
  // Wait for the device updates before returning (otherwise the caller synchronizes `stream`).
  bool synchronize = true;
};
// Counts of chunks and elements each side updated (for reports and tests).
struct HybridAdamReport {
  int64_t host_chunks = 0;
  int64_t host_elements = 0;
  int64_t device_chunks = 0;
  int64_t device_elements = 0;
};
absl::StatusOr<HybridAdamReport> HybridAdamStep(absl::Span<const AdamChunkUpdate> updates,
                                                const AdamHyperParams& params,
                                                const HybridAdamOptions& options);

}  // namespace ps::kernels
