#include "runtime/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"

namespace ps {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  absl::Status annotated(status.code(), absl::StrCat(context, ": ", status.message()));
  // Payloads (the errno) travel with the error, so Python still raises the right OSError.
  status.ForEachPayload([&annotated](absl::string_view url, const absl::Cord& payload) {
    annotated.SetPayload(url, payload);
  });
  return annotated;
}

namespace {
absl::Status ErrnoCodeToStatus(int errno_value, const std::string& message);
}  // namespace

absl::Status ErrnoToStatus(int errno_value, absl::string_view what) {
  std::string message =
      absl::StrCat(what, ": ", std::strerror(errno_value), " (errno ", errno_value, ")");
  absl::Status status = ErrnoCodeToStatus(errno_value, message);
  status.SetPayload(kErrnoPayloadUrl, absl::Cord(absl::StrCat(errno_value)));
  return status;
}

namespace {
absl::Status ErrnoCodeToStatus(int errno_value, const std::string& message) {
  switch (errno_value) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EINVAL:
      return absl::InvalidArgumentError(message);
    case EIO:
      return absl::DataLossError(message);
    case ENOSYS:
    case EOPNOTSUPP:
      return absl::UnimplementedError(message);
    default:
      return absl::InternalError(message);
  }
}
}  // namespace

std::optional<int> StatusErrno(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kErrnoPayloadUrl);
  int value = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &value)) return std::nullopt;
  return value;
}

void CheckFailed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "PS_CHECK failed at %s:%d: %s%s%s\n", file, line, condition,
               message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace ps
