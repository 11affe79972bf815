// absl::Status -> Python exceptions (the only place the core's errors become exceptions).
//
//   ResourceExhausted            patrickstar.ChunkOutOfMemoryError (a MemoryError)
//   InvalidArgument              ValueError
//   NotFound                     FileNotFoundError
//   PermissionDenied             PermissionError
//   FailedPrecondition           RuntimeError
//   Unimplemented                NotImplementedError
//   OutOfRange                   IndexError
//   DataLoss, Internal, others   patrickstar.ChunkRuntimeError (a RuntimeError)
// A status carrying an errno payload (file and IO errors) becomes OSError(errno, message), which
// Python turns into the matching subclass (FileNotFoundError, PermissionError, ...).
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>

#include "absl/status/statusor.h"

namespace ps::bindings {

class StatusError : public std::runtime_error {
 public:
  explicit StatusError(absl::Status status)
      : std::runtime_error(std::string(status.message())), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return *std::move(result);
}

// Defines patrickstar._C.ChunkOutOfMemoryError / ChunkRuntimeError and the translator.
void RegisterStatusExceptions(pybind11::module_& module);

}  // namespace ps::bindings
