// Minimal thread-safe logging to stderr: one line per message, with time, level, file and line.
//
//   GT_LOG(INFO) << "worker " << id << " joined site " << site;
//
// Debian 12's Abseil (20220623) predates absl/log, so geotrain carries this small logger.
#pragma once

#include <sstream>
#include <string_view>

namespace geotrain {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Set from GEOTRAIN_LOG_LEVEL (debug|info|warning|error).
LogLevel MinLogLevel();
void SetMinLogLevel(LogLevel level);
// A short name for this process written in every line ("head", "worker w-1"); defaults to "geotrain".
void SetLogProcessName(std::string_view name);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns GT_LOG's streamed message into void, so that both arms of its `?:` have one type.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace geotrain

#define GT_LOG_LEVEL_DEBUG ::geotrain::LogLevel::kDebug
#define GT_LOG_LEVEL_INFO ::geotrain::LogLevel::kInfo
#define GT_LOG_LEVEL_WARNING ::geotrain::LogLevel::kWarning
#define GT_LOG_LEVEL_ERROR ::geotrain::LogLevel::kError
// One expression, not an `if`/`else`, which under a caller's unbraced `if` reads as an ambiguous `else`
// (-Wdangling-else).
// LogVoidify's `&` binds looser than `<<`, so the whole message is streamed first; the message is written when
// the LogMessage temporary dies, at the end of the statement.
#define GT_LOG(level)                                \
  (GT_LOG_LEVEL_##level < ::geotrain::MinLogLevel()) \
      ? (void)0                                      \
      : ::geotrain::LogVoidify() & ::geotrain::LogMessage(GT_LOG_LEVEL_##level, __FILE__, __LINE__).stream()
