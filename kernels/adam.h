// Fused Adam / AdamW updates of optimizer-state chunks, on the CPU (AVX-512 / AVX2 / scalar,
// chosen at run time, see kernels/simd.h) and on the GPU (CUDA builds), plus the hybrid
// dispatcher that updates device-resident chunks with the GPU kernel and host-resident ones with
// the CPU kernel at the same time.
//
// One pass per chunk reads the fp32 master param, the gradient (fp32, fp16 or bf16), momentum
// and variance, and writes param, momentum, variance and, when asked, the fp16/bf16 compute
// copy of the param. The arithmetic is torch.optim.Adam / AdamW (foreach=False) operation for
// operation; see Note [Adam arithmetic] in adam.cc.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
};

// InvalidArgument naming the field when a value is out of range (torch's checks, plus
// grad_scale > 0 and clip_coef >= 0, both finite).
absl::Status ValidateAdamHyperParams(const AdamHyperParams& params);
absl::Status ValidateAdamChunk(const AdamChunk& chunk);

// Updates `chunks` in place on the CPU with the kernel thread pool (kernels/parallel.h). The
// chunks are split into blocks that the pool's threads take in turn; results do not depend on
// the thread count or on the SIMD path (Note [Identical rounding on every path]).
absl::Status AdamUpdate(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params);
absl::Status AdamUpdate(const AdamChunk& chunk, const AdamHyperParams& params);

// The memory-traffic twin of AdamUpdate: exactly the same loads and stores (read param, grad,
// exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq and the copy when there is one), the
// same SIMD path, blocks and threads, but trivial arithmetic. Benchmarks time it as the
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
