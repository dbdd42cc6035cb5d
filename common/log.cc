// Implementation of the stderr logger: lines are formatted in full, then written with one call.
#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

namespace geotrain {
namespace {

LogLevel LevelFromEnv() {
  const char* v = std::getenv("GEOTRAIN_LOG_LEVEL");
  if (v == nullptr) return LogLevel::kInfo;
  if (std::strcmp(v, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(v, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(v, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int>& Level() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

std::mutex& NameMutex() {
  static std::mutex mu;
  return mu;
}
std::string& ProcessName() {
  static std::string name = "geotrain";
  return name;
}

}  // namespace

LogLevel MinLogLevel() { return static_cast<LogLevel>(Level().load(std::memory_order_relaxed)); }
void SetMinLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }
void SetLogProcessName(std::string_view name) {
  std::lock_guard<std::mutex> lock(NameMutex());
  ProcessName() = std::string(name);
}

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const int millis =
      static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm_utc;
  gmtime_r(&secs, &tm_utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%H:%M:%S", &tm_utc);
  const char* base = std::strrchr(file, '/');
  static constexpr const char* kNames[] = {"D", "I", "W", "E"};
  std::string name;
  {
    std::lock_guard<std::mutex> lock(NameMutex());
    name = ProcessName();
  }
  char millis_text[8];
  std::snprintf(millis_text, sizeof(millis_text), ".%03d", millis);
  stream_ << kNames[static_cast<int>(level_)] << ' ' << stamp << millis_text << ' ' << name << ' '
          << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string text = stream_.str();
  // One write(2) per line keeps lines from different threads and processes whole.
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
}

}  // namespace geotrain
