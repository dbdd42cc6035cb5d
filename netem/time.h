// Time as the emulator sees it: a monotonic nanosecond clock. The shaping logic (token bucket,
// delay line) takes "now" as an argument instead of reading a clock, so tests drive it with any
// time they like; only the Asio event loop reads the real clock.
#pragma once

#include <chrono>

namespace geotrain::netem {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;
using Duration = SteadyClock::duration;  // nanoseconds

// Milliseconds as a double to a Duration (rounded to the nearest nanosecond).
inline Duration MillisToDuration(double ms) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(ms));
}
inline double DurationToMillis(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace geotrain::netem
