// All-reduce of a 100 MB fp32 buffer among 4 ranks in 2 sites (ranks 0,1 "east", 2,3 "west"), each rank with
// its own gRPC endpoint, all in one process on loopback (no WAN delay or bandwidth limit: this measures the
// algorithms' CPU and transport cost, not a WAN). Ring vs hierarchical, alternating, medians; algbw = bytes /
// time and busbw = algbw x 2(n-1)/n (the nccl-tests convention). With --ranks 2 (one rank per site): the ring
// of two vs the pair exchange that AllReduceSum uses for two ranks.
//
//   build/bench/comm/comm_allreduce_bench [--mb 100] [--reps 3] [--wan-codec none] [--ranks 4|2]
//       [--only first|second]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "comm/communicator.h"

namespace {

using namespace geotrain::comm;
using Clock = std::chrono::steady_clock;

using geotrain::bench::LoadAverage;
using geotrain::bench::Median;

}  // namespace

int main(int argc, char** argv) {
  std::printf("load average (1 min) at the start: %s\n", LoadAverage().c_str());
  size_t mb = 100;
  int reps = 3;
  int n = 4;
  std::string only;  // "first" or "second": one algorithm per process (the other's freed buffers can slow it)
  std::vector<std::string> wan_codecs = {"none", "bf16"};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mb") mb = std::stoul(argv[i + 1]);
    if (flag == "--reps") reps = std::stoi(argv[i + 1]);
    if (flag == "--wan-codec") wan_codecs = {argv[i + 1]};
    if (flag == "--ranks") n = std::stoi(argv[i + 1]);
    if (flag == "--only") only = argv[i + 1];
  }
  if (n != 2 && n != 4) {
    std::fprintf(stderr, "--ranks must be 2 or 4, got %d\n", n);
    return 2;
  }
  const bool pair = n == 2;
  const std::vector<std::string> sites =
      pair ? std::vector<std::string>{"east", "west"} : std::vector<std::string>{"east", "east", "west", "west"};
  const std::string token = "bench-token";
  std::vector<std::unique_ptr<TensorStreamServer>> streams;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::unique_ptr<TensorStreamClient>> clients;
  std::vector<PeerInfo> peers;
  for (int r = 0; r < n; ++r) {
    streams.push_back(std::make_unique<TensorStreamServer>(token));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    streams.back()->Register(&builder);
    servers.push_back(builder.BuildAndStart());
    clients.push_back(std::make_unique<TensorStreamClient>(token));
    peers.push_back(PeerInfo{"rank" + std::to_string(r), "127.0.0.1:" + std::to_string(port), sites[r]});
  }
  const size_t count = mb * 1000 * 1000 / sizeof(float);
  const double bytes = static_cast<double>(count) * sizeof(float);
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  std::printf("all-reduce of %zu MB among %d ranks in 2 sites, one process on loopback, %u hardware threads\n", mb, n,
              std::thread::hardware_concurrency());

  struct Row {
    std::string name;
    double seconds;
  };
  std::vector<Row> rows;
  for (const std::string& wan : wan_codecs) {
    std::vector<std::unique_ptr<GrpcCommunicator>> ring, hier;
    for (int r = 0; r < n; ++r) {
      CommunicatorOptions o;
      o.job_id = "bench";
      o.wan_codec = ParseCodec(wan).value();
      o.timeout = absl::Seconds(300);
      o.all_reduce = AllReduceAlgorithm::kRing;
      ring.push_back(std::make_unique<GrpcCommunicator>(r, peers, streams[r].get(), clients[r].get(), o));
      o.all_reduce = AllReduceAlgorithm::kHierarchical;
      hier.push_back(std::make_unique<GrpcCommunicator>(r, peers, streams[r].get(), clients[r].get(), o));
    }
    auto run = [&](std::vector<std::unique_ptr<GrpcCommunicator>>& comms, const std::string& tag) {
      for (int r = 0; r < n; ++r) std::fill(data[r].begin(), data[r].end(), static_cast<float>(r + 1));
      const auto start = Clock::now();
      std::vector<std::thread> threads;
      std::vector<absl::Status> statuses(n);
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          const absl::Span<float> span = absl::MakeSpan(data[r]);
          // Two ranks: "ring" is the ring of two, "hier" the pair exchange (AllReduceSum's choice for two).
          statuses[r] = !pair           ? comms[r]->AllReduceSum(span, tag)
                        : tag == "ring" ? comms[r]->RingAllReduce(span, tag)
                                        : comms[r]->PairAllReduce(span, tag);
        });
      }
      for (auto& t : threads) t.join();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      for (int r = 0; r < n; ++r) {
        if (!statuses[r].ok()) std::fprintf(stderr, "rank %d: %s\n", r, std::string(statuses[r].message()).c_str());
        if (data[r][count / 2] != static_cast<float>(n * (n + 1) / 2))
          std::fprintf(stderr, "rank %d: wrong sum %f\n", r, data[r][count / 2]);
      }
      return seconds;
    };
    std::vector<double> ring_times, hier_times;
    for (int rep = 0; rep < reps + 1; ++rep) {  // the first round warms up and is dropped
      const double a = only == "second" ? 0 : run(ring, "ring");
      const double b = only == "first" ? 0 : run(hier, "hier");
      if (rep == 0) continue;
      ring_times.push_back(a);
      hier_times.push_back(b);
    }
    rows.push_back({"ring, WAN codec " + wan, Median(ring_times)});
    rows.push_back({(pair ? "pair exchange, WAN codec " : "hierarchical, WAN codec ") + wan, Median(hier_times)});
    for (size_t i = rows.size() - 2; i < rows.size(); ++i) {
      const double algbw = bytes / rows[i].seconds / 1e9;
      std::printf("%-32s %.3f s  algbw %.3f GB/s  busbw %.3f GB/s\n", rows[i].name.c_str(), rows[i].seconds, algbw,
                  algbw * 2.0 * (n - 1) / n);
    }
    std::fflush(stdout);
  }
  std::printf("\n| algorithm | time (median) | algbw GB/s | busbw GB/s |\n|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double algbw = bytes / r.seconds / 1e9;
    std::printf("| %s | %.3f s | %.3f | %.3f |\n", r.name.c_str(), r.seconds, algbw, algbw * 2.0 * (n - 1) / n);
  }
  for (int r = 0; r < n; ++r) {
    streams[r]->Shutdown();
    servers[r]->Shutdown();
  }
  std::printf("load average (1 min) at the end: %s\n", LoadAverage().c_str());
  return 0;
}
