// Fuzzes the WAN emulator's control protocol (netem/emulator.h ExecuteCommand, the lines a control-port
// client sends) on a started emulator, the stats text a client parses (netem/control_client.h
// ParseStatsText) and route specs (netem/route.h ParseRoute). Each input line is a command; after them the
// emulator still answers `stats`, whose text parses back, and a route that parses formats back to itself.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_split.h"
#include "fuzz/fuzz_util.h"
#include "netem/control_client.h"
#include "netem/emulator.h"

namespace {
geotrain::netem::Emulator* emulator = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  geotrain::Topology topology;
  for (const char* name : {"a", "b", "c"}) topology.add_sites()->set_name(name);
  geotrain::TopologyLink* link = topology.add_links();
  link->set_a("a");
  link->set_b("b");
  link->set_latency_ms(1);
  absl::StatusOr<geotrain::netem::RouteSpec> route = geotrain::netem::ParseRoute("0=a>b@127.0.0.1:9");
  absl::StatusOr<std::unique_ptr<geotrain::netem::Emulator>> created =
      route.ok() ? geotrain::netem::Emulator::Create(topology, {*route}) : route.status();
  absl::Status started = created.ok() ? (*created)->Start() : created.status();
  if (!started.ok()) {
    std::fprintf(stderr, "netem_control fuzzer: %s\n", std::string(started.message()).c_str());
    std::exit(1);
  }
  emulator = created->release();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = geotrain::fuzz::AsText(data, size);
  (void)geotrain::netem::ParseStatsText(input);
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(input.data(), input.size()), '\n')) {
    if (++lines > 64) break;
    const std::string_view command(line.data(), line.size());
    (void)emulator->ExecuteCommand(command);
    absl::StatusOr<geotrain::netem::RouteSpec> route = geotrain::netem::ParseRoute(command);
    if (route.ok()) {
      absl::StatusOr<geotrain::netem::RouteSpec> again =
          geotrain::netem::ParseRoute(geotrain::netem::FormatRoute(*route));
      FUZZ_CHECK(again.ok() && *again == *route, "a parsed route formats back to itself");
    }
  }
  absl::StatusOr<std::string> stats = emulator->ExecuteCommand("stats");
  FUZZ_CHECK(stats.ok(), "stats answers");
  FUZZ_CHECK(geotrain::netem::ParseStatsText(*stats).ok(), stats->c_str());
  return 0;
}
