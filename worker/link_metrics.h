// Per-link figures as this worker measures them, exported on its /metrics for the dashboard's link panels:
//
//   geotrain_link_rtt_seconds{src_site,dst_site,peer}                   round trip to a peer (probe: best of 5 pings)
//   geotrain_link_probe_bandwidth_bytes_per_second{src_site,dst_site,peer}  the probe's 1 MiB one-way transfer
//   geotrain_link_sent_bytes_total{src_site,dst_site,peer}              tensor bytes the peer acknowledged
//   geotrain_link_send_seconds_total{src_site,dst_site,peer}            the time those sends took (write to ack)
//
// Goodput of a link as the training traffic sees it is rate(sent_bytes) / rate(send_seconds): the bytes delivered
// per second spent sending them (sends to one peer that overlap count their time twice, so it is a lower bound when
// several streams share the link). src_site is this worker's site, dst_site the peer's, peer the peer's worker id.
//
//   LinkMetrics links(metrics_server, "site-a");        // metrics_server may be null: nothing is recorded
//   links.RecordProbe("w3", "site-b", 0.0112, 1.2e8);   // from the probe loop
//   links.RecordSent("w3", "site-b", 4 << 20, 0.05);    // from TensorStreamOptions::on_acknowledged
//   links.KeepProbedPeers({"w3"});                       // the head's peer list: other peers' gauges go
//
// Label cardinality is bounded: peers are workers of the cluster, and at most kMaxLinkPeers distinct peers are
// recorded (later ones are dropped, with one warning). The probe gauges of a peer that left the head's list are
// removed; the counters stay (a counter that disappears would look like a reset to rate()).
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

namespace geotrain::worker {

inline constexpr size_t kMaxLinkPeers = 1024;

class LinkMetrics {
 public:
  LinkMetrics(MetricsServer* metrics, std::string site);
  LinkMetrics(const LinkMetrics&) = delete;
  LinkMetrics& operator=(const LinkMetrics&) = delete;

  void RecordProbe(const std::string& peer, const std::string& peer_site, double rtt_seconds, double bytes_per_second);
  void RecordSent(const std::string& peer, const std::string& peer_site, uint64_t bytes, double seconds);
  // Removes the probe gauges of every peer not in `peers`.
  void KeepProbedPeers(const std::set<std::string>& peers);

  // What RecordSent added up per peer since this object was made (kept with or without a metrics server, for at
  // most kMaxLinkPeers peers): the worker sends these totals to the head, which turns their growth into each
  // link's recent goodput.
  struct SentTotals {
    uint64_t bytes = 0;
    double seconds = 0;
  };
  std::map<std::string, SentTotals> SentTotalsByPeer() const;

 private:
  // Whether `peer` may have series (it has some, or the cap leaves room); warns once when the cap is reached.
  bool Admit(const std::string& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MetricsServer* const metrics_;
  const std::string site_;
  mutable absl::Mutex mu_;  // held around Add/Set/Remove, so that no gauge is set after it was removed
  std::set<std::string> peers_ ABSL_GUARDED_BY(mu_);                // every peer with series
  std::map<std::string, std::string> probed_ ABSL_GUARDED_BY(mu_);  // peer -> its site, with probe gauges
  bool warned_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, SentTotals> sent_ ABSL_GUARDED_BY(mu_);  // peer -> RecordSent's totals
};

}  // namespace geotrain::worker
