// The WAN emulator's accuracy sweep and its own overhead, on loopback in one process:
//   - added one-way latency at 0, 10, 30 and 100 ms (median and p90 of small timestamped messages);
//   - throughput at 10, 100 and 1000 Mbit/s caps at 1 ms, and 100 and 1000 at 30 ms (bulk
//     transfers of about 2 s, median of 3);
//   - overhead at 0 ms and no cap against direct loopback, measured side by side (A B A B ...):
//     ping-pong round trip of 64 bytes and bulk-copy throughput.
// Prints one line per figure and a summary table. `--quick` runs a shorter sweep.
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "netem/emulator.h"
#include "netem/socket_util.h"

namespace geotrain::netem {
namespace {

Topology TwoSites(double latency_ms, double bandwidth_mbps) {
  Topology t;
  t.add_sites()->set_name("a");
  t.add_sites()->set_name("b");
  TopologyLink* l = t.add_links();
  l->set_a("a");
  l->set_b("b");
  l->set_latency_ms(latency_ms);
  l->set_bandwidth_mbps(bandwidth_mbps);
  return t;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}
double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// A target on loopback, optionally behind an emulator; connect() gives (client, server) fds.
class Path {
 public:
  Path(bool emulated, double latency_ms, double bandwidth_mbps) {
    listen_fd_ = ListenLoopback(0, &port_);
    if (emulated) {
      auto e = Emulator::Create(TwoSites(latency_ms, bandwidth_mbps), {RouteSpec{0, "a", "b", "127.0.0.1", port_}});
      if (!e.ok() || !(*e)->Start().ok()) {
        std::fprintf(stderr, "netem_bench: cannot start the emulator\n");
        std::exit(1);
      }
      emulator_ = *std::move(e);
      connect_port_ = emulator_->Routes()[0].bound_port;
    } else {
      connect_port_ = port_;
    }
  }
  ~Path() {
    if (emulator_) emulator_->Stop();
    CloseFd(listen_fd_);
  }
  std::pair<int, int> Connect() {
    const int client = ConnectLoopback(connect_port_);
    const int server = AcceptOne(listen_fd_);
    if (client < 0 || server < 0) {
      std::fprintf(stderr, "netem_bench: connect failed\n");
      std::exit(1);
    }
    return {client, server};
  }

 private:
  int listen_fd_ = -1;
  int port_ = 0;
  int connect_port_ = 0;
  std::unique_ptr<Emulator> emulator_;
};

std::vector<double> OneWayDelaysMs(int from, int to, int n, int gap_ms) {
  std::vector<double> delays;
  std::thread reader([&] {
    for (int i = 0; i < n; ++i) {
      int64_t sent = 0;
      if (!ReadExact(to, &sent, sizeof(sent))) return;
      delays.push_back((NowNanos() - sent) / 1e6);
    }
  });
  for (int i = 0; i < n; ++i) {
    const int64_t now = NowNanos();
    WriteAll(from, &now, sizeof(now));
    std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
  }
  reader.join();
  return delays;
}

// Bytes per second seen by the receiver from its first read to its last (first read left out).
double BulkRate(int from, int to, int64_t bytes) { return ReceiverRate(from, to, bytes, 256 * 1024); }

// Median round trip (microseconds) of `n` 64-byte ping-pongs.
double PingPongMicros(int client, int server, int n) {
  std::thread echo([&] {
    char buffer[64];
    for (int i = 0; i < n; ++i) {
      if (!ReadExact(server, buffer, sizeof(buffer)) || !WriteAll(server, buffer, sizeof(buffer))) {
        return;
      }
    }
  });
  std::vector<double> rtts;
  char buffer[64] = {};
  for (int i = 0; i < n; ++i) {
    const int64_t start = NowNanos();
    WriteAll(client, buffer, sizeof(buffer));
    ReadExact(client, buffer, sizeof(buffer));
    rtts.push_back((NowNanos() - start) / 1e3);
  }
  echo.join();
  return Median(rtts);
}

struct Row {
  std::string what;
  std::string figure;
};

int Run(bool quick) {
  std::vector<Row> summary;
  // Reference for the latency rows: direct loopback one-way delay.
  double direct_one_way_ms = 0;
  {
    Path direct(false, 0, 0);
    auto [c, s] = direct.Connect();
    direct_one_way_ms = Median(OneWayDelaysMs(c, s, quick ? 20 : 50, 2));
    std::printf("latency direct_loopback one_way_median_ms=%.4f\n", direct_one_way_ms);
    CloseFd(c);
    CloseFd(s);
  }
  for (double latency : {0.0, 10.0, 30.0, 100.0}) {
    Path path(true, latency, 0);
    auto [c, s] = path.Connect();
    const int n = quick ? 15 : (latency >= 100 ? 40 : 60);
    std::vector<double> forward = OneWayDelaysMs(c, s, n, 3);
    std::vector<double> backward = OneWayDelaysMs(s, c, n, 3);
    forward.insert(forward.end(), backward.begin(), backward.end());
    const double median = Median(forward);
    const double p90 = Percentile(forward, 0.9);
    const double added = median - direct_one_way_ms;
    std::printf(
        "latency configured_ms=%g samples=%zu median_ms=%.3f p90_ms=%.3f min_ms=%.3f "
        "added_ms=%.3f error_ms=%.3f\n",
        latency, forward.size(), median, p90, Percentile(forward, 0), added, added - latency);
    summary.push_back({absl::StrFormat("one-way latency %g ms", latency),
                       absl::StrFormat("median %.3f ms, p90 %.3f ms, error %+.3f ms", median, p90, added - latency)});
    CloseFd(c);
    CloseFd(s);
  }
  // Caps at 1 ms, and at 30 ms (where the per-connection buffer must cover the bandwidth-delay
  // product for the cap to be reached).
  for (auto [mbps, latency] : {std::pair(10.0, 1.0), std::pair(100.0, 1.0), std::pair(1000.0, 1.0),
                               std::pair(100.0, 30.0), std::pair(1000.0, 30.0)}) {
    const double cap = mbps * 1e6 / 8;
    const double seconds = quick ? 0.7 : 2.0;
    std::vector<double> rates;
    for (int run = 0; run < (quick ? 1 : 3); ++run) {
      Path path(true, latency, mbps);
      auto [c, s] = path.Connect();
      rates.push_back(BulkRate(c, s, static_cast<int64_t>(cap * seconds)));
      CloseFd(c);
      CloseFd(s);
    }
    const double rate = Median(rates);
    std::printf("throughput cap_mbps=%g latency_ms=%g runs=%zu median_mbps=%.2f ratio_to_cap=%.4f\n", mbps, latency,
                rates.size(), rate * 8 / 1e6, rate / cap);
    summary.push_back({absl::StrFormat("throughput cap %g Mbit/s, %g ms", mbps, latency),
                       absl::StrFormat("%.2f Mbit/s (%.2f%% of cap)", rate * 8 / 1e6, 100 * rate / cap)});
  }
  // Overhead at 0 ms, no cap: direct vs emulated, alternating.
  std::vector<double> pp_direct, pp_emulated, bulk_direct, bulk_emulated;
  const int rounds = quick ? 2 : 5;
  const int pings = quick ? 500 : 2000;
  const int64_t bulk_bytes = int64_t{quick ? 64 : 256} << 20;
  for (int r = 0; r < rounds; ++r) {
    for (bool emulated : {false, true}) {
      Path path(emulated, 0, 0);
      auto [c, s] = path.Connect();
      const double us = PingPongMicros(c, s, pings);
      (emulated ? pp_emulated : pp_direct).push_back(us);
      CloseFd(c);
      CloseFd(s);
      auto [c2, s2] = path.Connect();
      const double rate = BulkRate(c2, s2, bulk_bytes);
      (emulated ? bulk_emulated : bulk_direct).push_back(rate);
      CloseFd(c2);
      CloseFd(s2);
      std::printf("overhead round=%d path=%s pingpong_rtt_us=%.1f bulk_mbps=%.0f\n", r,
                  emulated ? "emulator" : "direct", us, rate * 8 / 1e6);
    }
  }
  const double ppd = Median(pp_direct), ppe = Median(pp_emulated);
  const double bd = Median(bulk_direct), be = Median(bulk_emulated);
  std::printf("overhead pingpong_rtt_us direct=%.1f emulator=%.1f added_us=%.1f ratio=%.2f\n", ppd, ppe, ppe - ppd,
              ppe / ppd);
  std::printf("overhead bulk_mbps direct=%.0f emulator=%.0f ratio=%.3f\n", bd * 8 / 1e6, be * 8 / 1e6, be / bd);
  summary.push_back(
      {"ping-pong RTT, 64 B, 0 ms no cap",
       absl::StrFormat("direct %.1f us, emulator %.1f us (+%.1f us, %.2fx)", ppd, ppe, ppe - ppd, ppe / ppd)});
  summary.push_back({"bulk copy, 0 ms no cap", absl::StrFormat("direct %.0f Mbit/s, emulator %.0f Mbit/s (%.3fx)",
                                                               bd * 8 / 1e6, be * 8 / 1e6, be / bd)});
  std::printf("\n%-36s | %s\n", "figure", "measured");
  std::printf("%s\n", std::string(100, '-').c_str());
  for (const Row& row : summary) std::printf("%-36s | %s\n", row.what.c_str(), row.figure.c_str());
  return 0;
}

}  // namespace
}  // namespace geotrain::netem

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  return geotrain::netem::Run(quick);
}
