// The GPU update kernels: fused multi-chunk Adam/AdamW on fp32 master params with the fp16/bf16
// compute-copy write-back, gradient scaling, and the overflow/norm reduction.
//
// Note [Multi-chunk launches]
// Up to kMaxChunksPerLaunch chunks go into one launch as a table passed by value in the kernel's
// parameter space (under the 4 KiB limit), with each chunk's first tile. A block walks tiles
// with a grid stride and finds its chunk by binary search over the table, so one launch covers
// chunks of any sizes without a device-side descriptor copy. The table is a __grid_constant__
// parameter: indexing it by a run-time chunk number then reads the parameter bank instead of
// making each thread copy 3 KiB of it to local memory. The arithmetic uses __f*_rn
// intrinsics, which nvcc never contracts, in the order of Note [Adam arithmetic] (adam.cc), so
// the device results equal the CPU kernels' bit for bit (outside NaN payloads).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <mutex>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/adam.h"
#include "kernels/grad_stats.h"
#include "kernels/internal/cpu_paths.h"
#include "kernels/internal/strict_kernels.h"
#include "kernels/quantization.h"
#include "runtime/status.h"

namespace ps::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTileElements = kThreads * 8;
constexpr int kMaxChunksPerLaunch = 48;
constexpr int64_t kMaxBlocks = 16384;

enum : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kNoCopy = 3 };

int32_t DtypeCode(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return kF32;
    case DType::kFloat16:
      return kF16;
    case DType::kBFloat16:
      return kBF16;
  }
  return kF32;
}

struct DeviceAdamChunk {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int64_t count;
  int32_t grad_dtype;
  int32_t copy_dtype;  // kF16, kBF16 or kNoCopy
};

struct DeviceGradChunk {
  void* data;
  int64_t count;
  int32_t dtype;
};

// A chunk of the low-precision kernel (Note [Low-precision Adam] in adam.cc).
struct DeviceLowpChunk {
  void* param;  // float, or bf16 when param_bf16
  unsigned short* compensation;
  const void* grad;
  void* exp_avg;  // float, bf16 or codes by `state`
  void* exp_avg_sq;
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
  void* copy;
  int64_t count;
  int32_t grad_dtype;
  int32_t copy_dtype;  // kF16, kBF16 or kNoCopy
  int32_t param_mode;  // kParamF32, kParamKahan or kParamStochastic
  int32_t state;       // StateDType
  uint32_t rounding_key;  // internal::RoundingKey(rounding_seed, step) for kParamStochastic
};

// Chunks per launch table: fewer of the larger low-precision entries fit in 4 KiB.
template <typename Entry>
constexpr int kTableCapacity = kMaxChunksPerLaunch;
template <>
constexpr int kTableCapacity<DeviceLowpChunk> = 32;

template <typename Entry>
struct ChunkTable {
  Entry chunks[kTableCapacity<Entry>];
  int64_t first_tile[kTableCapacity<Entry> + 1];
  int32_t num_chunks;
};
static_assert(sizeof(ChunkTable<DeviceAdamChunk>) + sizeof(internal::AdamConstants) < 4000,
              "kernel parameters are limited to 4 KiB");
static_assert(sizeof(ChunkTable<DeviceLowpChunk>) + sizeof(internal::AdamConstants) < 4000,
              "kernel parameters are limited to 4 KiB");

// The last chunk of `table` whose first tile <= tile.
template <typename Entry>
__device__ __forceinline__ int ChunkOfTile(const ChunkTable<Entry>& table, int64_t tile) {
  int lo = 0, hi = table.num_chunks - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_tile[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Calls fn(entry, i) for every element of every chunk of `table`, one tile per block at a time.
template <typename Entry, typename Fn>
__device__ __forceinline__ void ForEachElement(const ChunkTable<Entry>& table, Fn fn) {
  const int64_t total_tiles = table.first_tile[table.num_chunks];
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const int lo = ChunkOfTile(table, tile);
    const Entry& entry = table.chunks[lo];
    const int64_t begin = (tile - table.first_tile[lo]) * kTileElements;
    const int64_t end = min(entry.count, begin + kTileElements);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) fn(entry, i);
  }
}

__device__ __forceinline__ float LoadAsFloat(const void* data, int64_t i, int32_t dtype) {
  if (dtype == kF32) return static_cast<const float*>(data)[i];
  const unsigned short bits = static_cast<const unsigned short*>(data)[i];
  if (dtype == kF16) return __half2float(__ushort_as_half(bits));
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

__device__ __forceinline__ void StoreFromFloat(void* data, int64_t i, int32_t dtype, float x) {
  if (dtype == kF32) {
    static_cast<float*>(data)[i] = x;
  } else if (dtype == kF16) {
    static_cast<unsigned short*>(data)[i] = __half_as_ushort(__float2half_rn(x));
  } else {
    static_cast<unsigned short*>(data)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
}

// Note [Adam arithmetic] in adam.cc, as AdamMath in kernels/internal/cpu_body.inc; with
// inverse_bc2 (int8 state) sqrt(v) times the inverse instead of divided (Note [One division fewer
// for int8 state]).
__device__ __forceinline__ void AdamMath(const internal::AdamConstants& k, float& p, float g,
                                         float& m, float& v, bool inverse_bc2 = false) {
  if (k.l2) g = __fmaf_rn(p, k.l2_decay, g);
  if (k.decoupled) p = __fmul_rn(p, k.param_decay);
  m = __fmaf_rn(k.lerp_coeff, __fsub_rn(g, m), k.lerp_from_grad ? g : m);
  v = __fmaf_rn(__fmul_rn(k.one_minus_beta2, g), g, __fmul_rn(v, k.beta2));
  const float root = __fsqrt_rn(v);
  const float denom = __fadd_rn(inverse_bc2 ? __fmul_rn(root, k.inverse_bias_correction2_sqrt)
                                            : __fdiv_rn(root, k.bias_correction2_sqrt),
                                k.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(k.neg_step_size, m), denom));
}

__global__ void __launch_bounds__(kThreads)
    AdamKernel(const __grid_constant__ ChunkTable<DeviceAdamChunk> table,
               const internal::AdamConstants k) {
  ForEachElement(table, [&k](const DeviceAdamChunk& c, int64_t i) {
    float p = c.param[i];
    const float g = __fmul_rn(LoadAsFloat(c.grad, i, c.grad_dtype), k.grad_mul);
    float m = c.exp_avg[i];
    float v = c.exp_avg_sq[i];
    AdamMath(k, p, g, m, v);
    c.param[i] = p;
    c.exp_avg[i] = m;
    c.exp_avg_sq[i] = v;
    if (c.copy_dtype != kNoCopy) StoreFromFloat(c.copy, i, c.copy_dtype, p);
  });
}

// ---- Low-precision params and state (Note [Low-precision Adam], Note [Blockwise quantization])

constexpr int32_t kStateF32 = static_cast<int32_t>(StateDType::kFloat32);
constexpr int32_t kStateBf16 = static_cast<int32_t>(StateDType::kBFloat16);
constexpr int32_t kStateInt8 = static_cast<int32_t>(StateDType::kInt8);
constexpr int32_t kParamF32 = 0, kParamKahan = 1, kParamStochastic = 2;
constexpr int kPerThread = kTileElements / kThreads;
static_assert(kTileElements == kQuantizationBlock,
              "one tile is one quantization block: its block reduces the tile's absmax");

// The quantization tables (kernels/quantization.h) of the signed [0] and unsigned [1] maps,
// uploaded once per device by UploadQuantizationTables.
struct DeviceQuantizationTables {
  float code[2][256];
  uint32_t bucket[2][internal::kBuckets];
};
__device__ DeviceQuantizationTables g_quantization;

__device__ __forceinline__ float Bf16ToFloat(unsigned short bits) {
  return __bfloat162float(__ushort_as_bfloat16(bits));
}
__device__ __forceinline__ unsigned short FloatToBf16(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// `map`: 0 signed (exp_avg), 1 unsigned (exp_avg_sq).
__device__ __forceinline__ float LoadState(const void* data, int64_t i, int32_t state, int map,
                                           float scale) {
  if (state == kStateF32) return static_cast<const float*>(data)[i];
  if (state == kStateBf16) return Bf16ToFloat(static_cast<const unsigned short*>(data)[i]);
  const unsigned char q = static_cast<const unsigned char*>(data)[i];
  return __fmul_rn(g_quantization.code[map][q], scale);
}

// internal::QuantizeWithTables (Note [Nearest code by bucket] in quantization.cc).
__device__ __forceinline__ unsigned char Quantize(int map, float x) {
  int32_t bits = __float_as_int(x);
  int32_t sign = 0;
  if (map == 0) {
    sign = bits >> 31;
    bits &= 0x7fffffff;
  } else if (bits < 0) {
    bits = 0;
  }
  const int32_t bucket =
      min(max((bits >> 16) - (internal::kBucketMinExponent << 7), 0), internal::kBuckets - 1);
  const uint32_t entry = __ldg(&g_quantization.bucket[map][bucket]);
  int32_t q = static_cast<int32_t>(entry & 0xff) +
              ((bits & 0xffff) > static_cast<int32_t>(entry >> 16) ? 1 : 0);
  q = (q ^ sign) + (sign & 255);
  return static_cast<unsigned char>(q < 0 ? 0 : q);
}

// Block-wide max of `value`, returned to every thread (integer max: order-free).
__device__ int32_t BlockMax(int32_t value) {
  __shared__ int32_t warp_max[kThreads / 32];
  value = __reduce_max_sync(0xffffffffu, value);
  __syncthreads();  // the previous call's readers are done with warp_max
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = value;
  __syncthreads();
  int32_t total = warp_max[0];
  for (int w = 1; w < kThreads / 32; ++w) total = max(total, warp_max[w]);
  return total;
}

// One tile (= one quantization block) per block at a time; each thread keeps its kPerThread
// elements' new moments in registers until the block's scale is known.
__global__ void __launch_bounds__(kThreads)
    AdamLowpKernel(const __grid_constant__ ChunkTable<DeviceLowpChunk> table,
                   const internal::AdamConstants k) {
  const int64_t total_tiles = table.first_tile[table.num_chunks];
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const int chunk = ChunkOfTile(table, tile);
    const DeviceLowpChunk& c = table.chunks[chunk];
    const int64_t block = tile - table.first_tile[chunk];
    const int64_t begin = block * kTileElements;
    const int64_t end = min(c.count, begin + kTileElements);
    const bool int8 = c.state == kStateInt8;
    const float m_scale = int8 ? c.exp_avg_scale[block] : 0.0f;
    const float v_scale = int8 ? c.exp_avg_sq_scale[block] : 0.0f;
    float ms[kPerThread], vs[kPerThread];
    int32_t m_max = __float_as_int(FLT_MIN), v_max = __float_as_int(FLT_MIN);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = begin + threadIdx.x + j * kThreads;
      ms[j] = vs[j] = 0.0f;
      if (i >= end) continue;
      const float g = __fmul_rn(LoadAsFloat(c.grad, i, c.grad_dtype), k.grad_mul);
      float m = LoadState(c.exp_avg, i, c.state, 0, m_scale);
      float v = LoadState(c.exp_avg_sq, i, c.state, 1, v_scale);
      if (c.param_mode == kParamStochastic) {  // Note [Stochastic rounding]
        unsigned short* param16 = static_cast<unsigned short*>(c.param);
        float q = Bf16ToFloat(param16[i]);
        AdamMath(k, q, g, m, v, int8);
        const uint32_t random = internal::RoundingBits(c.rounding_key, static_cast<uint32_t>(i));
        param16[i] = isnan(q) ? FloatToBf16(q)
                              : static_cast<unsigned short>((__float_as_uint(q) + random) >> 16);
      } else if (c.param_mode == kParamKahan) {
        unsigned short* param16 = static_cast<unsigned short*>(c.param);
        const float p = Bf16ToFloat(param16[i]);
        float q = p;
        AdamMath(k, q, g, m, v, int8);
        const float change = __fadd_rn(__fsub_rn(q, p), Bf16ToFloat(c.compensation[i]));
        const unsigned short rounded = FloatToBf16(__fadd_rn(p, change));
        param16[i] = rounded;
        c.compensation[i] = FloatToBf16(__fsub_rn(change, __fsub_rn(Bf16ToFloat(rounded), p)));
      } else {
        float* param32 = static_cast<float*>(c.param);
        float p = param32[i];
        AdamMath(k, p, g, m, v, int8);
        param32[i] = p;
        if (c.copy_dtype != kNoCopy) StoreFromFloat(c.copy, i, c.copy_dtype, p);
      }
      if (c.state == kStateF32) {
        static_cast<float*>(c.exp_avg)[i] = m;
        static_cast<float*>(c.exp_avg_sq)[i] = v;
      } else if (c.state == kStateBf16) {
        static_cast<unsigned short*>(c.exp_avg)[i] = FloatToBf16(m);
        static_cast<unsigned short*>(c.exp_avg_sq)[i] = FloatToBf16(v);
      } else {
        ms[j] = m;
        vs[j] = v;
        m_max = max(m_max, __float_as_int(m) & 0x7fffffff);
        v_max = max(v_max, __float_as_int(v) & 0x7fffffff);
      }
    }
    if (!int8) continue;  // uniform over the block: the whole tile is one chunk
    m_max = BlockMax(m_max);
    v_max = BlockMax(v_max);
    const float new_m_scale = __int_as_float(m_max), new_v_scale = __int_as_float(v_max);
    if (threadIdx.x == 0) {
      c.exp_avg_scale[block] = new_m_scale;
      c.exp_avg_sq_scale[block] = new_v_scale;
    }
    const float m_inverse = __fdiv_rn(1.0f, new_m_scale);
    const float v_inverse = __fdiv_rn(1.0f, new_v_scale);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = begin + threadIdx.x + j * kThreads;
      if (i >= end) continue;
      static_cast<unsigned char*>(c.exp_avg)[i] = Quantize(0, __fmul_rn(ms[j], m_inverse));
      static_cast<unsigned char*>(c.exp_avg_sq)[i] = Quantize(1, __fmul_rn(vs[j], v_inverse));
    }
  }
}

// Block-wide sum of `value`, valid in thread 0 only.
__device__ double BlockSum(double value) {
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_sums[warp] = value;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  }
  return total;
}

__global__ void __launch_bounds__(kThreads)
    GradStatsKernel(const __grid_constant__ ChunkTable<DeviceGradChunk> table, double* squared_norm,
                    int32_t* overflow) {
  double sum = 0.0;
  int bad = 0;
  ForEachElement(table, [&](const DeviceGradChunk& c, int64_t i) {
    const float x = LoadAsFloat(c.data, i, c.dtype);
    sum += static_cast<double>(x) * static_cast<double>(x);
    bad |= !isfinite(x);
  });
  bad = __syncthreads_or(bad);
  const double block_sum = BlockSum(sum);
  if (threadIdx.x == 0) {
    if (squared_norm != nullptr) atomicAdd(squared_norm, block_sum);
    if (overflow != nullptr && bad) atomicOr(overflow, 1);
  }
}

__global__ void __launch_bounds__(kThreads)
    ScaleGradsKernel(const __grid_constant__ ChunkTable<DeviceGradChunk> table, float multiplier,
                     int32_t* overflow) {
  int bad = 0;
  ForEachElement(table, [&](const DeviceGradChunk& c, int64_t i) {
    const float x = __fmul_rn(LoadAsFloat(c.data, i, c.dtype), multiplier);
    StoreFromFloat(c.data, i, c.dtype, x);
    bad |= !isfinite(LoadAsFloat(c.data, i, c.dtype));
  });
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0 && overflow != nullptr && bad) atomicOr(overflow, 1);
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

absl::Status PrepareDevice(gpu::Stream stream, absl::string_view what) {
  if (gpu::DeviceCount() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": no usable GPU (", gpu::UnavailableReason(), ")"));
  }
  return CudaStatus(cudaSetDevice(stream.device), what);
}

// Splits `entries` (empty chunks dropped) into tables of kMaxChunksPerLaunch and calls
// launch(table, grid, stream) for each, on `stream`'s device.
template <typename Entry, typename Launch>
absl::Status LaunchTables(const std::vector<Entry>& entries, gpu::Stream stream,
                          absl::string_view what, const Launch& launch) {
  PS_RETURN_IF_ERROR(PrepareDevice(stream, what));
  auto s = static_cast<cudaStream_t>(stream.handle);
  ChunkTable<Entry> table;
  table.num_chunks = 0;
  table.first_tile[0] = 0;
  auto flush = [&]() -> absl::Status {
    if (table.num_chunks == 0) return absl::OkStatus();
    const int64_t tiles = table.first_tile[table.num_chunks];
    launch(table, static_cast<unsigned>(std::min(tiles, kMaxBlocks)), s);
    table.num_chunks = 0;
    return CudaStatus(cudaGetLastError(), what);
  };
  for (const Entry& entry : entries) {
    if (entry.count == 0) continue;
    const int n = table.num_chunks;
    table.chunks[n] = entry;
    table.first_tile[n + 1] =
        table.first_tile[n] + (entry.count + kTileElements - 1) / kTileElements;
    table.num_chunks = n + 1;
    if (table.num_chunks == kTableCapacity<Entry>) PS_RETURN_IF_ERROR(flush());
  }
  return flush();
}

// Copies the quantization tables to `device`'s g_quantization once per process.
absl::Status UploadQuantizationTables(int device) {
  static std::mutex mutex;
  static std::set<int>* uploaded = new std::set<int>();
  std::lock_guard<std::mutex> lock(mutex);
  if (uploaded->count(device) != 0) return absl::OkStatus();
  static const DeviceQuantizationTables* const host = [] {
    auto* t = new DeviceQuantizationTables();
    for (int map = 0; map < 2; ++map) {
      const internal::QuantizationTables& source = internal::GetQuantizationTables(
          map == 0 ? QuantizationMap::kSigned : QuantizationMap::kUnsigned);
      std::copy(source.code, source.code + 256, t->code[map]);
      std::copy(source.bucket, source.bucket + internal::kBuckets, t->bucket[map]);
    }
    return t;
  }();
  PS_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "AdamUpdateOnDevice"));
  PS_RETURN_IF_ERROR(CudaStatus(cudaMemcpyToSymbol(g_quantization, host, sizeof(*host)),
                                "AdamUpdateOnDevice: quantization tables"));
  uploaded->insert(device);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DeviceGradChunk>> GradEntries(absl::Span<const GradChunk> chunks) {
  std::vector<DeviceGradChunk> entries;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const GradChunk& c = chunks[i];
    if (c.count < 0 || (c.count > 0 && c.data == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient chunk ", i, ": bad count ", c.count, " or null data"));
    }
    // The gradient memory is written only by ScaleGradsOnDevice, whose contract says so.
    entries.push_back({const_cast<void*>(c.data), c.count, DtypeCode(c.dtype)});
  }
  return entries;
}

}  // namespace

absl::Status AdamUpdateOnDevice(absl::Span<const AdamChunk> chunks, const AdamHyperParams& params,
                                gpu::Stream stream) {
  if (gpu::StrictDevice()) return strict::AdamUpdateOnDevice(chunks, params, stream);
  PS_RETURN_IF_ERROR(ValidateAdamHyperParams(params));
  std::vector<DeviceAdamChunk> entries;
  std::vector<DeviceLowpChunk> lowp_entries;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const AdamChunk& c = chunks[i];
    PS_RETURN_IF_ERROR(Annotate(ValidateAdamChunk(c), absl::StrCat("device chunk ", i)));
    const int32_t copy = c.param_copy == nullptr ? kNoCopy : DtypeCode(c.copy_dtype);
    if (c.param_dtype == DType::kFloat32 && c.state_dtype == StateDType::kFloat32) {
      entries.push_back({c.param, c.grad, c.exp_avg, c.exp_avg_sq, c.param_copy, c.count,
                         DtypeCode(c.grad_dtype), copy});
    } else {
      lowp_entries.push_back({c.param, c.param_compensation, c.grad, c.exp_avg, c.exp_avg_sq,
                              c.exp_avg_scale, c.exp_avg_sq_scale, c.param_copy, c.count,
                              DtypeCode(c.grad_dtype), copy,
                              c.param_dtype == DType::kFloat32
                                  ? kParamF32
                                  : (c.param_rounding == ParamRounding::kStochastic
                                         ? kParamStochastic
                                         : kParamKahan),
                              static_cast<int32_t>(c.state_dtype),
                              internal::RoundingKey(c.rounding_seed, params.step)});
    }
  }
  const internal::AdamConstants k = internal::MakeAdamConstants(params);
  if (!entries.empty() || lowp_entries.empty()) {  // (no chunks: still checks for a device)
    PS_RETURN_IF_ERROR(LaunchTables(
        entries, stream, "AdamUpdateOnDevice",
        [&](const ChunkTable<DeviceAdamChunk>& table, unsigned grid, cudaStream_t s) {
          AdamKernel<<<grid, kThreads, 0, s>>>(table, k);
        }));
  }
  if (lowp_entries.empty()) return absl::OkStatus();
  PS_RETURN_IF_ERROR(PrepareDevice(stream, "AdamUpdateOnDevice"));
  PS_RETURN_IF_ERROR(UploadQuantizationTables(stream.device));
  return LaunchTables(lowp_entries, stream, "AdamUpdateOnDevice",
                      [&](const ChunkTable<DeviceLowpChunk>& table, unsigned grid, cudaStream_t s) {
                        AdamLowpKernel<<<grid, kThreads, 0, s>>>(table, k);
                      });
}

absl::Status GradStatsOnDevice(absl::Span<const GradChunk> chunks, double* device_squared_norm,
                               int32_t* device_overflow, gpu::Stream stream) {
  if (gpu::StrictDevice()) {
    return strict::GradStatsOnDevice(chunks, device_squared_norm, device_overflow, stream);
  }
  PS_ASSIGN_OR_RETURN(std::vector<DeviceGradChunk> entries, GradEntries(chunks));
  return LaunchTables(entries, stream, "GradStatsOnDevice",
                      [&](const ChunkTable<DeviceGradChunk>& table, unsigned grid, cudaStream_t s) {
                        GradStatsKernel<<<grid, kThreads, 0, s>>>(table, device_squared_norm,
                                                                  device_overflow);
                      });
}

absl::Status ScaleGradsOnDevice(absl::Span<const GradChunk> chunks, float multiplier,
                                int32_t* device_overflow, gpu::Stream stream) {
  if (gpu::StrictDevice()) {
    return strict::ScaleGradsOnDevice(chunks, multiplier, device_overflow, stream);
  }
  PS_ASSIGN_OR_RETURN(std::vector<DeviceGradChunk> entries, GradEntries(chunks));
  return LaunchTables(entries, stream, "ScaleGradsOnDevice",
                      [&](const ChunkTable<DeviceGradChunk>& table, unsigned grid, cudaStream_t s) {
                        ScaleGradsKernel<<<grid, kThreads, 0, s>>>(table, multiplier,
                                                                   device_overflow);
                      });
}

}  // namespace ps::kernels
