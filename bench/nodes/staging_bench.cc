// Data staging across an emulated WAN link against raw TCP over the same link (issue 14's closing figure).
//
// In one process: the head's DataStaging service (head/staging_service.h) serves a set of token shards from disk;
// a worker's shard cache (worker/shard_cache.h) fetches every shard through geotrain-netem's emulator (one link
// between a "head" and a "worker" site, --latency-ms each way, --mbps shared cap), as a worker at another site
// stages a job's data: one shard after the other, each verified by its CRC-32C and written to the cache dir. The
// reference sends the same files over one raw TCP connection through the same emulated link, read from the same
// disk and written to one file per shard on the other side, plain and with each file fdatasync'd before it is closed
// (as the cache does). Runs alternate (staging, TCP, TCP synced, staging ...) after one untimed staging run (the head
// computes each shard's CRC when it first serves it); the summary gives the medians and their ratios. Plaintext on
// both (TLS would cost both sides alike).
//
//   build/bench/nodes/staging_bench [--latency-ms 30] [--mbps 1000] [--total-mb 128] [--shards 4] [--runs 3]
//
// --mbps 0: no bandwidth cap. Figures in docs/benchmarks.md.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/rpc.h"
#include "head/staging_service.h"
#include "netem/emulator.h"
#include "netem/socket_util.h"
#include "worker/shard_cache.h"

namespace geotrain {
namespace {

namespace fs = std::filesystem;
constexpr char kToken[] = "staging-bench-token";
constexpr char kJob[] = "bench-job";

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "staging_bench: %s\n", what.c_str());
  std::exit(1);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Seconds(int64_t start_ns) { return (netem::NowNanos() - start_ns) / 1e9; }

struct Options {
  double latency_ms = 30;
  double mbps = 1000;
  int64_t total_mb = 128;
  int shards = 4;
  int runs = 3;
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) Die(absl::StrCat("missing value after ", arg));
    const char* value = argv[++i];
    if (arg == "--latency-ms") {
      o.latency_ms = std::atof(value);
    } else if (arg == "--mbps") {
      o.mbps = std::atof(value);
    } else if (arg == "--total-mb") {
      o.total_mb = std::atoll(value);
    } else if (arg == "--shards") {
      o.shards = std::atoi(value);
    } else if (arg == "--runs") {
      o.runs = std::atoi(value);
    } else {
      Die(absl::StrCat("unknown flag ", arg, " (--latency-ms, --mbps, --total-mb, --shards, --runs)"));
    }
  }
  if (o.shards < 1 || o.total_mb < 1 || o.runs < 1) Die("--shards, --total-mb and --runs must be positive");
  return o;
}

// The raw TCP reference's server: for each connection, sends every file in order, then closes.
class FileSender {
 public:
  explicit FileSender(std::vector<std::string> files) : files_(std::move(files)) {
    listen_fd_ = netem::ListenLoopback(0, &port_);
    if (listen_fd_ < 0) Die("cannot listen for the TCP reference");
  }
  ~FileSender() { netem::CloseFd(listen_fd_); }
  int port() const { return port_; }

  // Serves one connection (on a thread of the caller's).
  void ServeOne() {
    const int fd = netem::AcceptOne(listen_fd_);
    if (fd < 0) Die("accept failed");
    std::vector<char> buffer(size_t{1} << 20);
    for (const std::string& path : files_) {
      std::ifstream in(path, std::ios::binary);
      while (in) {
        in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
        if (in.gcount() > 0 && !netem::WriteAll(fd, buffer.data(), static_cast<size_t>(in.gcount()))) {
          Die("TCP reference: write failed");
        }
      }
    }
    netem::CloseFd(fd);
  }

 private:
  std::vector<std::string> files_;
  int listen_fd_ = -1;
  int port_ = 0;
};

// Receives the shards (`shards` of `shard_bytes` each, back to back) from the emulated route at `port` into one file
// each under `out_dir`, each file fdatasync'd before it is closed when `sync` (as the shard cache does); returns the
// seconds from connect to the last file closed.
double TcpCopy(FileSender* sender, int port, int shards, int64_t shard_bytes, const fs::path& out_dir, bool sync) {
  fs::create_directories(out_dir);
  std::thread server([sender] { sender->ServeOne(); });
  const int64_t start = netem::NowNanos();
  const int fd = netem::ConnectLoopback(port);
  if (fd < 0) Die("TCP reference: connect failed");
  std::vector<char> buffer(size_t{1} << 20);
  for (int i = 0; i < shards; ++i) {
    const std::string path = (out_dir / absl::StrCat("shard_", i)).string();
    const int out = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) Die(absl::StrCat("TCP reference: cannot open ", path));
    for (int64_t got = 0; got < shard_bytes;) {
      const size_t want = static_cast<size_t>(std::min<int64_t>(buffer.size(), shard_bytes - got));
      const ssize_t n = ::read(fd, buffer.data(), want);
      if (n <= 0) Die(absl::StrCat("TCP reference: the stream ended in shard ", i, " after ", got, " bytes"));
      for (ssize_t written = 0; written < n;) {
        const ssize_t w = ::write(out, buffer.data() + written, static_cast<size_t>(n - written));
        if (w <= 0) Die(absl::StrCat("TCP reference: writing ", path, " failed"));
        written += w;
      }
      got += n;
    }
    if (sync && ::fdatasync(out) != 0) Die("TCP reference: fdatasync failed");
    ::close(out);
  }
  const double seconds = Seconds(start);
  netem::CloseFd(fd);
  server.join();
  fs::remove_all(out_dir);
  return seconds;
}

int Run(const Options& o) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("geotrain_staging_bench_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  fs::create_directories(dir / "head");
  // The shards: random bytes (the staging path does not look inside them).
  const int64_t shard_bytes = o.total_mb * (int64_t{1} << 20) / o.shards;
  std::vector<std::string> files;
  std::mt19937_64 rng(1);
  std::vector<uint64_t> block(shard_bytes / 8 + 1);
  for (int i = 0; i < o.shards; ++i) {
    for (uint64_t& v : block) v = rng();
    files.push_back((dir / "data" / absl::StrFormat("train_%06d.bin", i)).string());
    std::ofstream(files.back(), std::ios::binary).write(reinterpret_cast<const char*>(block.data()), shard_bytes);
  }
  const int64_t total = shard_bytes * o.shards;

  JobInfo job;
  job.set_job_id(kJob);
  job.set_state(JOB_RUNNING);
  job.mutable_spec()->mutable_data()->set_train((dir / "data" / "train_*.bin").string());
  head::HeadStagingService service(
      kToken, (dir / "head").string(),
      head::HeadStagingService::Hooks{.get_job = [&job](const std::string&) -> absl::StatusOr<JobInfo> { return job; },
                                      .log = [](const std::string&, const std::string&) {}},
      nullptr);
  grpc::ServerBuilder builder;
  int head_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &head_port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) Die("cannot start the staging service");
  FileSender sender(files);

  // One emulated link: requests cross worker>head, the data head>worker, for staging and TCP alike.
  Topology topology;
  topology.add_sites()->set_name("worker");
  topology.add_sites()->set_name("head");
  TopologyLink* link = topology.add_links();
  link->set_a("worker");
  link->set_b("head");
  link->set_latency_ms(o.latency_ms);
  link->set_bandwidth_mbps(o.mbps);
  auto emulator =
      netem::Emulator::Create(topology, {netem::RouteSpec{0, "worker", "head", "127.0.0.1", head_port},
                                         netem::RouteSpec{0, "worker", "head", "127.0.0.1", sender.port()}});
  if (!emulator.ok()) Die(emulator.status().ToString());
  if (absl::Status s = (*emulator)->Start(); !s.ok()) Die(s.ToString());
  const std::string head_via_wan = absl::StrCat("127.0.0.1:", (*emulator)->Routes()[0].bound_port);
  const int tcp_via_wan = (*emulator)->Routes()[1].bound_port;
  const worker::ShardServer head{head_via_wan, "the head", worker::ShardOrigin::kHead};

  // The shards as the head lists them (through the link too).
  auto stub = DataStaging::NewStub(grpc::CreateChannel(head_via_wan, grpc::InsecureChannelCredentials()));
  ListShardsRequest list;
  list.set_job_id(kJob);
  list.set_pattern(job.spec().data().train());
  ListShardsReply listed;
  {
    grpc::ClientContext ctx;
    AttachToken(&ctx, kToken);
    if (grpc::Status s = stub->ListShards(&ctx, list, &listed); !s.ok()) Die(s.error_message());
  }
  if (listed.shards_size() != o.shards) Die(absl::StrCat("the head lists ", listed.shards_size(), " shards"));

  // One staging run into an empty cache: every shard fetched in order, as JobStaging does. Seconds.
  auto stage = [&](int run) {
    const fs::path cache_dir = dir / absl::StrCat("cache-", run);
    worker::ShardCacheOptions options;
    options.dir = cache_dir.string();
    options.site = "worker";
    options.token = kToken;
    options.worker_id = [] { return std::string("bench-worker"); };
    const int64_t start = netem::NowNanos();
    {
      worker::ShardCache cache(options);
      for (const ShardInfo& shard : listed.shards()) {
        auto path = cache.Get(kJob, shard, head, head, nullptr, nullptr);
        if (!path.ok()) Die(path.status().ToString());
      }
    }
    const double seconds = Seconds(start);
    fs::remove_all(cache_dir);
    return seconds;
  };

  std::printf("staging_bench: %d shards, %.1f MiB in all; link %g ms each way, cap %s\n", o.shards, total / 1048576.0,
              o.latency_ms, o.mbps > 0 ? absl::StrFormat("%g Mbit/s", o.mbps).c_str() : "none");
  std::printf("warmup staging_s=%.3f (the head hashes each shard on first serve)\n", stage(-1));
  std::vector<double> staging_rates, tcp_rates, synced_rates;
  for (int run = 0; run < o.runs; ++run) {
    const double staging_s = stage(run);
    const double tcp_s = TcpCopy(&sender, tcp_via_wan, o.shards, shard_bytes, dir / "tcp", /*sync=*/false);
    const double synced_s = TcpCopy(&sender, tcp_via_wan, o.shards, shard_bytes, dir / "tcp", /*sync=*/true);
    staging_rates.push_back(total / staging_s);
    tcp_rates.push_back(total / tcp_s);
    synced_rates.push_back(total / synced_s);
    std::printf("run %d staging_MBps=%.1f tcp_MBps=%.1f tcp_fdatasync_MBps=%.1f ratio=%.3f ratio_synced=%.3f\n", run,
                staging_rates.back() / 1e6, tcp_rates.back() / 1e6, synced_rates.back() / 1e6,
                staging_rates.back() / tcp_rates.back(), staging_rates.back() / synced_rates.back());
  }
  const double staging = Median(staging_rates), tcp = Median(tcp_rates), synced = Median(synced_rates);
  std::printf("\nsummary (median of %d runs, %.1f MiB in %d shards, %g ms each way, cap %s)\n", o.runs,
              total / 1048576.0, o.shards, o.latency_ms,
              o.mbps > 0 ? absl::StrFormat("%g Mbit/s = %.1f MB/s", o.mbps, o.mbps / 8).c_str() : "none");
  std::printf("  %-40s %10.1f MB/s\n", "staging (DataStaging + shard cache)", staging / 1e6);
  std::printf("  %-40s %10.1f MB/s\n", "raw TCP, same link, into files", tcp / 1e6);
  std::printf("  %-40s %10.1f MB/s\n", "raw TCP, same link, files fdatasync'd", synced / 1e6);
  std::printf("  %-40s %10.3f\n", "ratio staging / raw TCP", staging / tcp);
  std::printf("  %-40s %10.3f\n", "ratio staging / raw TCP fdatasync'd", staging / synced);
  (*emulator)->Stop();
  server->Shutdown();
  fs::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) { return geotrain::Run(geotrain::ParseArgs(argc, argv)); }
