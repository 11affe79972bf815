// Python bindings of the update kernels (kernels/): casts, Adam/AdamW (CPU, GPU and hybrid),
// gradient statistics, SIMD-path and thread controls.
#include <torch/extension.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "bindings/chunk_views.h"
#include "bindings/init.h"
#include "bindings/status_exceptions.h"
#include "bindings/torch_dtype.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/grad_stats.h"
#include "kernels/parallel.h"
#include "kernels/quantization.h"
#include "kernels/simd.h"
#include "runtime/gpu.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

void CheckCpuContiguous(const at::Tensor& tensor, const char* name) {
  if (!tensor.device().is_cpu() || !tensor.is_contiguous()) {
    throw py::value_error(std::string(name) + " must be a contiguous CPU tensor");
  }
}

std::string Describe(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " on " + t.device().str() + " with " +
         std::to_string(t.numel()) + " elements";
}

// Checks one tensor argument of `fn`: defined, contiguous, on `device`, of an allowed dtype and
// with `numel` elements (when numel >= 0).
void CheckTensor(const char* fn, const char* name, const at::Tensor& t, const at::Device& device,
                 std::initializer_list<at::ScalarType> dtypes, int64_t numel,
                 const char* numel_of) {
  if (!t.defined()) throw py::value_error(std::string(fn) + ": " + name + " is undefined");
  bool dtype_ok = false;
  std::string expected;
  for (at::ScalarType type : dtypes) {
    dtype_ok |= t.scalar_type() == type;
    expected += (expected.empty() ? "" : " or ") + std::string(c10::toString(type));
  }
  if (!dtype_ok) {
    throw py::value_error(std::string(fn) + ": " + name + " must be " + expected + ", got " +
                          Describe(t));
  }
  if (t.device() != device) {
    throw py::value_error(std::string(fn) + ": " + name + " is on " + t.device().str() +
                          " but param is on " + device.str());
  }
  if (!device.is_cpu() && !device.is_cuda()) {
    throw py::value_error(std::string(fn) + ": " + name + " must be a CPU or CUDA tensor, got " +
                          Describe(t));
  }
  if (!t.is_contiguous()) {
    throw py::value_error(std::string(fn) + ": " + name + " must be contiguous (" + Describe(t) +
                          ")");
  }
  if (numel >= 0 && t.numel() != numel) {
    throw py::value_error(std::string(fn) + ": " + name + " has " + std::to_string(t.numel()) +
                          " elements but " + numel_of + " has " + std::to_string(numel));
  }
}

// The optional tensors of the low-precision variants (issue 21) of one chunk.
struct LowpTensors {
  std::optional<at::Tensor> param_compensation, exp_avg_scale, exp_avg_sq_scale;
  kernels::ParamRounding rounding = kernels::ParamRounding::kKahan;
  uint64_t rounding_seed = 0;
};

kernels::ParamRounding ParseRounding(const std::string& name) {
  if (name == "kahan") return kernels::ParamRounding::kKahan;
  if (name == "stochastic") return kernels::ParamRounding::kStochastic;
  throw py::value_error("param_rounding must be 'kahan' or 'stochastic', got '" + name + "'");
}

// The chunk's variant follows the tensors' dtypes: param float32 (fp32 master) or bfloat16 (no
// master; param_compensation, bfloat16, required); exp_avg/exp_avg_sq float32, bfloat16 or uint8
// (8-bit codes; exp_avg_scale/exp_avg_sq_scale, float32 with ceil(n / 2048) elements, required).
kernels::AdamChunk ChunkFromTensors(const char* fn, const at::Tensor& param, const at::Tensor& grad,
                                    const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                    const std::optional<at::Tensor>& param_copy,
                                    const LowpTensors& lowp = {}) {
  const at::Device device = param.device();
  CheckTensor(fn, "param", param, device, {at::kFloat, at::kBFloat16}, -1, "");
  const int64_t n = param.numel();
  CheckTensor(fn, "grad", grad, device, {at::kFloat, at::kHalf, at::kBFloat16}, n, "param");
  const at::ScalarType state_type = exp_avg.defined() ? exp_avg.scalar_type() : at::kFloat;
  if (state_type != at::kFloat && state_type != at::kBFloat16 && state_type != at::kByte) {
    throw py::value_error(std::string(fn) + ": exp_avg must be Float, got " + Describe(exp_avg) +
                          " (low-precision state: BFloat16, or Byte codes with scales)");
  }
  CheckTensor(fn, "exp_avg", exp_avg, device, {state_type}, n, "param");
  CheckTensor(fn, "exp_avg_sq", exp_avg_sq, device, {state_type}, n, "param");
  kernels::AdamChunk chunk;
  chunk.param = static_cast<float*>(param.data_ptr());
  chunk.param_dtype = DTypeFromTorch(param.scalar_type());
  chunk.grad = grad.data_ptr();
  chunk.grad_dtype = DTypeFromTorch(grad.scalar_type());
  chunk.exp_avg = static_cast<float*>(exp_avg.data_ptr());
  chunk.exp_avg_sq = static_cast<float*>(exp_avg_sq.data_ptr());
  chunk.count = n;
  if (param_copy.has_value()) {
    CheckTensor(fn, "param_copy", *param_copy, device, {at::kHalf, at::kBFloat16}, n, "param");
    chunk.param_copy = param_copy->data_ptr();
    chunk.copy_dtype = DTypeFromTorch(param_copy->scalar_type());
  }
  if (lowp.param_compensation.has_value()) {
    CheckTensor(fn, "param_compensation", *lowp.param_compensation, device, {at::kBFloat16}, n,
                "param");
    chunk.param_compensation = static_cast<uint16_t*>(lowp.param_compensation->data_ptr());
  }
  switch (exp_avg.scalar_type()) {
    case at::kBFloat16:
      chunk.state_dtype = kernels::StateDType::kBFloat16;
      break;
    case at::kByte:
      chunk.state_dtype = kernels::StateDType::kInt8;
      break;
    default:
      chunk.state_dtype = kernels::StateDType::kFloat32;
  }
  const int64_t blocks = kernels::NumQuantizationBlocks(n);
  if (lowp.exp_avg_scale.has_value()) {
    CheckTensor(fn, "exp_avg_scale", *lowp.exp_avg_scale, device, {at::kFloat}, blocks,
                "ceil(param / 2048)");
    chunk.exp_avg_scale = lowp.exp_avg_scale->data_ptr<float>();
  }
  if (lowp.exp_avg_sq_scale.has_value()) {
    CheckTensor(fn, "exp_avg_sq_scale", *lowp.exp_avg_sq_scale, device, {at::kFloat}, blocks,
                "ceil(param / 2048)");
    chunk.exp_avg_sq_scale = lowp.exp_avg_sq_scale->data_ptr<float>();
  }
  chunk.param_rounding = lowp.rounding;
  chunk.rounding_seed = lowp.rounding_seed;
  // Inconsistent combinations (a bf16 param without compensation, uint8 state without scales,
  // ...) are the kernel's InvalidArgument, raised as ValueError naming the field.
  ThrowIfError(kernels::ValidateAdamChunk(chunk));
  return chunk;
}

// One stream per device for the kernels launched from Python. Before a launch the caller runs
// torch.cuda.synchronize() (torch's pending work on the tensors must be done: this layer cannot
// see torch's CUDA streams in a CPU build of LibTorch), and waits for the stream after it.
gpu::Stream StreamFor(int device) {
  static absl::Mutex mutex;
  static auto* streams = new std::map<int, gpu::Stream>();
  absl::MutexLock lock(&mutex);
  auto it = streams->find(device);
  if (it == streams->end()) {
    it = streams->emplace(device, ValueOrThrow(gpu::CreateStream(device))).first;
  }
  return it->second;
}

void SynchronizeTorchCuda() { py::module_::import("torch").attr("cuda").attr("synchronize")(); }

kernels::AdamHyperParams HyperParams(double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step, bool adamw,
                                     bool bias_correction, double grad_scale, double clip_coef) {
  kernels::AdamHyperParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.step = step;
  hp.decoupled_weight_decay = adamw;
  hp.bias_correction = bias_correction;
  hp.grad_scale = grad_scale;
  hp.clip_coef = clip_coef;
  return hp;
}

// Updates the chunks described by parallel lists: CPU tensors by the CPU kernel, CUDA tensors by
// the GPU kernel, concurrently (kernels::HybridAdamStep). Returns the dispatch counts.
py::dict MultiAdam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::optional<std::vector<std::optional<at::Tensor>>>& param_copies,
                   const std::optional<std::vector<std::optional<at::Tensor>>>& param_compensations,
                   const std::optional<std::vector<std::optional<at::Tensor>>>& exp_avg_scales,
                   const std::optional<std::vector<std::optional<at::Tensor>>>& exp_avg_sq_scales,
                   kernels::ParamRounding rounding,
                   const std::optional<std::vector<uint64_t>>& rounding_seeds,
                   const kernels::AdamHyperParams& hp) {
  const size_t n = params.size();
  auto check_len = [n](size_t size, const char* name) {
    if (size != n) {
      throw py::value_error("multi_adam_: " + std::string(name) + " has " + std::to_string(size) +
                            " tensors but params has " + std::to_string(n));
    }
  };
  check_len(grads.size(), "grads");
  check_len(exp_avgs.size(), "exp_avgs");
  check_len(exp_avg_sqs.size(), "exp_avg_sqs");
  if (param_copies) check_len(param_copies->size(), "param_copies");
  if (param_compensations) check_len(param_compensations->size(), "param_compensations");
  if (exp_avg_scales) check_len(exp_avg_scales->size(), "exp_avg_scales");
  if (exp_avg_sq_scales) check_len(exp_avg_sq_scales->size(), "exp_avg_sq_scales");
  if (rounding_seeds) check_len(rounding_seeds->size(), "rounding_seeds");
  std::vector<kernels::AdamChunkUpdate> updates;
  int device = -1;
  for (size_t i = 0; i < n; ++i) {
    const std::string fn = "multi_adam_ (chunk " + std::to_string(i) + ")";
    kernels::AdamChunkUpdate update;
    LowpTensors lowp;
    if (param_compensations) lowp.param_compensation = (*param_compensations)[i];
    if (exp_avg_scales) lowp.exp_avg_scale = (*exp_avg_scales)[i];
    if (exp_avg_sq_scales) lowp.exp_avg_sq_scale = (*exp_avg_sq_scales)[i];
    if (params[i].scalar_type() == at::kBFloat16) lowp.rounding = rounding;
    if (rounding_seeds) lowp.rounding_seed = (*rounding_seeds)[i];
    update.chunk = ChunkFromTensors(fn.c_str(), params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                    param_copies ? (*param_copies)[i] : std::nullopt, lowp);
    if (params[i].device().is_cuda()) {
      if (device >= 0 && device != params[i].device().index()) {
        throw py::value_error(fn + ": all CUDA chunks must be on one device");
      }
      device = params[i].device().index();
      update.location = kernels::ChunkLocation::kDevice;
    }
    updates.push_back(update);
  }
  kernels::HybridAdamOptions options;
  if (device >= 0) {
    SynchronizeTorchCuda();
    options.stream = StreamFor(device);
  }
  absl::StatusOr<kernels::HybridAdamReport> report;
  {
    py::gil_scoped_release release;
    report = kernels::HybridAdamStep(updates, hp, options);
  }
  const kernels::HybridAdamReport r = ValueOrThrow(std::move(report));
  py::dict out;
  out["host_chunks"] = r.host_chunks;
  out["host_elements"] = r.host_elements;
  out["device_chunks"] = r.device_chunks;
  out["device_elements"] = r.device_elements;
  return out;
}

std::vector<kernels::GradChunk> GradChunks(const char* fn, const std::vector<at::Tensor>& grads,
                                           at::Device* device) {
  std::vector<kernels::GradChunk> chunks;
  for (size_t i = 0; i < grads.size(); ++i) {
    const std::string name = "grads[" + std::to_string(i) + "]";
    if (i == 0) *device = grads[0].device();
    CheckTensor(fn, name.c_str(), grads[i], *device, {at::kFloat, at::kHalf, at::kBFloat16}, -1,
                "");
    chunks.push_back(
        {grads[i].data_ptr(), DTypeFromTorch(grads[i].scalar_type()), grads[i].numel()});
  }
  return chunks;
}

kernels::GradStats GradStatsOf(const std::vector<at::Tensor>& grads) {
  at::Device device(at::kCPU);
  const std::vector<kernels::GradChunk> chunks = GradChunks("grad_stats", grads, &device);
  if (device.is_cpu()) {
    py::gil_scoped_release release;
    return ValueOrThrow(kernels::ComputeGradStats(chunks));
  }
  at::Tensor norm = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  at::Tensor overflow = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  SynchronizeTorchCuda();
  const gpu::Stream stream = StreamFor(device.index());
  {
    py::gil_scoped_release release;
    ThrowIfError(kernels::GradStatsOnDevice(chunks, norm.data_ptr<double>(),
                                            overflow.data_ptr<int32_t>(), stream));
    ThrowIfError(gpu::SynchronizeStream(stream));
  }
  return {norm.cpu().item<double>(), overflow.cpu().item<int32_t>() != 0};
}

}  // namespace

void InitKernels(py::module_& module) {
  py::module_ kernels = module.def_submodule("kernels", "Update and conversion kernels");
  kernels.def(
      "copy_",
      [](const at::Tensor& src, at::Tensor& dst) {
        CheckCpuContiguous(src, "src");
        CheckCpuContiguous(dst, "dst");
        if (src.scalar_type() != dst.scalar_type() || src.numel() != dst.numel()) {
          throw py::value_error("copy_: src is " + Describe(src) + " but dst is " + Describe(dst));
        }
        CopyOnCallingThread(src, dst);
      },
      py::arg("src"), py::arg("dst"),
      "Copies src into dst (CPU, contiguous, same dtype and size) on the calling thread "
      "(Note [Gradient copies on the calling thread] in chunk_views.h).");
  kernels.def(
      "cast_",
      [](const at::Tensor& src, at::Tensor& dst) {
        CheckCpuContiguous(src, "src");
        CheckCpuContiguous(dst, "dst");
        if (src.numel() != dst.numel()) {
          throw py::value_error("cast_: src has " + std::to_string(src.numel()) +
                                " elements but dst has " + std::to_string(dst.numel()));
        }
        const DType from = DTypeFromTorch(src.scalar_type());
        const DType to = DTypeFromTorch(dst.scalar_type());
        py::gil_scoped_release release;
        if (from == DType::kFloat32 && to != DType::kFloat32) {
          ThrowIfError(kernels::CastFloatTo16(
              src.data_ptr<float>(), static_cast<uint16_t*>(dst.data_ptr()), src.numel(), to));
        } else if (from != DType::kFloat32 && to == DType::kFloat32) {
          ThrowIfError(kernels::Cast16ToFloat(static_cast<const uint16_t*>(src.data_ptr()),
                                              dst.data_ptr<float>(), src.numel(), from));
        } else {
          throw std::invalid_argument("cast_ converts between float32 and a 16-bit dtype");
        }
      },
      py::arg("src"), py::arg("dst"),
      "Converts src into dst (float32 <-> float16/bfloat16, round to nearest even).");

  kernels.def(
      "adam_",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
         double weight_decay, int64_t step, bool adamw, bool bias_correction, double grad_scale,
         double clip_coef, const std::optional<at::Tensor>& param_copy,
         const std::optional<at::Tensor>& param_compensation,
         const std::optional<at::Tensor>& exp_avg_scale,
         const std::optional<at::Tensor>& exp_avg_sq_scale, const std::string& param_rounding,
         uint64_t rounding_seed, bool measure_grad) -> std::optional<double> {
        const kernels::AdamChunk chunk = ChunkFromTensors(
            "adam_", param, grad, exp_avg, exp_avg_sq, param_copy,
            {param_compensation, exp_avg_scale, exp_avg_sq_scale, ParseRounding(param_rounding),
             rounding_seed});
        const kernels::AdamHyperParams hp =
            HyperParams(lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction,
                        grad_scale, clip_coef);
        if (param.device().is_cpu()) {
          py::gil_scoped_release release;
          if (measure_grad) {
            return ValueOrThrow(kernels::AdamUpdateMeasuringGradients({chunk}, hp));
          }
          ThrowIfError(kernels::AdamUpdate(chunk, hp));
          return std::nullopt;
        }
        SynchronizeTorchCuda();
        const gpu::Stream stream = StreamFor(param.device().index());
        {
          py::gil_scoped_release release;
          ThrowIfError(kernels::AdamUpdateOnDevice({chunk}, hp, stream));
          ThrowIfError(gpu::SynchronizeStream(stream));
        }
        // A device's bandwidth makes the second read cheap; the GPU sum's order is its own.
        if (measure_grad) return GradStatsOf({grad}).squared_norm;
        return std::nullopt;
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::kw_only(),
      py::arg("lr"), py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
      py::arg("weight_decay") = 0.0, py::arg("step"), py::arg("adamw") = false,
      py::arg("bias_correction") = true, py::arg("grad_scale") = 1.0, py::arg("clip_coef") = 1.0,
      py::arg("param_copy") = py::none(), py::arg("param_compensation") = py::none(),
      py::arg("exp_avg_scale") = py::none(), py::arg("exp_avg_sq_scale") = py::none(),
      py::arg("param_rounding") = "kahan", py::arg("rounding_seed") = 0,
      py::arg("measure_grad") = false,
      "One fused Adam (adamw=False, L2 weight decay) or AdamW step of a chunk, in place. param: "
      "float32 (master) or bfloat16 (no master: Kahan-compensated with param_compensation, "
      "bfloat16, zero-initialized), or param_rounding='stochastic' (no compensation; random bits "
      "from rounding_seed, step and the element index); exp_avg, exp_avg_sq: float32, "
      "bfloat16, or uint8 codes of the blockwise 8-bit state with exp_avg_scale and "
      "exp_avg_sq_scale (float32, ceil(n / 2048) each); grad: float32/float16/bfloat16, "
      "divided by grad_scale and multiplied by clip_coef; step counts from 1; param_copy "
      "(float16/bfloat16) receives the updated fp32 param. CPU tensors use the CPU kernel, CUDA "
      "tensors the GPU kernel. measure_grad=True returns the squared L2 norm of grad as stored "
      "(grad_stats' sum, measured by the update's own pass), otherwise None.");

  kernels.def(
      "multi_adam_",
      [](const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
         double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
         bool adamw, bool bias_correction, double grad_scale, double clip_coef,
         const std::optional<std::vector<std::optional<at::Tensor>>>& param_copies,
         const std::optional<std::vector<std::optional<at::Tensor>>>& param_compensations,
         const std::optional<std::vector<std::optional<at::Tensor>>>& exp_avg_scales,
         const std::optional<std::vector<std::optional<at::Tensor>>>& exp_avg_sq_scales,
         const std::string& param_rounding,
         const std::optional<std::vector<uint64_t>>& rounding_seeds) {
        return MultiAdam(params, grads, exp_avgs, exp_avg_sqs, param_copies, param_compensations,
                         exp_avg_scales, exp_avg_sq_scales, ParseRounding(param_rounding),
                         rounding_seeds,
                         HyperParams(lr, beta1, beta2, eps, weight_decay, step, adamw,
                                     bias_correction, grad_scale, clip_coef));
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::kw_only(), py::arg("lr"), py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
      py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("step"),
      py::arg("adamw") = false, py::arg("bias_correction") = true, py::arg("grad_scale") = 1.0,
      py::arg("clip_coef") = 1.0, py::arg("param_copies") = py::none(),
      py::arg("param_compensations") = py::none(), py::arg("exp_avg_scales") = py::none(),
      py::arg("exp_avg_sq_scales") = py::none(), py::arg("param_rounding") = "kahan",
      py::arg("rounding_seeds") = py::none(),
      "adam_ over many chunks (hybrid Adam): CUDA chunks go to the GPU kernel and CPU chunks to "
      "the CPU kernel, run concurrently. Returns the counts each side updated. The lists "
      "param_copies, param_compensations, exp_avg_scales and exp_avg_sq_scales hold None where "
      "a chunk has no such tensor; param_rounding applies to the bfloat16 params, each with its "
      "seed from rounding_seeds (default 0).");

  kernels.def(
      "adam_traffic_bound_",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_copy,
         const std::optional<at::Tensor>& param_compensation,
         const std::optional<at::Tensor>& exp_avg_scale,
         const std::optional<at::Tensor>& exp_avg_sq_scale, const std::string& param_rounding) {
        const kernels::AdamChunk chunk = ChunkFromTensors(
            "adam_traffic_bound_", param, grad, exp_avg, exp_avg_sq, param_copy,
            {param_compensation, exp_avg_scale, exp_avg_sq_scale, ParseRounding(param_rounding)});
        if (!param.device().is_cpu()) throw py::value_error("adam_traffic_bound_: CPU only");
        py::gil_scoped_release release;
        ThrowIfError(kernels::AdamTrafficBound({chunk}));
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_copy") = py::none(), py::kw_only(),
      py::arg("param_compensation") = py::none(), py::arg("exp_avg_scale") = py::none(),
      py::arg("exp_avg_sq_scale") = py::none(), py::arg("param_rounding") = "kahan",
      "Benchmark bound: the loads and stores of adam_ (same dtypes and variant) with trivial "
      "arithmetic (overwrites the tensors with meaningless values).");

  auto map_of = [](bool is_signed) {
    return is_signed ? kernels::QuantizationMap::kSigned : kernels::QuantizationMap::kUnsigned;
  };
  kernels.attr("QUANTIZATION_BLOCK") = kernels::kQuantizationBlock;
  kernels.def(
      "quantization_map",
      [map_of](bool is_signed) {
        absl::Span<const float> codes = kernels::QuantizationCodes(map_of(is_signed));
        at::Tensor out = at::empty({256}, at::kFloat);
        std::copy(codes.begin(), codes.end(), out.data_ptr<float>());
        return out;
      },
      py::arg("signed"),
      "The 256 code values (ascending) of the dynamic map: signed (exp_avg) or unsigned "
      "(exp_avg_sq), as bitsandbytes' create_dynamic_map.");
  kernels.def(
      "quantize_blockwise_",
      [map_of](const at::Tensor& values, at::Tensor& codes, at::Tensor& scales, bool is_signed) {
        const at::Device cpu(at::kCPU);
        const char* fn = "quantize_blockwise_";
        CheckTensor(fn, "values", values, cpu, {at::kFloat}, -1, "");
        CheckTensor(fn, "codes", codes, cpu, {at::kByte}, values.numel(), "values");
        CheckTensor(fn, "scales", scales, cpu, {at::kFloat},
                    kernels::NumQuantizationBlocks(values.numel()), "ceil(values / 2048)");
        py::gil_scoped_release release;
        ThrowIfError(kernels::QuantizeBlockwise(values.data_ptr<float>(), values.numel(),
                                                map_of(is_signed), codes.data_ptr<uint8_t>(),
                                                scales.data_ptr<float>()));
      },
      py::arg("values"), py::arg("codes"), py::arg("scales"), py::kw_only(), py::arg("signed"),
      "Blockwise 8-bit quantization of float32 values (CPU) into uint8 codes and one float32 "
      "scale per 2048 elements, rounding to the nearest code (as the int8-state Adam kernel).");
  kernels.def(
      "dequantize_blockwise_",
      [map_of](const at::Tensor& codes, const at::Tensor& scales, at::Tensor& values,
               bool is_signed) {
        const at::Device cpu(at::kCPU);
        const char* fn = "dequantize_blockwise_";
        CheckTensor(fn, "codes", codes, cpu, {at::kByte}, -1, "");
        CheckTensor(fn, "scales", scales, cpu, {at::kFloat},
                    kernels::NumQuantizationBlocks(codes.numel()), "ceil(codes / 2048)");
        CheckTensor(fn, "values", values, cpu, {at::kFloat}, codes.numel(), "codes");
        py::gil_scoped_release release;
        ThrowIfError(kernels::DequantizeBlockwise(codes.data_ptr<uint8_t>(),
                                                  scales.data_ptr<float>(), codes.numel(),
                                                  map_of(is_signed), values.data_ptr<float>()));
      },
      py::arg("codes"), py::arg("scales"), py::arg("values"), py::kw_only(), py::arg("signed"),
      "values = map[codes] * scales[i // 2048] (CPU).");

  kernels.def(
      "grad_stats",
      [](const std::vector<at::Tensor>& grads) {
        const kernels::GradStats stats = GradStatsOf(grads);
        return py::make_tuple(stats.squared_norm, stats.has_inf_or_nan);
      },
      py::arg("grads"),
      "(squared L2 norm in float64, has inf or NaN) over a list of gradient tensors.");
  kernels.def(
      "has_inf_or_nan",
      [](const std::vector<at::Tensor>& grads) {
        at::Device device(at::kCPU);
        const std::vector<kernels::GradChunk> chunks = GradChunks("has_inf_or_nan", grads, &device);
        if (!device.is_cpu()) return GradStatsOf(grads).has_inf_or_nan;
        py::gil_scoped_release release;
        return ValueOrThrow(kernels::HasInfOrNan(chunks));
      },
      py::arg("grads"), "True when some element of the gradient tensors is inf or NaN.");
  kernels.def(
      "squared_l2_norm",
      [](const std::vector<at::Tensor>& grads) { return GradStatsOf(grads).squared_norm; },
      py::arg("grads"), "Sum of squares (float64) of the gradient tensors.");

  kernels.def(
      "set_simd",
      [](const std::optional<std::string>& level) {
        if (!level.has_value()) {
          kernels::ClearForcedSimdLevel();
          return;
        }
        ThrowIfError(kernels::ForceSimdLevel(ValueOrThrow(kernels::ParseSimdLevel(*level))));
      },
      py::arg("level"),
      "Forces the CPU kernels' SIMD path ('scalar', 'avx2', 'avx512', 'avx512bf16'); None goes "
      "back to PS_ADAM_SIMD or the best the CPU supports.");
  kernels.def(
      "simd", [] { return std::string(kernels::SimdLevelName(kernels::ActiveSimdLevel())); },
      "The SIMD path the CPU kernels use now.");
  kernels.def(
      "supported_simd",
      [] {
        std::vector<std::string> names;
        for (kernels::SimdLevel level : kernels::SupportedSimdLevels()) {
          names.emplace_back(kernels::SimdLevelName(level));
        }
        return names;
      },
      "The SIMD paths this CPU can run, lowest first.");
  kernels.def("set_num_threads", &kernels::SetKernelThreads, py::arg("threads"),
              "Threads of the CPU kernels (<= 0: the cores this process may use).");
  kernels.def("num_threads", &kernels::KernelThreads);
}

}  // namespace ps::bindings
