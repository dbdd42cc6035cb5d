// geotrain-netem: the WAN emulator as a process (see emulator.h for the model and netem.md for
// use).
//
//   geotrain-netem --topology deploy/topologies/two-sites-30ms.yaml \
//       --route 7001=site-a>site-b@127.0.0.1:9000 --route 7002=site-b>site-a@127.0.0.1:9001 \
//       --control-port 7000 [--ready-file run/netem.ready]
//   geotrain-netem --control-port 7000 --send "link down site-a site-b"
//   geotrain-netem --topology T.yaml --print-tc --dev 'site-a>site-b=nsA:veth-ab' [--clear]
//
// When listening, it prints the control port and every route's port, then "geotrain-netem: ready",
// and writes the same to --ready-file (atomically) for a parent process. SIGINT/SIGTERM stop it.
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/spec.h"
#include "netem/control_client.h"
#include "netem/emulator.h"
#include "netem/metrics.h"
#include "netem/route.h"
#include "netem/tc.h"

namespace {

using geotrain::netem::RouteSpec;

int Fail(const absl::Status& status) {
  std::cerr << "geotrain-netem: " << status.message() << "\n";
  return 1;
}

absl::Status WriteReadyFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out) {
      return absl::UnavailableError(
          absl::StrCat("cannot write the ready file '", tmp, "'; check that its folder exists and is writable"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  return absl::OkStatus();
}

// The command line: what to do (relay, --send, --print-tc) and how.
struct NetemFlags {
  std::string topology_path;
  std::string routes_file;
  std::string listen_host = "127.0.0.1";
  std::string ready_file;
  std::string send;
  std::vector<std::string> route_texts;
  std::vector<std::string> devices;
  int control_port = 0;
  int metrics_port = -1;
  int64_t max_buffer_kib = 0;
  uint64_t seed = 1;
  bool print_tc = false;
  bool clear = false;
};

void AddFlags(CLI::App& app, NetemFlags& flags) {
  app.add_option("--topology", flags.topology_path, "topology YAML/JSON (sites and links)");
  app.add_option("--route", flags.route_texts,
                 "LISTEN_PORT=SRC_SITE>DST_SITE@TARGET_HOST:PORT (repeatable; port 0 = any free)");
  app.add_option("--routes-file", flags.routes_file, "a file with one route per line ('#' comments)");
  app.add_option("--listen-host", flags.listen_host, "address the route ports listen on");
  app.add_option("--control-port", flags.control_port,
                 "control port on 127.0.0.1 (0 = any free); with --send, the port to talk to");
  app.add_option("--ready-file", flags.ready_file, "written once every port listens");
  app.add_option("--metrics-port", flags.metrics_port,
                 "serve Prometheus /metrics on --listen-host:PORT (0 = any free; default: off)");
  app.add_option("--max-buffer-kib", flags.max_buffer_kib,
                 "bytes one connection direction may queue, in KiB (0 = 1.25 x bandwidth-delay)");
  app.add_option("--seed", flags.seed, "seed of the jitter samples");
  app.add_option("--send", flags.send, "send one control command to a running emulator and print the reply");
  app.add_flag("--print-tc", flags.print_tc, "print the tc netem commands for the topology and exit");
  app.add_option("--dev", flags.devices, "with --print-tc: SRC_SITE>DST_SITE=[NETNS:]IFACE (repeatable)");
  app.add_flag("--clear", flags.clear, "with --print-tc: print the commands that remove the shaping");
}

// --send: one control command to a running emulator; prints its reply.
int SendCommand(const NetemFlags& flags) {
  if (flags.control_port <= 0) return Fail(absl::InvalidArgumentError("--send needs --control-port PORT"));
  absl::StatusOr<std::string> reply = geotrain::netem::SendControlCommand(flags.control_port, flags.send);
  if (!reply.ok()) return Fail(reply.status());
  std::cout << *reply;
  return 0;
}

// --print-tc: the kernel shaping commands for the topology on the --dev interfaces.
int PrintTc(const geotrain::Topology& topology, const NetemFlags& flags) {
  std::vector<geotrain::netem::TcDevice> parsed;
  for (const std::string& d : flags.devices) {
    absl::StatusOr<geotrain::netem::TcDevice> device = geotrain::netem::ParseTcDevice(d);
    if (!device.ok()) return Fail(device.status());
    parsed.push_back(*device);
  }
  absl::StatusOr<std::vector<std::string>> commands = geotrain::netem::TcCommands(topology, parsed, flags.clear);
  if (!commands.ok()) return Fail(commands.status());
  for (const std::string& c : *commands) std::cout << c << "\n";
  return 0;
}

// The routes of --routes-file, then those of --route.
absl::StatusOr<std::vector<RouteSpec>> RoutesOfFlags(const NetemFlags& flags) {
  std::vector<RouteSpec> routes;
  if (!flags.routes_file.empty()) {
    absl::StatusOr<std::vector<RouteSpec>> from_file = geotrain::netem::LoadRoutesFile(flags.routes_file);
    if (!from_file.ok()) return from_file.status();
    routes = *from_file;
  }
  for (const std::string& text : flags.route_texts) {
    absl::StatusOr<RouteSpec> route = geotrain::netem::ParseRoute(text);
    if (!route.ok()) return route.status();
    routes.push_back(*route);
  }
  return routes;
}

// Starts the metrics endpoint (--metrics-port), announces it and adds it to the ready text.
absl::StatusOr<std::unique_ptr<geotrain::MetricsServer>> StartMetricsServer(const NetemFlags& flags,
                                                                            std::string* ready) {
  auto server = std::make_unique<geotrain::MetricsServer>();
  if (absl::Status s = server->Start(absl::StrCat(flags.listen_host, ":", flags.metrics_port)); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("metrics port ", flags.listen_host, ":", flags.metrics_port, ": ",
                                               s.message(), "; choose another --metrics-port (0 picks a free one)"));
  }
  std::cout << "geotrain-netem: metrics http://" << flags.listen_host << ":" << server->port() << "/metrics\n";
  absl::StrAppend(ready, "metrics_port ", server->port(), "\n");
  return server;
}

// Relays the routes until SIGINT/SIGTERM: starts the emulator and its control port, prints the ports and writes
// --ready-file, then refreshes the metrics once a second.
int RunEmulator(const geotrain::Topology& topology, const NetemFlags& flags) {
  absl::StatusOr<std::vector<RouteSpec>> routes = RoutesOfFlags(flags);
  if (!routes.ok()) return Fail(routes.status());
  geotrain::netem::EmulatorOptions options;
  options.listen_host = flags.listen_host;
  options.max_buffer_bytes = flags.max_buffer_kib * 1024;
  options.seed = flags.seed;
  absl::StatusOr<std::unique_ptr<geotrain::netem::Emulator>> emulator =
      geotrain::netem::Emulator::Create(topology, *std::move(routes), options);
  if (!emulator.ok()) return Fail(emulator.status());

  // Block the stop signals before the loop thread starts so that only sigwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  if (absl::Status s = (*emulator)->Start(); !s.ok()) return Fail(s);
  absl::StatusOr<int> bound_control = (*emulator)->StartControlServer(flags.control_port);
  if (!bound_control.ok()) return Fail(bound_control.status());

  std::string ready = absl::StrCat("control_port ", *bound_control, "\n");
  std::unique_ptr<geotrain::MetricsServer> metrics_server;
  std::unique_ptr<geotrain::netem::EmulatorMetrics> metrics;
  if (flags.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<geotrain::MetricsServer>> started = StartMetricsServer(flags, &ready);
    if (!started.ok()) return Fail(started.status());
    metrics_server = *std::move(started);
    metrics = std::make_unique<geotrain::netem::EmulatorMetrics>(metrics_server->registry());
    metrics->Update((*emulator)->Stats());
  }
  std::cout << "geotrain-netem: control 127.0.0.1:" << *bound_control << "\n";
  for (const geotrain::netem::RouteStatus& r : (*emulator)->Routes()) {
    std::cout << "geotrain-netem: route " << geotrain::netem::FormatRoute(r.spec) << " listening " << flags.listen_host
              << ":" << r.bound_port << "\n";
    absl::StrAppend(&ready, "route ", geotrain::netem::FormatRoute(r.spec), " ", flags.listen_host, ":", r.bound_port,
                    "\n");
  }
  std::cout << "geotrain-netem: ready" << std::endl;
  if (!flags.ready_file.empty()) {
    if (absl::Status s = WriteReadyFile(flags.ready_file, ready); !s.ok()) return Fail(s);
  }

  // Wait for SIGINT/SIGTERM; refresh the metrics once a second meanwhile.
  int signal_number = -1;
  while (signal_number < 0) {
    const timespec second{1, 0};
    signal_number = sigtimedwait(&stop_signals, nullptr, &second);
    if (signal_number < 0 && metrics) metrics->Update((*emulator)->Stats());
  }
  GT_LOG(INFO) << "netem: signal " << signal_number << ", stopping";
  (*emulator)->Stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"geotrain-netem: a user-space WAN emulator that relays TCP between sites"};
  NetemFlags flags;
  AddFlags(app, flags);
  CLI11_PARSE(app, argc, argv);
  geotrain::SetLogProcessName("netem");

  if (!flags.send.empty()) return SendCommand(flags);
  if (flags.topology_path.empty()) {
    return Fail(absl::InvalidArgumentError("no topology: give --topology FILE (examples in deploy/topologies/)"));
  }
  absl::StatusOr<geotrain::Topology> topology = geotrain::LoadTopologyFile(flags.topology_path);
  if (!topology.ok()) return Fail(topology.status());
  if (flags.print_tc) return PrintTc(*topology, flags);
  return RunEmulator(*topology, flags);
}
