// The device kernels on the strict emulated device (kernels/internal/strict_kernels.h).
#include "kernels/internal/strict_kernels.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cast.h"
#include "kernels/quantization.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/strict_device.h"

namespace ps::kernels::strict {
namespace {

template <typename T>
T* Reach(T* pointer) {
  return static_cast<T*>(gpu::WorkPointer(pointer));
}

// Errors a kernel meets while it runs are asynchronous on a GPU: logged here, as the caller
// validated everything it could before the launch.
void LogIfError(const absl::Status& status, const char* kernel) {
  if (!status.ok())
    PS_LOG(kError, "strict device: kernel %s failed: %s", kernel, status.ToString());
}

std::vector<gpu::strict::MemoryRange> Ranges(absl::Span<const GradChunk> chunks) {
  std::vector<gpu::strict::MemoryRange> ranges;
  for (const GradChunk& chunk : chunks) {
    ranges.push_back({chunk.data, chunk.count * ElementSize(chunk.dtype)});
  }
  return ranges;
}

std::vector<GradChunk> Reached(absl::Span<const GradChunk> chunks) {
  std::vector<GradChunk> reached(chunks.begin(), chunks.end());
  for (GradChunk& chunk : reached) chunk.data = Reach(chunk.data);
  return reached;
}

}  // namespace

absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params,
                                gpu::Stream stream) {
  PS_RETURN_IF_ERROR(ValidateAdamHyperParams(params));
  std::vector<AdamChunk> launched(chunks.begin(), chunks.end());
  std::vector<gpu::strict::MemoryRange> touched;
  for (size_t i = 0; i < launched.size(); ++i) {
    const AdamChunk& c = launched[i];
    PS_RETURN_IF_ERROR(Annotate(ValidateAdamChunk(c), absl::StrCat("device chunk ", i)));
    const int64_t state_bytes = c.count * StateElementSize(c.state_dtype);
    touched.push_back({c.param, c.count * ElementSize(c.param_dtype)});
    touched.push_back({c.exp_avg, state_bytes});
    touched.push_back({c.exp_avg_sq, state_bytes});
    touched.push_back({c.grad, c.count * ElementSize(c.grad_dtype)});
    if (c.param_copy != nullptr) touched.push_back({c.param_copy, c.count * 2});
    if (c.param_compensation != nullptr) touched.push_back({c.param_compensation, c.count * 2});
    if (c.state_dtype == StateDType::kInt8) {
      const int64_t scale_bytes = NumQuantizationBlocks(c.count) * int64_t{sizeof(float)};
      touched.push_back({c.exp_avg_scale, scale_bytes});
      touched.push_back({c.exp_avg_sq_scale, scale_bytes});
    }
  }
  return gpu::strict::LaunchWork(stream, std::move(touched), [launched, params]() mutable {
    for (AdamChunk& c : launched) {
      c.param = Reach(c.param);
      c.grad = Reach(c.grad);
      c.exp_avg = Reach(c.exp_avg);
      c.exp_avg_sq = Reach(c.exp_avg_sq);
      if (c.param_copy != nullptr) c.param_copy = Reach(c.param_copy);
      if (c.param_compensation != nullptr) c.param_compensation = Reach(c.param_compensation);
      if (c.exp_avg_scale != nullptr) c.exp_avg_scale = Reach(c.exp_avg_scale);
      if (c.exp_avg_sq_scale != nullptr) c.exp_avg_sq_scale = Reach(c.exp_avg_sq_scale);
    }
    LogIfError(AdamUpdate(launched, params), "AdamUpdateOnDevice");
  });
}

absl::Status GradStatsOnDevice(absl::Span<const GradChunk> chunks, double* device_squared_norm,
                               int32_t* device_overflow, gpu::Stream stream) {
  std::vector<gpu::strict::MemoryRange> touched = Ranges(chunks);
  if (device_squared_norm != nullptr) touched.push_back({device_squared_norm, sizeof(double)});
  if (device_overflow != nullptr) touched.push_back({device_overflow, sizeof(int32_t)});
  return gpu::strict::LaunchWork(stream, std::move(touched),
                                 [reached = Reached(chunks), device_squared_norm, device_overflow] {
                                   absl::StatusOr<GradStats> stats = ComputeGradStats(reached);
                                   if (!stats.ok())
                                     return LogIfError(stats.status(), "GradStatsOnDevice");
                                   if (device_squared_norm != nullptr)
                                     *Reach(device_squared_norm) += stats->squared_norm;
                                   if (device_overflow != nullptr && stats->has_inf_or_nan)
                                     *Reach(device_overflow) = 1;
                                 });
}

absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk> chunks, float multiplier,
                                int32_t* device_overflow, gpu::Stream stream) {
  std::vector<gpu::strict::MemoryRange> touched = Ranges(chunks);
  if (device_overflow != nullptr) touched.push_back({device_overflow, sizeof(int32_t)});
  return gpu::strict::LaunchWork(
      stream, std::move(touched), [reached = Reached(chunks), multiplier, device_overflow] {
        bool overflow = false;
        for (const GradChunk& chunk : reached) {
          std::vector<float> values(static_cast<size_t>(chunk.count));
          if (chunk.dtype == DType::kFloat32) {
            std::copy_n(static_cast<const float*>(chunk.data), chunk.count, values.data());
          } else {
            LogIfError(Cast16ToFloat(static_cast<const uint16_t*>(chunk.data), values.data(),
                                     chunk.count, chunk.dtype),
                       "ScaleGradsOnDevice");
          }
          for (float& v : values) {
            overflow |= !std::isfinite(v);
            v *= multiplier;
          }
          void* data = const_cast<void*>(chunk.data);
          if (chunk.dtype == DType::kFloat32) {
            std::copy_n(values.data(), chunk.count, static_cast<float*>(data));
          } else {  // an element that rounds to inf in 16 bits "becomes inf" too
            auto* bits = static_cast<uint16_t*>(data);
            LogIfError(CastFloatTo16(values.data(), bits, chunk.count, chunk.dtype),
                       "ScaleGradsOnDevice");
            LogIfError(Cast16ToFloat(bits, values.data(), chunk.count, chunk.dtype),
                       "ScaleGradsOnDevice");
          }
          for (float v : values) overflow |= !std::isfinite(v);
        }
        if (device_overflow != nullptr && overflow) *Reach(device_overflow) = 1;
      });
}

namespace {

// A cast between float32 and the 16-bit `half` (fp16 or bf16) as a kernel on `stream`.
template <typename From, typename To>
absl::Status LaunchCast(const From* src, To* dst, int64_t count, DType half, gpu::Stream stream,
                        absl::Status (*cast)(const From*, To*, int64_t, DType),
                        const char* kernel) {
  if (half == DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(kernel, ": the 16-bit side is float32"));
  }
  if (count == 0) return absl::OkStatus();
  return gpu::strict::LaunchWork(
      stream, {{src, count * int64_t{sizeof(From)}}, {dst, count * int64_t{sizeof(To)}}},
      [src, dst, count, half, cast, kernel] {
        LogIfError(cast(Reach(src), Reach(dst), count, half), kernel);
      });
}

}  // namespace

absl::Status CastFloatTo16OnDevice(const float* src, uint16_t* dst, int64_t count, DType dst_dtype,
                                   gpu::Stream stream) {
  return LaunchCast(src, dst, count, dst_dtype, stream, &CastFloatTo16, "CastFloatTo16OnDevice");
}

absl::Status Cast16ToFloatOnDevice(const uint16_t* src, float* dst, int64_t count, DType src_dtype,
                                   gpu::Stream stream) {
  return LaunchCast(src, dst, count, src_dtype, stream, &Cast16ToFloat, "Cast16ToFloatOnDevice");
}

}  // namespace ps::kernels::strict
