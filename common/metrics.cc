// Metrics server, RPC metrics and a /proc-based process collector.
#include "common/metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/clock.h"

namespace geotrain {
namespace {

// Process basics in the names Prometheus' own client libraries use.
class ProcessCollector : public prometheus::Collectable {
 public:
  ProcessCollector() : start_unix_seconds_(RealClock::Get()->UnixMillis() / 1000.0) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&out](const char* name, const char* help, prometheus::MetricType type, double v) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = type;
      prometheus::ClientMetric m;
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = v;
      } else {
        m.gauge.value = v;
      }
      f.metric.push_back(m);
      out.push_back(std::move(f));
    };
    const long ticks = sysconf(_SC_CLK_TCK);
    const long page = sysconf(_SC_PAGESIZE);
    std::ifstream stat("/proc/self/stat");
    std::string line;
    std::getline(stat, line);
    // Fields after the command name (which is in parentheses and may hold spaces).
    const size_t close = line.rfind(')');
    if (close != std::string::npos) {
      std::istringstream rest(line.substr(close + 2));
      std::vector<std::string> f;
      std::string tok;
      while (rest >> tok) f.push_back(tok);
      // f[0] is field 3 (state): utime is field 14, stime 15, rss 24.
      if (f.size() > 21) {
        const double cpu = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(ticks);
        gauge("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
              prometheus::MetricType::Counter, cpu);
        gauge("process_resident_memory_bytes", "Resident memory size in bytes.",
              prometheus::MetricType::Gauge, std::stod(f[21]) * static_cast<double>(page));
        gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.",
              prometheus::MetricType::Gauge, std::stod(f[20]));
      }
    }
    gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
          prometheus::MetricType::Gauge, start_unix_seconds_);
    int fds = 0;
    if (DIR* dir = opendir("/proc/self/fd"); dir != nullptr) {
      while (readdir(dir) != nullptr) ++fds;
      closedir(dir);
      fds -= 2;  // . and ..
    }
    gauge("process_open_fds", "Number of open file descriptors.", prometheus::MetricType::Gauge, fds);
    return out;
  }

 private:
  double start_unix_seconds_;
};

}  // namespace

RpcMetrics::RpcMetrics(prometheus::Registry& registry)
    : duration_(prometheus::BuildHistogram()
                    .Name("geotrain_rpc_duration_seconds")
                    .Help("Time spent serving an RPC, by method")
                    .Register(registry)),
      total_(prometheus::BuildCounter()
                 .Name("geotrain_rpc_total")
                 .Help("RPCs served, by method and gRPC status code")
                 .Register(registry)) {}

void RpcMetrics::Observe(const std::string& method, int grpc_code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  duration_.Add({{"method", method}}, kBuckets).Observe(seconds);
  total_.Add({{"method", method}, {"code", std::to_string(grpc_code)}}).Increment();
}

RpcTimer::~RpcTimer() {
  if (metrics_ == nullptr) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  metrics_->Observe(method_, code_, seconds);
}

MetricsServer::MetricsServer()
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(std::make_shared<ProcessCollector>()),
      rpc_(*registry_) {}

MetricsServer::~MetricsServer() = default;

absl::Status MetricsServer::Start(const std::string& bind_address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(bind_address, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", bind_address, ": ", e.what(),
                                               "; the port may be in use: choose another with "
                                               "--metrics-port"));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(process_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports[0];
  return absl::OkStatus();
}

prometheus::Family<prometheus::Gauge>& MetricsServer::Gauges(const std::string& name,
                                                             const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
}

prometheus::Family<prometheus::Counter>& MetricsServer::Counters(const std::string& name,
                                                                 const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
}

}  // namespace geotrain
