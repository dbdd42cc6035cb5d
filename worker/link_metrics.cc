// Per-link RTT, probe bandwidth and tensor-stream goodput counters (see link_metrics.h).
#include "worker/link_metrics.h"

#include <utility>

#include "common/log.h"

namespace geotrain::worker {
namespace {

// Name and help of each probe gauge family (a family is looked up by both).
constexpr std::pair<const char*, const char*> kRtt = {
    "geotrain_link_rtt_seconds", "Round trip to a peer worker: best of 5 small pings of the link probe"};
constexpr std::pair<const char*, const char*> kProbeBandwidth = {
    "geotrain_link_probe_bandwidth_bytes_per_second",
    "One-way bandwidth to a peer worker: the link probe's 1 MiB transfer"};

}  // namespace

LinkMetrics::LinkMetrics(MetricsServer* metrics, std::string site) : metrics_(metrics), site_(std::move(site)) {}

bool LinkMetrics::Admit(const std::string& peer) {
  if (peers_.count(peer) > 0) return true;
  if (peers_.size() >= kMaxLinkPeers) {
    if (!warned_) {
      GT_LOG(WARNING) << "link metrics: more than " << kMaxLinkPeers << " peers; peer " << peer
                      << " and later ones are not recorded";
      warned_ = true;
    }
    return false;
  }
  peers_.insert(peer);
  return true;
}

void LinkMetrics::RecordProbe(const std::string& peer, const std::string& peer_site, double rtt_seconds,
                              double bytes_per_second) {
  if (metrics_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  if (!Admit(peer)) return;
  const prometheus::Labels labels = {{"src_site", site_}, {"dst_site", peer_site}, {"peer", peer}};
  metrics_->Gauges(kRtt.first, kRtt.second).Add(labels).Set(rtt_seconds);
  metrics_->Gauges(kProbeBandwidth.first, kProbeBandwidth.second).Add(labels).Set(bytes_per_second);
  probed_[peer] = peer_site;
}

void LinkMetrics::RecordSent(const std::string& peer, const std::string& peer_site, uint64_t bytes, double seconds) {
  absl::MutexLock lock(&mu_);
  if (sent_.size() < kMaxLinkPeers || sent_.count(peer) > 0) {
    SentTotals& totals = sent_[peer];
    totals.bytes += bytes;
    totals.seconds += seconds;
  }
  if (metrics_ == nullptr || !Admit(peer)) return;
  const prometheus::Labels labels = {{"src_site", site_}, {"dst_site", peer_site}, {"peer", peer}};
  metrics_->Counters("geotrain_link_sent_bytes_total", "Tensor bytes sent to a peer worker and acknowledged")
      .Add(labels)
      .Increment(static_cast<double>(bytes));
  metrics_->Counters("geotrain_link_send_seconds_total", "Time the acknowledged tensor sends to a peer took")
      .Add(labels)
      .Increment(seconds);
}

std::map<std::string, LinkMetrics::SentTotals> LinkMetrics::SentTotalsByPeer() const {
  absl::MutexLock lock(&mu_);
  return sent_;
}

void LinkMetrics::KeepProbedPeers(const std::set<std::string>& peers) {
  if (metrics_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  for (auto it = probed_.begin(); it != probed_.end();) {
    if (peers.count(it->first) > 0) {
      ++it;
      continue;
    }
    const prometheus::Labels labels = {{"src_site", site_}, {"dst_site", it->second}, {"peer", it->first}};
    for (const auto& [name, help] : {kRtt, kProbeBandwidth}) {
      auto& family = metrics_->Gauges(name, help);
      family.Remove(&family.Add(labels));
    }
    it = probed_.erase(it);
  }
}

}  // namespace geotrain::worker
