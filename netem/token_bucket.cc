// Token bucket: see token_bucket.h.
#include "netem/token_bucket.h"

#include <algorithm>

namespace geotrain::netem {

TokenBucket::TokenBucket(double bytes_per_second, int64_t burst_bytes, TimePoint now)
    : bytes_per_second_(bytes_per_second),
      burst_bytes_(std::max<int64_t>(burst_bytes, 1)),
      tokens_(static_cast<double>(burst_bytes_)),
      last_(now) {}

void TokenBucket::SetRate(double bytes_per_second, int64_t burst_bytes, TimePoint now) {
  const bool was_unlimited = unlimited();
  Refill(now);
  bytes_per_second_ = bytes_per_second;
  burst_bytes_ = std::max<int64_t>(burst_bytes, 1);
  // An uncapped link had no debt: a cap starts with a full bucket; otherwise debt is kept.
  tokens_ = was_unlimited ? static_cast<double>(burst_bytes_) : std::min(tokens_, static_cast<double>(burst_bytes_));
}

void TokenBucket::Refill(TimePoint now) {
  if (now <= last_) return;
  if (bytes_per_second_ > 0) {
    const double seconds = std::chrono::duration<double>(now - last_).count();
    tokens_ = std::min(static_cast<double>(burst_bytes_), tokens_ + seconds * bytes_per_second_);
  } else {
    tokens_ = static_cast<double>(burst_bytes_);
  }
  last_ = now;
}

TimePoint TokenBucket::Reserve(TimePoint now, int64_t bytes) {
  now = std::max(now, last_);
  if (unlimited()) {
    last_ = now;
    return now;
  }
  Refill(now);
  tokens_ -= static_cast<double>(bytes);
  if (tokens_ >= 0) return now;
  return now + std::chrono::duration_cast<Duration>(std::chrono::duration<double>(-tokens_ / bytes_per_second_));
}

double TokenBucket::TokensAt(TimePoint now) const {
  if (unlimited()) return static_cast<double>(burst_bytes_);
  if (now <= last_) return tokens_;
  const double seconds = std::chrono::duration<double>(now - last_).count();
  return std::min(static_cast<double>(burst_bytes_), tokens_ + seconds * bytes_per_second_);
}

}  // namespace geotrain::netem
