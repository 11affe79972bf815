// Python bindings of the update kernels (kernels/).
#include <torch/extension.h>

#include "bindings/init.h"
#include "bindings/status_exceptions.h"
#include "kernels/cast.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

DType DTypeFromTorch(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      throw py::value_error(std::string("unsupported dtype ") + c10::toString(type) +
                            ": expected float32, float16 or bfloat16");
  }
}

void CheckCpuContiguous(const at::Tensor& tensor, const char* name) {
  if (!tensor.device().is_cpu() || !tensor.is_contiguous()) {
    throw py::value_error(std::string(name) + " must be a contiguous CPU tensor");
  }
}

}  // namespace

void InitKernels(py::module_& module) {
  py::module_ kernels = module.def_submodule("kernels", "Update and conversion kernels");
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
          ThrowIfError(kernels::CastFloatTo16(src.data_ptr<float>(),
                                              static_cast<uint16_t*>(dst.data_ptr()),
                                              src.numel(), to));
        } else if (from != DType::kFloat32 && to == DType::kFloat32) {
          ThrowIfError(kernels::Cast16ToFloat(static_cast<const uint16_t*>(src.data_ptr()),
                                              dst.data_ptr<float>(), src.numel(), from));
        } else {
          throw std::invalid_argument("cast_ converts between float32 and a 16-bit dtype");
        }
      },
      py::arg("src"), py::arg("dst"),
      "Converts src into dst (float32 <-> float16/bfloat16, round to nearest even).");
}

}  // namespace ps::bindings
