// Running geotrain-netem as a child process, the way `geotrain cluster up` does: build its command
// line, wait for its ready file, then talk to it with control_client.h (QueryStats, link commands).
//
//   EmulatorProcessSpec spec{.binary = "build/bin/geotrain-netem", .topology_path = "topo.yaml",
//                            .routes = routes, .ready_file = state_dir + "/netem.ready"};
//   std::vector<std::string> argv = EmulatorCommandLine(spec);   // exec it (posix_spawn,
//   fork+exec) absl::StatusOr<ReadyInfo> ready = WaitForReadyFile(spec.ready_file,
//   std::chrono::seconds(10), pid);
//   // ready->control_port, ready->routes[i].bound_port (the ports workers connect to)
//   // stop it with SIGTERM; it closes every connection and exits 0.
//
// The ready file is written atomically (rename) once every port listens:
//   control_port 40123
//   metrics_port 40125            (only with --metrics-port)
//   route 0=site-a>site-b@127.0.0.1:9000 127.0.0.1:40124
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "netem/emulator.h"
#include "netem/route.h"

namespace geotrain::netem {

struct EmulatorProcessSpec {
  std::string binary = "geotrain-netem";
  std::string topology_path;
  std::vector<RouteSpec> routes;
  int control_port = 0;   // 0: any free port (read it from the ready file)
  int metrics_port = -1;  // Prometheus /metrics: -1 off, 0 any free port
  std::string ready_file;
  std::string listen_host = "127.0.0.1";
};

// argv for the child, binary first.
std::vector<std::string> EmulatorCommandLine(const EmulatorProcessSpec& spec);

struct ReadyInfo {
  int control_port = 0;
  int metrics_port = 0;             // 0 when the emulator serves no metrics
  std::vector<RouteStatus> routes;  // in the order given
};

// Parses a ready file's text; rejects anything malformed.
absl::StatusOr<ReadyInfo> ParseReadyFile(std::string_view text);

// Polls for `path` until it exists and parses, up to `timeout`. With a `pid` (> 0), fails early
// when that child has exited (without reaping it, so the caller can still wait for it).
absl::StatusOr<ReadyInfo> WaitForReadyFile(const std::string& path, std::chrono::milliseconds timeout, pid_t pid = 0);

}  // namespace geotrain::netem
