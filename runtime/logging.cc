#include "runtime/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "absl/strings/ascii.h"
#include "absl/synchronization/mutex.h"

namespace ps {
namespace {

LogLevel LevelFromEnvironment() {
  LogLevel level = LogLevel::kWarning;
  if (const char* text = std::getenv("PS_LOG_LEVEL")) ParseLogLevel(text, &level);
  return level;
}

std::atomic<int>& LevelStorage() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnvironment())};
  return level;
}

absl::Mutex sink_mutex;
LogSink& Sink() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sink_mutex) {
  static auto* sink = new LogSink();
  return *sink;
}

}  // namespace

LogLevel GetLogLevel() { return static_cast<LogLevel>(LevelStorage().load()); }
void SetLogLevel(LogLevel level) { LevelStorage().store(static_cast<int>(level)); }

bool ParseLogLevel(absl::string_view text, LogLevel* level) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (lower == "debug")
    *level = LogLevel::kDebug;
  else if (lower == "info")
    *level = LogLevel::kInfo;
  else if (lower == "warning" || lower == "warn")
    *level = LogLevel::kWarning;
  else if (lower == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "?";
}

void SetLogSink(LogSink sink) {
  absl::MutexLock lock(&sink_mutex);
  Sink() = std::move(sink);
}

void LogMessage(LogLevel level, const char* file, int line, absl::string_view message) {
  absl::string_view base(file);
  if (auto slash = base.rfind('/'); slash != absl::string_view::npos) base.remove_prefix(slash + 1);
  const std::string line_text =
      absl::StrFormat("[patrickstar %s %s:%d] %s", LogLevelName(level), base, line, message);
  absl::MutexLock lock(&sink_mutex);
  if (Sink()) {
    Sink()(level, line_text);
  } else {
    std::fprintf(stderr, "%s\n", line_text.c_str());
  }
}

}  // namespace ps
