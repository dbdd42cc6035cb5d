// Telling a dead worker process from a worker the head cannot reach. When a worker's heartbeats stop, the
// head tries a TCP connection to its advertised address:
//
//   refused      the host answers but nothing listens on the port: the process is gone (killed, crashed).
//                The worker is declared dead at once (within the heartbeat timeout plus one probe).
//   listening    the port accepts but no heartbeat comes: a hung process, or heartbeats lost one way.
//   unreachable  no answer before the deadline, or no route: a network partition, or the host is down.
//                The head waits longer (WorkerRegistry::Options::unreachable_timeout_ms) before declaring
//                the worker dead, so that a partition of a few seconds costs time, not a restart.
//
//   std::vector<Reachability> r = ProbeTcp({"10.0.0.2:7000", "10.0.1.5:7000"}, absl::Seconds(1));
//
// All connections are attempted at once (non-blocking), so the probe takes at most `timeout` however many
// workers are silent. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace geotrain::head {

enum class Reachability { kRefused, kListening, kUnreachable };

const char* ReachabilityName(Reachability r);  // "refused", "listening", "unreachable"

// One result per address ("host:port", "[v6]:port"); an address that does not resolve is unreachable.
std::vector<Reachability> ProbeTcp(const std::vector<std::string>& addresses, absl::Duration timeout);

}  // namespace geotrain::head
