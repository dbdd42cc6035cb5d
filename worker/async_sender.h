// Sends a stage's activations and their gradients on background threads, so that the stage computes its
// next microbatch while the previous one crosses a slow link (a send returns only once the peer holds the
// tensor: a round trip). With max_in_flight > 1, up to that many sends with different tags run at once (a
// deeper 1F1B pipeline tags each microbatch's tensors apart, so its sends do not wait for each other's
// acknowledgements); sends with the same tag, and sends to another site than those in flight, wait. So a
// middle stage whose two neighbours sit in different sites alternates sites and gains no overlap (the
// planner's simulator models that). Also the per-step account of bytes sent across sites.
//
//   AsyncSender sender(collectives.pipeline, [&] { return collectives.BytesSent(TrafficClass::kPipeline); },
//                      "site-a");
//   sender.Send(next_rank, "site-b", output, n, "act");   // copies, returns at once
//   RETURN_IF_ERROR(sender.Flush(&traffic));               // waits for every queued send of the step
//
// Threads: Send and Flush are called by the stage's thread; max_in_flight internal threads make the sends.
// The byte counter is read under the lock when a group of sends to one site starts and when it drains, so
// concurrent sends are counted once, for their site. Once a send fails, the sends queued after it are dropped and
// Flush returns that error. The destructor drops what is queued and joins (a send in flight ends at its
// deadline, or at once when the mailbox it waits on is cancelled).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"

namespace geotrain::worker {

// Bytes sent across sites, by "src>dst" site pair, with the raw (fp32) size they stood for.
struct SiteTraffic {
  std::map<std::string, int64_t> wan_bytes;
  double raw_wan_bytes = 0;
  double encoded_wan_bytes = 0;
  // Counts `encoded` bytes (standing for `raw` fp32 bytes) sent from site `src` to `dst`; nothing when
  // the sites are the same or nothing was sent.
  void Add(const std::string& src, const std::string& dst, uint64_t encoded, double raw);
  void Merge(const SiteTraffic& other);
};

class AsyncSender {
 public:
  // `bytes_sent` reads the encoded bytes `comm`'s sends have delivered so far; `on_error` (may be null) is
  // called once, on a sender thread, when a send fails. max_in_flight: at least 1.
  AsyncSender(comm::Communicator* comm, std::function<uint64_t()> bytes_sent, std::string my_site,
              std::function<void(const absl::Status&)> on_error = nullptr, int max_in_flight = 1);
  ~AsyncSender();
  AsyncSender(const AsyncSender&) = delete;
  AsyncSender& operator=(const AsyncSender&) = delete;

  // Queues a copy of data[0, n) for `peer` (at site `peer_site`) under `tag`.
  void Send(int peer, const std::string& peer_site, const float* data, size_t n, std::string tag);
  // Waits until every queued tensor was delivered (or one failed); moves the traffic counted since the
  // last Flush into `traffic`; returns the first error.
  absl::Status Flush(SiteTraffic* traffic);
  // The first error of a send so far (OK if none), without waiting.
  absl::Status error();

 private:
  struct Item {
    int peer = 0;
    std::string site;
    std::vector<float> data;
    std::string tag;
  };
  void Loop();
  // Whether the queue's front may start now: a free slot, no send with its tag in flight, and the same site
  // as the sends in flight.
  bool CanStart() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  comm::Communicator* const comm_;
  const std::function<uint64_t()> bytes_sent_;
  const std::string my_site_;
  const std::function<void(const absl::Status&)> on_error_;
  absl::Mutex mu_;
  const int max_in_flight_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  std::multiset<std::string> in_flight_tags_ ABSL_GUARDED_BY(mu_);
  std::string in_flight_site_ ABSL_GUARDED_BY(mu_);  // the site of the sends in flight
  uint64_t group_start_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double group_raw_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  SiteTraffic traffic_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace geotrain::worker
