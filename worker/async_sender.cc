// Background sends of activations and gradients (see async_sender.h).
#include "worker/async_sender.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain::worker {

void SiteTraffic::Add(const std::string& src, const std::string& dst, uint64_t encoded, double raw) {
  if (src == dst || encoded == 0) return;
  wan_bytes[absl::StrCat(src, ">", dst)] += static_cast<int64_t>(encoded);
  raw_wan_bytes += raw;
  encoded_wan_bytes += static_cast<double>(encoded);
}

void SiteTraffic::Merge(const SiteTraffic& other) {
  for (const auto& [pair, bytes] : other.wan_bytes) wan_bytes[pair] += bytes;
  raw_wan_bytes += other.raw_wan_bytes;
  encoded_wan_bytes += other.encoded_wan_bytes;
}

AsyncSender::AsyncSender(comm::Communicator* comm, std::function<uint64_t()> bytes_sent, std::string my_site,
                         std::function<void(const absl::Status&)> on_error, int max_in_flight)
    : comm_(comm),
      bytes_sent_(std::move(bytes_sent)),
      my_site_(std::move(my_site)),
      on_error_(std::move(on_error)),
      max_in_flight_(std::max(1, max_in_flight)) {
  for (int i = 0; i < max_in_flight_; ++i) threads_.emplace_back([this] { Loop(); });
}

absl::Status AsyncSender::error() {
  absl::MutexLock lock(&mu_);
  return error_;
}

AsyncSender::~AsyncSender() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();
  }
  for (std::thread& t : threads_) t.join();
}

void AsyncSender::Send(int peer, const std::string& peer_site, const float* data, size_t n, std::string tag) {
  absl::MutexLock lock(&mu_);
  if (!error_.ok()) return;  // the step failed: later sends are moot
  queue_.push_back({peer, peer_site, std::vector<float>(data, data + n), std::move(tag)});
}

bool AsyncSender::CanStart() const {
  if (queue_.empty()) return false;
  const int in_flight = static_cast<int>(in_flight_tags_.size());
  if (in_flight == 0) return true;
  const Item& next = queue_.front();
  return in_flight < max_in_flight_ && !in_flight_tags_.count(next.tag) && next.site == in_flight_site_;
}

absl::Status AsyncSender::Flush(SiteTraffic* traffic) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](AsyncSender* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return (self->queue_.empty() && self->in_flight_tags_.empty()) || !self->error_.ok();
      },
      this));
  traffic->Merge(traffic_);
  traffic_ = SiteTraffic{};
  return error_;
}

void AsyncSender::Loop() {
  while (true) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](AsyncSender* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->stop_ || self->CanStart(); },
          this));
      if (stop_) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      if (in_flight_tags_.empty()) {  // a new group of sends to one site
        in_flight_site_ = item.site;
        group_start_bytes_ = bytes_sent_();
        group_raw_bytes_ = 0;
      }
      in_flight_tags_.insert(item.tag);
    }
    absl::Status status = comm_->Send(item.peer, absl::MakeConstSpan(item.data), item.tag);
    bool first_error = false;
    {
      absl::MutexLock lock(&mu_);
      group_raw_bytes_ += 4.0 * item.data.size();
      in_flight_tags_.erase(in_flight_tags_.find(item.tag));
      if (in_flight_tags_.empty()) {  // the group drained: its bytes are all this site's
        traffic_.Add(my_site_, in_flight_site_, bytes_sent_() - group_start_bytes_, group_raw_bytes_);
      }
      if (!status.ok() && error_.ok()) {
        error_ = status;
        first_error = true;
      }
      if (!error_.ok()) queue_.clear();  // later sends of the step are moot
    }
    if (first_error && on_error_) on_error_(status);
  }
}

}  // namespace geotrain::worker
