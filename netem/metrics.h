// The emulator's figures as Prometheus metrics (geotrain-netem --metrics-port), one time series per
// link direction, labelled src_site and dst_site, in base units:
//   geotrain_netem_bytes_total             bytes written to destinations (counter)
//   geotrain_netem_queued_bytes            bytes read, not yet written
//   geotrain_netem_connections             open connections (on the direction they were opened in)
//   geotrain_netem_link_up                 1 up, 0 down
//   geotrain_netem_latency_seconds         configured one-way latency
//   geotrain_netem_bandwidth_bits_per_second   configured cap (0: none)
//   geotrain_netem_measured_delay_seconds  read-to-write time of recent chunks
//   geotrain_netem_measured_bits_per_second    rate written over the last full second
//
//   EmulatorMetrics metrics(metrics_server.registry());
//   metrics.Update(emulator->Stats());   // e.g. once a second
// Update() is not thread-safe against itself; prometheus-cpp's scrapes may run concurrently with
// it.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "netem/emulator.h"

namespace geotrain::netem {

class EmulatorMetrics {
 public:
  explicit EmulatorMetrics(prometheus::Registry& registry);
  void Update(const std::vector<LinkDirectionStats>& stats);

 private:
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Gauge>& queued_;
  prometheus::Family<prometheus::Gauge>& connections_;
  prometheus::Family<prometheus::Gauge>& up_;
  prometheus::Family<prometheus::Gauge>& latency_;
  prometheus::Family<prometheus::Gauge>& bandwidth_;
  prometheus::Family<prometheus::Gauge>& measured_delay_;
  prometheus::Family<prometheus::Gauge>& measured_rate_;
  std::map<std::pair<std::string, std::string>, int64_t> bytes_seen_;
};

}  // namespace geotrain::netem
