// The kernel path: the same topology as Linux `tc netem` commands, for network namespaces or real
// testbed NICs (tc-netem.sh runs them; `geotrain-netem --print-tc` prints them).
//
// Each emulated link direction SRC>DST is shaped on the egress of one interface that carries only
// that direction's traffic (a veth end in namespace SRC, or the NIC/VLAN of a point-to-point
// testbed link):
//
//   tc qdisc replace dev veth-ab root netem delay 30ms 1ms rate 1000mbit limit 5000
//
// `replace` makes the commands safe to rerun. `limit` (packets) is twice the bandwidth-delay
// product in 1500-byte packets, at least 1000 (netem's default), so a full-rate flow is not dropped
// by the queue. netem keeps packets in order when a rate is set; an uncapped link with jitter can
// reorder.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "spec.pb.h"

namespace geotrain::netem {

// Where one link direction is shaped: "SRC>DST=IFACE" or "SRC>DST=NETNS:IFACE".
struct TcDevice {
  std::string src;
  std::string dst;
  std::string netns;  // empty: the current namespace
  std::string dev;
};

absl::StatusOr<TcDevice> ParseTcDevice(std::string_view text);

// netem `limit` in packets for a link direction (see above).
int64_t NetemLimitPackets(double bandwidth_mbps, double latency_ms, double jitter_ms);

// The commands, one per device, each a plain word list joined by spaces (no shell quoting needed:
// every word is checked to hold only [A-Za-z0-9._:@-]). With `clear`, commands that remove the
// root qdisc instead. Errors name the device and the link that is missing.
absl::StatusOr<std::vector<std::string>> TcCommands(const Topology& topology, const std::vector<TcDevice>& devices,
                                                    bool clear);

}  // namespace geotrain::netem
