// tc netem command generation: see tc.h.
#include "netem/tc.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "netem/strings.h"

namespace geotrain::netem {
namespace {

constexpr char kForm[] = "expected SRC_SITE>DST_SITE=IFACE or SRC_SITE>DST_SITE=NETNS:IFACE";

bool SafeWord(std::string_view w) {
  if (w.empty() || w.size() > 64 || w.front() == '-') return false;
  return std::all_of(w.begin(), w.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-' || c == '@' || c == ':';
  });
}

// "30ms", "51.5ms", "0.25ms": tc takes decimal milliseconds.
std::string Millis(double ms) {
  std::string s = absl::StrFormat("%.3f", ms);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s + "ms";
}

}  // namespace

absl::StatusOr<TcDevice> ParseTcDevice(std::string_view text) {
  const size_t eq = text.find('=');
  const size_t gt = text.find('>');
  if (eq == std::string_view::npos || gt == std::string_view::npos || gt > eq) {
    return absl::InvalidArgumentError(absl::StrCat("device '", ToAbsl(text), "': ", kForm));
  }
  TcDevice d;
  d.src = std::string(text.substr(0, gt));
  d.dst = std::string(text.substr(gt + 1, eq - gt - 1));
  std::string_view where = text.substr(eq + 1);
  const size_t colon = where.find(':');
  if (colon != std::string_view::npos) {
    d.netns = std::string(where.substr(0, colon));
    where = where.substr(colon + 1);
  }
  d.dev = std::string(where);
  if (d.src.empty() || d.dst.empty() || d.dev.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("device '", ToAbsl(text), "': ", kForm));
  }
  // Interface names are at most 15 bytes (IFNAMSIZ); every word ends up on a command line.
  if (d.dev.size() > 15 || !SafeWord(d.dev) || d.dev.find(':') != std::string::npos ||
      (!d.netns.empty() && !SafeWord(d.netns))) {
    return absl::InvalidArgumentError(absl::StrCat("device '", ToAbsl(text),
                                                   "': interface and namespace names may hold only letters, digits and "
                                                   "._@- (interfaces at most 15 characters)"));
  }
  return d;
}

int64_t NetemLimitPackets(double bandwidth_mbps, double latency_ms, double jitter_ms) {
  // Uncapped: size for 10 Gbit/s, a fast testbed NIC.
  const double rate_bytes = (bandwidth_mbps > 0 ? bandwidth_mbps : 10000) * 1e6 / 8;
  const double bdp_packets = rate_bytes * (latency_ms + jitter_ms) / 1000 / 1500;
  return std::max<int64_t>(1000, static_cast<int64_t>(std::ceil(2 * bdp_packets)));
}

absl::StatusOr<std::vector<std::string>> TcCommands(const Topology& topology, const std::vector<TcDevice>& devices,
                                                    bool clear) {
  if (devices.empty()) {
    return absl::InvalidArgumentError(
        "no devices: give one --dev SRC_SITE>DST_SITE=[NETNS:]IFACE per link direction to shape");
  }
  std::vector<std::string> commands;
  for (const TcDevice& d : devices) {
    const TopologyLink* found = nullptr;
    for (const TopologyLink& link : topology.links()) {
      if ((link.a() == d.src && link.b() == d.dst) || (link.a() == d.dst && link.b() == d.src)) {
        found = &link;
      }
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("device ", d.src, ">", d.dst, "=", d.dev, ": no link between '",
                                                     d.src, "' and '", d.dst,
                                                     "' in the topology; fix the site names or add the link"));
    }
    if (!SafeWord(d.src) || !SafeWord(d.dst)) {
      return absl::InvalidArgumentError(
          absl::StrCat("site names '", d.src, "', '", d.dst, "' may hold only letters, digits and ._@-"));
    }
    std::string command = d.netns.empty() ? "" : absl::StrCat("ip netns exec ", d.netns, " ");
    if (clear) {
      absl::StrAppend(&command, "tc qdisc del dev ", d.dev, " root");
    } else {
      absl::StrAppend(&command, "tc qdisc replace dev ", d.dev, " root netem delay ", Millis(found->latency_ms()));
      if (found->jitter_ms() > 0) absl::StrAppend(&command, " ", Millis(found->jitter_ms()));
      if (found->bandwidth_mbps() > 0) {
        absl::StrAppend(&command, " rate ", absl::StrFormat("%.0fkbit", std::round(found->bandwidth_mbps() * 1000)));
      }
      absl::StrAppend(&command, " limit ",
                      NetemLimitPackets(found->bandwidth_mbps(), found->latency_ms(), found->jitter_ms()));
    }
    commands.push_back(std::move(command));
  }
  return commands;
}

}  // namespace geotrain::netem
