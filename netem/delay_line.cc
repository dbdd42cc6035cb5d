// Delay line: see delay_line.h.
#include "netem/delay_line.h"

#include <algorithm>

namespace geotrain::netem {

TimePoint DelayLine::Release(TimePoint sent, Duration latency, Duration jitter) {
  Duration delay = std::max(latency, Duration::zero());
  if (jitter > Duration::zero()) {
    std::uniform_int_distribution<int64_t> sample(-jitter.count(), jitter.count());
    delay += Duration(sample(rng_));
  }
  TimePoint release = sent + std::max(delay, Duration::zero());
  release = std::max(release, last_release_);
  last_release_ = release;
  return release;
}

}  // namespace geotrain::netem
