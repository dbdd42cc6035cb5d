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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"geotrain-netem: a user-space WAN emulator that relays TCP between sites"};
  std::string topology_path, routes_file, listen_host = "127.0.0.1", ready_file, send;
  std::vector<std::string> route_texts, devices;
  int control_port = 0;
  int metrics_port = -1;
  int64_t max_buffer_kib = 0;
  uint64_t seed = 1;
  bool print_tc = false, clear = false;
  app.add_option("--topology", topology_path, "topology YAML/JSON (sites and links)");
  app.add_option("--route", route_texts,
                 "LISTEN_PORT=SRC_SITE>DST_SITE@TARGET_HOST:PORT (repeatable; port 0 = any free)");
  app.add_option("--routes-file", routes_file, "a file with one route per line ('#' comments)");
  app.add_option("--listen-host", listen_host, "address the route ports listen on");
  app.add_option("--control-port", control_port,
                 "control port on 127.0.0.1 (0 = any free); with --send, the port to talk to");
  app.add_option("--ready-file", ready_file, "written once every port listens");
  app.add_option("--metrics-port", metrics_port,
                 "serve Prometheus /metrics on --listen-host:PORT (0 = any free; default: off)");
  app.add_option("--max-buffer-kib", max_buffer_kib,
                 "bytes one connection direction may queue, in KiB (0 = 1.25 x bandwidth-delay)");
  app.add_option("--seed", seed, "seed of the jitter samples");
  app.add_option("--send", send, "send one control command to a running emulator and print the reply");
  app.add_flag("--print-tc", print_tc, "print the tc netem commands for the topology and exit");
  app.add_option("--dev", devices, "with --print-tc: SRC_SITE>DST_SITE=[NETNS:]IFACE (repeatable)");
  app.add_flag("--clear", clear, "with --print-tc: print the commands that remove the shaping");
  CLI11_PARSE(app, argc, argv);
  geotrain::SetLogProcessName("netem");

  if (!send.empty()) {
    if (control_port <= 0) return Fail(absl::InvalidArgumentError("--send needs --control-port PORT"));
    absl::StatusOr<std::string> reply = geotrain::netem::SendControlCommand(control_port, send);
    if (!reply.ok()) return Fail(reply.status());
    std::cout << *reply;
    return 0;
  }

  if (topology_path.empty()) {
    return Fail(absl::InvalidArgumentError("no topology: give --topology FILE (examples in deploy/topologies/)"));
  }
  absl::StatusOr<geotrain::Topology> topology = geotrain::LoadTopologyFile(topology_path);
  if (!topology.ok()) return Fail(topology.status());

  if (print_tc) {
    std::vector<geotrain::netem::TcDevice> parsed;
    for (const std::string& d : devices) {
      absl::StatusOr<geotrain::netem::TcDevice> device = geotrain::netem::ParseTcDevice(d);
      if (!device.ok()) return Fail(device.status());
      parsed.push_back(*device);
    }
    absl::StatusOr<std::vector<std::string>> commands = geotrain::netem::TcCommands(*topology, parsed, clear);
    if (!commands.ok()) return Fail(commands.status());
    for (const std::string& c : *commands) std::cout << c << "\n";
    return 0;
  }

  std::vector<RouteSpec> routes;
  if (!routes_file.empty()) {
    absl::StatusOr<std::vector<RouteSpec>> from_file = geotrain::netem::LoadRoutesFile(routes_file);
    if (!from_file.ok()) return Fail(from_file.status());
    routes = *from_file;
  }
  for (const std::string& text : route_texts) {
    absl::StatusOr<RouteSpec> route = geotrain::netem::ParseRoute(text);
    if (!route.ok()) return Fail(route.status());
    routes.push_back(*route);
  }
  geotrain::netem::EmulatorOptions options;
  options.listen_host = listen_host;
  options.max_buffer_bytes = max_buffer_kib * 1024;
  options.seed = seed;
  absl::StatusOr<std::unique_ptr<geotrain::netem::Emulator>> emulator =
      geotrain::netem::Emulator::Create(*topology, routes, options);
  if (!emulator.ok()) return Fail(emulator.status());

  // Block the stop signals before the loop thread starts so that only sigwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  if (absl::Status s = (*emulator)->Start(); !s.ok()) return Fail(s);
  absl::StatusOr<int> bound_control = (*emulator)->StartControlServer(control_port);
  if (!bound_control.ok()) return Fail(bound_control.status());

  std::string ready = absl::StrCat("control_port ", *bound_control, "\n");
  std::unique_ptr<geotrain::MetricsServer> metrics_server;
  std::unique_ptr<geotrain::netem::EmulatorMetrics> metrics;
  if (metrics_port >= 0) {
    metrics_server = std::make_unique<geotrain::MetricsServer>();
    if (absl::Status s = metrics_server->Start(absl::StrCat(listen_host, ":", metrics_port)); !s.ok()) {
      return Fail(
          absl::UnavailableError(absl::StrCat("metrics port ", listen_host, ":", metrics_port, ": ", s.message(),
                                              "; choose another --metrics-port (0 picks a free one)")));
    }
    metrics = std::make_unique<geotrain::netem::EmulatorMetrics>(metrics_server->registry());
    metrics->Update((*emulator)->Stats());
    std::cout << "geotrain-netem: metrics http://" << listen_host << ":" << metrics_server->port() << "/metrics\n";
    absl::StrAppend(&ready, "metrics_port ", metrics_server->port(), "\n");
  }
  std::cout << "geotrain-netem: control 127.0.0.1:" << *bound_control << "\n";
  for (const geotrain::netem::RouteStatus& r : (*emulator)->Routes()) {
    std::cout << "geotrain-netem: route " << geotrain::netem::FormatRoute(r.spec) << " listening " << listen_host << ":"
              << r.bound_port << "\n";
    absl::StrAppend(&ready, "route ", geotrain::netem::FormatRoute(r.spec), " ", listen_host, ":", r.bound_port, "\n");
  }
  std::cout << "geotrain-netem: ready" << std::endl;
  if (!ready_file.empty()) {
    if (absl::Status s = WriteReadyFile(ready_file, ready); !s.ok()) return Fail(s);
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
