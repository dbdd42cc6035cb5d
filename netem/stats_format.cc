// The emulator's stats as the control port's `stats` answers them (emulator.h FormatStatsText and
// FormatStatsJson): a text line per link direction, or one JSON object with the same figures, rounded as the
// text rounds them.
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_format.h"
#include "common/json.h"
#include "netem/emulator.h"

namespace geotrain::netem {

std::string FormatStatsText(const std::vector<LinkDirectionStats>& stats) {
  std::string out;
  for (const LinkDirectionStats& s : stats) {
    absl::StrAppendFormat(&out,
                          "link %s>%s %s latency_ms=%g bandwidth_mbps=%g jitter_ms=%g bytes_in=%d bytes_out=%d "
                          "queued_bytes=%d connections=%d active=%d reset=%d stalled_ms=%.0f measured_mbps=%.3f "
                          "measured_delay_ms=%.3f\n",
                          s.src, s.dst, s.up ? "up" : "down", s.params.latency_ms, s.params.bandwidth_mbps,
                          s.params.jitter_ms, s.bytes_in, s.bytes_out, s.queued_bytes, s.connections_total,
                          s.connections_active, s.connections_reset, s.stalled_ms_left, s.measured_mbps,
                          s.measured_delay_ms);
  }
  return out;
}

std::string FormatStatsJson(const std::vector<LinkDirectionStats>& stats) {
  Json links = Json::array();
  for (const LinkDirectionStats& s : stats) {
    links.push_back({{"src", s.src},
                     {"dst", s.dst},
                     {"up", s.up},
                     {"latency_ms", JsonFigure(s.params.latency_ms, "%g")},
                     {"bandwidth_mbps", JsonFigure(s.params.bandwidth_mbps, "%g")},
                     {"jitter_ms", JsonFigure(s.params.jitter_ms, "%g")},
                     {"bytes_in", s.bytes_in},
                     {"bytes_out", s.bytes_out},
                     {"queued_bytes", s.queued_bytes},
                     {"connections", s.connections_total},
                     {"active", s.connections_active},
                     {"reset", s.connections_reset},
                     {"stalled_ms", JsonFigure(s.stalled_ms_left, "%.0f")},
                     {"measured_mbps", JsonFigure(s.measured_mbps, "%.3f")},
                     {"measured_delay_ms", JsonFigure(s.measured_delay_ms, "%.3f")}});
  }
  // Site names come from a topology file: bytes that are not UTF-8 become U+FFFD instead of an exception.
  return DumpJson(Json{{"links", std::move(links)}});
}

}  // namespace geotrain::netem
