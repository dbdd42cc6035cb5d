// Background sends of activations and gradients (see async_sender.h).
#include "worker/async_sender.h"

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
                         std::function<void(const absl::Status&)> on_error)
    : comm_(comm),
      bytes_sent_(std::move(bytes_sent)),
      my_site_(std::move(my_site)),
      on_error_(std::move(on_error)),
      thread_([this] { Loop(); }) {}

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
  thread_.join();
}

void AsyncSender::Send(int peer, const std::string& peer_site, const float* data, size_t n, const char* tag) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({peer, peer_site, std::vector<float>(data, data + n), tag});
}

absl::Status AsyncSender::Flush(SiteTraffic* traffic) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](AsyncSender* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return (self->queue_.empty() && !self->busy_) || !self->error_.ok();
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
          +[](AsyncSender* self)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->stop_ || !self->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    const uint64_t before = bytes_sent_();
    absl::Status status = comm_->Send(item.peer, absl::MakeConstSpan(item.data), item.tag);
    const uint64_t sent = bytes_sent_() - before;
    bool first_error = false;
    {
      absl::MutexLock lock(&mu_);
      traffic_.Add(my_site_, item.site, sent, 4.0 * item.data.size());
      if (!status.ok() && error_.ok()) {
        error_ = status;
        first_error = true;
      }
      if (!error_.ok()) queue_.clear();  // later sends of the step are moot
      busy_ = false;
    }
    if (first_error && on_error_) on_error_(status);
  }
}

}  // namespace geotrain::worker
