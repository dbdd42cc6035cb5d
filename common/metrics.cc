// Metrics server (on common/http_server.h), RPC metrics and a /proc-based process collector.
#include "common/metrics.h"

#include <dirent.h>
#include <prometheus/text_serializer.h>
#include <unistd.h>

#include <chrono>
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
        gauge("process_resident_memory_bytes", "Resident memory size in bytes.", prometheus::MetricType::Gauge,
              std::stod(f[21]) * static_cast<double>(page));
        gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", prometheus::MetricType::Gauge,
              std::stod(f[20]));
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
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  metrics_->Observe(method_, code_, seconds);
}

MetricsServer::MetricsServer()
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(std::make_shared<ProcessCollector>()),
      rpc_(*registry_) {}

MetricsServer::~MetricsServer() = default;

absl::Status MetricsServer::Start(const std::string& bind_address, HttpHandler others, size_t others_max_body_bytes) {
  HttpServerOptions options;
  options.max_connections = kMetricsMaxConnections;
  options.max_head_bytes = kMetricsMaxRequestBytes;
  options.connection_timeout_ms = kMetricsConnectionTimeoutMs;
  options.max_body_bytes = others ? others_max_body_bytes : 0;
  options.handler_threads = others ? 3 : 1;  // a slow page (a plan) leaves threads for the scrapes
  auto http = std::make_unique<HttpServer>();
  absl::Status started =
      http->Start(bind_address, options, [this, others](const HttpRequest& request, std::string_view raw_head) {
        if (others && !request.method.empty() && request.path != "/metrics") return others(request, raw_head);
        return MetricsHttpResponse(raw_head, [this] { return Scrape(); });
      });
  if (!started.ok()) {
    return absl::Status(started.code(), absl::StrCat("cannot serve metrics: ", started.message(),
                                                     "; choose another port with --metrics-port"));
  }
  http_ = std::move(http);
  return absl::OkStatus();
}

std::string MetricsServer::Scrape() {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> process = process_->Collect();
  families.insert(families.end(), process.begin(), process.end());
  return prometheus::TextSerializer().Serialize(families);
}

std::string MetricsHttpResponse(std::string_view request, const std::function<std::string()>& scrape) {
  std::string status = "200 OK", body;
  if (request.starts_with("GET /metrics") || request.starts_with("GET / ")) {
    body = scrape();
  } else if (request.starts_with("GET ")) {
    status = "404 Not Found";
    body = "geotrain serves metrics at /metrics\n";
  } else {
    status = "405 Method Not Allowed";
    body = "only GET /metrics\n";
  }
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n",
                      "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

prometheus::Family<prometheus::Gauge>& MetricsServer::Gauges(const std::string& name, const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
}

prometheus::Family<prometheus::Counter>& MetricsServer::Counters(const std::string& name, const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
}

}  // namespace geotrain
