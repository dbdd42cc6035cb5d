// A token bucket that shapes one direction of one emulated link. Every connection on the link draws
// from the same bucket, so they share the link's bandwidth the way flows share a real bottleneck.
//
//   TokenBucket bucket(/*bytes_per_second=*/1.25e6, /*burst_bytes=*/16384, now);
//   TimePoint sent = bucket.Reserve(now, 4096);  // when the chunk's last byte has left the link
//
// Reservations are served in the order they are made: the bucket may go into debt, and a later
// reservation waits until the debt of earlier ones is paid. This is the "virtual scheduling" form
// of a token bucket (GCRA): no queue of waiters is needed, each caller learns its own send time.
// Not thread-safe; the emulator uses one bucket per link direction on its event-loop thread.
#pragma once

#include <cstdint>

#include "netem/time.h"

namespace geotrain::netem {

class TokenBucket {
 public:
  // `bytes_per_second` <= 0 means unlimited: Reserve() always returns `now`. The bucket starts
  // full.
  TokenBucket(double bytes_per_second, int64_t burst_bytes, TimePoint now);

  // Changes the rate and burst from `now` on; reservations already made keep their times. Debt is
  // carried over; going from unlimited to a cap starts with a full bucket.
  void SetRate(double bytes_per_second, int64_t burst_bytes, TimePoint now);

  // Takes `bytes` from the bucket and returns the time at which they have been sent: `now` when
  // enough tokens are banked, later when the bucket is (or goes) into debt. `now` must not go
  // backwards between calls (an earlier time is treated as the latest one seen).
  TimePoint Reserve(TimePoint now, int64_t bytes);

  // Tokens (bytes) banked at `now`; negative while earlier reservations are still being paid.
  double TokensAt(TimePoint now) const;

  bool unlimited() const { return bytes_per_second_ <= 0; }
  double bytes_per_second() const { return bytes_per_second_; }
  int64_t burst_bytes() const { return burst_bytes_; }

 private:
  void Refill(TimePoint now);

  double bytes_per_second_;
  int64_t burst_bytes_;
  double tokens_;
  TimePoint last_;
};

}  // namespace geotrain::netem
