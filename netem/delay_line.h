// The delay line of one direction of one connection: when may a chunk that left the link's shaper
// at time `sent` be delivered? At sent + latency + a jitter sample, but never before the previous
// chunk of the same connection, so jitter never reorders the bytes of a TCP stream.
//
//   DelayLine line(/*seed=*/1);
//   TimePoint release = line.Release(sent, MillisToDuration(30), MillisToDuration(2));
//
// Jitter is uniform in [-jitter, +jitter] (tc netem's default without a distribution table); a
// sample that would deliver before `sent` is clamped to `sent`. Because of the no-reordering rule
// the mean added delay under jitter is a little above the latency when chunks follow each other
// closely. Not thread-safe; one per connection direction, used on the emulator's event-loop thread.
#pragma once

#include <cstdint>
#include <random>

#include "netem/time.h"

namespace geotrain::netem {

class DelayLine {
 public:
  explicit DelayLine(uint64_t seed) : rng_(seed) {}

  // The delivery time of a chunk that finished crossing the shaper at `sent`.
  TimePoint Release(TimePoint sent, Duration latency, Duration jitter);

  TimePoint last_release() const { return last_release_; }

 private:
  std::mt19937_64 rng_;
  TimePoint last_release_{};
};

}  // namespace geotrain::netem
