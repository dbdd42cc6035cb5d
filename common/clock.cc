// The real clock: steady_clock for timeouts, system_clock for records.
#include "common/clock.h"

#include <chrono>

namespace geotrain {

int64_t RealClock::NowMillis() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t RealClock::UnixMillis() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

RealClock* RealClock::Get() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace geotrain
