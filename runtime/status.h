// Status helpers shared by every layer of the core.
//
// The core never throws: fallible calls return absl::Status / absl::StatusOr<T>, and callers add
// context as the error travels up. PS_CHECK is for programming errors (a broken invariant), and
// aborts with file:line; it is never used for bad input.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ps {

// Returns `status` with `context` prepended to its message ("context: message"), same code.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// Status from an errno value, mapping the codes a caller can act on (no space, permission,
// missing path) to distinct absl codes. `what` names the operation and its object. The errno is
// kept as a payload so the bindings can raise the matching OSError subclass.
absl::Status ErrnoToStatus(int errno_value, absl::string_view what);
inline constexpr char kErrnoPayloadUrl[] = "patrickstar/errno";
std::optional<int> StatusErrno(const absl::Status& status);

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);

}  // namespace ps

#define PS_STATUS_CONCAT_INNER_(a, b) a##b
#define PS_STATUS_CONCAT_(a, b) PS_STATUS_CONCAT_INNER_(a, b)

#define PS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status ps_status_ = (expr);      \
    if (!ps_status_.ok()) return ps_status_; \
  } while (false)

#define PS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

#define PS_ASSIGN_OR_RETURN(lhs, expr) \
  PS_ASSIGN_OR_RETURN_IMPL_(PS_STATUS_CONCAT_(ps_statusor_, __LINE__), lhs, expr)

// Aborts with file:line when `cond` is false; extra arguments are joined with absl::StrCat.
#define PS_CHECK(cond, ...)                                                                 \
  do {                                                                                      \
    if (!(cond)) ::ps::CheckFailed(__FILE__, __LINE__, #cond, ::absl::StrCat(__VA_ARGS__)); \
  } while (false)

#define PS_CHECK_OK(expr)                                                        \
  do {                                                                           \
    ::absl::Status ps_check_status_ = (expr);                                    \
    if (!ps_check_status_.ok())                                                  \
      ::ps::CheckFailed(__FILE__, __LINE__, #expr, ps_check_status_.ToString()); \
  } while (false)
