// A small leveled logger: one line per message to stderr (or an installed sink), with level,
// time and source location. The level comes from PS_LOG_LEVEL (debug, info, warning, error;
// default warning) or SetLogLevel().
#pragma once

#include <functional>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace ps {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

LogLevel GetLogLevel();
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warning", "error" (case-insensitive); false if unknown.
bool ParseLogLevel(absl::string_view text, LogLevel* level);
absl::string_view LogLevelName(LogLevel level);

// Where messages go; the default writes to stderr. Passing nullptr restores the default.
using LogSink = std::function<void(LogLevel, absl::string_view message)>;
void SetLogSink(LogSink sink);

void LogMessage(LogLevel level, const char* file, int line, absl::string_view message);

}  // namespace ps

#define PS_LOG(level, ...)                                                                         \
  do {                                                                                             \
    if (::ps::LogLevel::level >= ::ps::GetLogLevel())                                              \
      ::ps::LogMessage(::ps::LogLevel::level, __FILE__, __LINE__, ::absl::StrFormat(__VA_ARGS__)); \
  } while (false)
