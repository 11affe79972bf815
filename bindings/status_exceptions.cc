#include "bindings/status_exceptions.h"

#include "runtime/status.h"

namespace py = pybind11;

namespace ps::bindings {
namespace {

PyObject* chunk_out_of_memory_error = nullptr;
PyObject* chunk_runtime_error = nullptr;

PyObject* ExceptionFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kResourceExhausted:
      return chunk_out_of_memory_error;
    case absl::StatusCode::kInvalidArgument:
      return PyExc_ValueError;
    case absl::StatusCode::kNotFound:
      return PyExc_FileNotFoundError;
    case absl::StatusCode::kPermissionDenied:
      return PyExc_PermissionError;
    case absl::StatusCode::kFailedPrecondition:
      return PyExc_RuntimeError;
    case absl::StatusCode::kUnimplemented:
      return PyExc_NotImplementedError;
    case absl::StatusCode::kOutOfRange:
      return PyExc_IndexError;
    case absl::StatusCode::kDeadlineExceeded:  // a collective that did not finish in time
      return PyExc_TimeoutError;
    default:
      return chunk_runtime_error;
  }
}

}  // namespace

void RegisterStatusExceptions(py::module_& module) {
  static py::exception<StatusError> oom(module, "ChunkOutOfMemoryError", PyExc_MemoryError);
  static py::exception<StatusError> runtime(module, "ChunkRuntimeError", PyExc_RuntimeError);
  chunk_out_of_memory_error = oom.ptr();
  chunk_runtime_error = runtime.ptr();
  module.attr("ChunkOutOfMemoryError").attr("__doc__") =
      "Raised when a memory tier's budget cannot hold a request; the message names the sizes.";
  module.attr("ChunkRuntimeError").attr("__doc__") =
      "Raised for data loss and internal errors of the chunk runtime.";
  py::register_exception_translator([](std::exception_ptr pointer) {
    if (!pointer) return;
    try {
      std::rethrow_exception(pointer);
    } catch (const StatusError& error) {
      const absl::Status& status = error.status();
      const std::string message(status.message());
      if (std::optional<int> errno_value = StatusErrno(status)) {
        // OSError(errno, strerror-like message) picks the subclass from the errno.
        PyObject* args = Py_BuildValue("(is)", *errno_value, message.c_str());
        PyErr_SetObject(PyExc_OSError, args);
        Py_XDECREF(args);
        return;
      }
      PyErr_SetString(ExceptionFor(status.code()), message.c_str());
    }
  });
}

}  // namespace ps::bindings
