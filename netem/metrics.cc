// Emulator metrics: see metrics.h.
#include "netem/metrics.h"

namespace geotrain::netem {
namespace {

prometheus::Family<prometheus::Gauge>& Gauge(prometheus::Registry& registry, const char* name, const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

}  // namespace

EmulatorMetrics::EmulatorMetrics(prometheus::Registry& registry)
    : bytes_(prometheus::BuildCounter()
                 .Name("geotrain_netem_bytes_total")
                 .Help("Bytes the emulator wrote to destinations, per link direction")
                 .Register(registry)),
      queued_(Gauge(registry, "geotrain_netem_queued_bytes", "Bytes read and not yet written")),
      connections_(Gauge(registry, "geotrain_netem_connections", "Open relayed connections")),
      up_(Gauge(registry, "geotrain_netem_link_up", "1 when the link is up, 0 when down")),
      latency_(Gauge(registry, "geotrain_netem_latency_seconds", "Configured one-way latency")),
      bandwidth_(Gauge(registry, "geotrain_netem_bandwidth_bits_per_second", "Configured bandwidth cap (0: none)")),
      measured_delay_(Gauge(registry, "geotrain_netem_measured_delay_seconds", "Read-to-write time of recent chunks")),
      measured_rate_(
          Gauge(registry, "geotrain_netem_measured_bits_per_second", "Rate written over the last full second")) {}

void EmulatorMetrics::Update(const std::vector<LinkDirectionStats>& stats) {
  for (const LinkDirectionStats& s : stats) {
    const prometheus::Labels labels = {{"src_site", s.src}, {"dst_site", s.dst}};
    int64_t& seen = bytes_seen_[{s.src, s.dst}];
    if (s.bytes_out > seen)
      bytes_.Add(labels).Increment(static_cast<double>(s.bytes_out - seen));
    else
      bytes_.Add(labels);  // the series exists from the start, at 0
    seen = std::max(seen, s.bytes_out);
    queued_.Add(labels).Set(static_cast<double>(s.queued_bytes));
    connections_.Add(labels).Set(static_cast<double>(s.connections_active));
    up_.Add(labels).Set(s.up ? 1 : 0);
    latency_.Add(labels).Set(s.params.latency_ms / 1000);
    bandwidth_.Add(labels).Set(s.params.bandwidth_mbps * 1e6);
    measured_delay_.Add(labels).Set(s.measured_delay_ms / 1000);
    measured_rate_.Add(labels).Set(s.measured_mbps * 1e6);
  }
}

}  // namespace geotrain::netem
