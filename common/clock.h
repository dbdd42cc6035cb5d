// Time behind an interface so that failure detection and timeouts can be tested with a fake clock.
//
//   RealClock clock;  int64_t now = clock.NowMillis();
//   FakeClock fake;   fake.AdvanceMillis(5000);
#pragma once

#include <atomic>
#include <cstdint>

namespace geotrain {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic milliseconds (for timeouts).
  virtual int64_t NowMillis() const = 0;
  // Wall-clock milliseconds since the Unix epoch (for records shown to users).
  virtual int64_t UnixMillis() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t NowMillis() const override;
  int64_t UnixMillis() const override;
  static RealClock* Get();  // a process-wide instance
};

// Thread-safe; starts at 1,000,000 ms so that "0" never looks like a real time.
class FakeClock : public Clock {
 public:
  int64_t NowMillis() const override { return now_ms_.load(); }
  int64_t UnixMillis() const override { return now_ms_.load(); }
  void AdvanceMillis(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_{1000000};
};

}  // namespace geotrain
