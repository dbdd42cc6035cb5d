// geotrain's user-space WAN emulator: relays TCP between sites on one machine as a topology says.
//
// For every route (see route.h) the emulator listens on a local port and forwards each accepted
// connection to the route's target. Bytes from the client cross the link direction SRC>DST, replies
// cross DST>SRC. Each link direction has
//   - a one-way latency and jitter: a chunk read at time t is written no earlier than
//     t + latency (+ a uniform jitter sample in [-jitter, +jitter]), never before the previous
//     chunk of the same connection, so bytes are never reordered (delay_line.h);
//   - a bandwidth cap shared by every connection on the link direction (token_bucket.h);
//   - bounded buffering: a connection direction stops reading from its source while more than
//     max_buffer_bytes are queued, so a fast sender is slowed by TCP flow control;
//   - controls: down (new connections are reset, existing ones are reset), up, and stall (data is
//     held, connections stay open, until the stall ends).
//
// Threading: one io_context, run by one thread that Start() creates. All link, route and connection
// state lives on that thread and needs no lock. The public methods below may be called from any
// thread: they post their work to the loop and wait for it (from the loop thread itself, e.g. a
// control-port session, they run inline). One thread is enough: a relay costs a few system calls
// per 64 KiB chunk, and the loop moves several GB/s on loopback.
//
//   absl::StatusOr<std::unique_ptr<Emulator>> emulator =
//       Emulator::Create(topology, {*ParseRoute("0=utah>amsterdam@127.0.0.1:9000")});
//   (*emulator)->Start();                       // listening once this returns OK
//   int port = (*emulator)->Routes()[0].bound_port;
//   (*emulator)->SetLinkUp("utah", "amsterdam", false);
//   std::string text = *(*emulator)->ExecuteCommand("stats");
//
// Limits, as for any user-space relay: TCP is terminated at the emulator, so the emulated link has
// no packet loss and TCP's own dynamics over the long path (slow start, window per RTT) are not
// reproduced; connection setup costs no round trip. tc-netem.sh shapes the kernel's packets
// instead.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "netem/route.h"
#include "netem/time.h"
#include "spec.pb.h"

namespace geotrain::netem {

// The shaping of one link direction. bandwidth_mbps 0 means no cap.
struct LinkParams {
  double latency_ms = 0;
  double bandwidth_mbps = 0;
  double jitter_ms = 0;
};

struct EmulatorOptions {
  // Address the route ports listen on.
  std::string listen_host = "127.0.0.1";
  // Bytes one connection direction may hold before it stops reading; 0 picks 1.25 x the link's
  // bandwidth-delay product plus the burst plus two chunks, at least 64 KiB, at most 64 MiB
  // (16 MiB when uncapped: 1.3 Gbit/s at 100 ms one way).
  int64_t max_buffer_bytes = 0;
  // Token bucket depth; 0 picks 10 ms of the link's rate, at least 16 KiB.
  int64_t burst_bytes = 0;
  // Seed of the jitter samples (each connection direction gets its own stream from it).
  uint64_t seed = 1;
};

struct RouteStatus {
  RouteSpec spec;
  int bound_port = 0;  // the port actually listened on (differs from spec when spec asked for 0)
};

struct LinkDirectionStats {
  std::string src;
  std::string dst;
  LinkParams params;
  bool up = true;
  double stalled_ms_left = 0;
  int64_t bytes_in = 0;      // read from sources
  int64_t bytes_out = 0;     // written to destinations
  int64_t queued_bytes = 0;  // read, not yet written
  int64_t connections_total = 0;
  int64_t connections_active = 0;
  int64_t connections_reset = 0;  // reset by `link down` or refused while down
  // As measured: the rate written over the last full second, and the read-to-write time of recent
  // chunks (an exponential average over about 20 chunks; includes queueing behind the cap).
  double measured_mbps = 0;
  double measured_delay_ms = 0;
};

class Emulator {
 public:
  // Checks the routes against the topology (known sites, a link between them, distinct ports).
  // Errors name the route and the fix. Nothing is opened until Start().
  static absl::StatusOr<std::unique_ptr<Emulator>> Create(const Topology& topology, std::vector<RouteSpec> routes,
                                                          EmulatorOptions options = {});
  ~Emulator();
  Emulator(const Emulator&) = delete;
  Emulator& operator=(const Emulator&) = delete;

  // Opens every route's listening port and starts the loop thread. On error (port in use, bad
  // listen or target address) nothing is left open and the error names the port and the fix.
  absl::Status Start();
  // Opens the line-based control port on 127.0.0.1 (0 picks a free port); returns the bound port.
  // Requires Start(). Commands: see ExecuteCommand().
  absl::StatusOr<int> StartControlServer(int port);
  // Closes every socket and joins the loop thread. Idempotent; the destructor calls it.
  void Stop();

  std::vector<RouteStatus> Routes() const;
  std::vector<LinkDirectionStats> Stats();

  // Both directions of link a-b. Down resets the link's connections and resets new ones at once.
  absl::Status SetLinkUp(std::string_view a, std::string_view b, bool up);
  // Holds data on both directions of link a-b for `duration` from now (zero ends a stall).
  absl::Status Stall(std::string_view a, std::string_view b, Duration duration);
  // New shaping for direction src>dst (and dst>src too when both_directions); applies to chunks
  // read from now on.
  absl::Status SetLinkParams(std::string_view src, std::string_view dst, const LinkParams& params,
                             bool both_directions = true);

  // Runs one control command and returns its output (without the final "ok" line):
  //   link down A B | link up A B | stall A B MS | set A B [latency_ms=X] [bandwidth_mbps=Y]
  //   [jitter_ms=Z] | stats | stats json | routes | help
  absl::StatusOr<std::string> ExecuteCommand(std::string_view line);

  class Impl;

 private:
  explicit Emulator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Formats stats as the control port's `stats` text (one line per link direction) or one JSON line.
std::string FormatStatsText(const std::vector<LinkDirectionStats>& stats);
std::string FormatStatsJson(const std::vector<LinkDirectionStats>& stats);

}  // namespace geotrain::netem
