// Prometheus metrics for geotrain processes: one registry per process (prometheus-cpp core), served in the text
// format over HTTP by a small built-in server (GET /metrics; many clients at once, within the limits below;
// Debian's civetweb-based exposer crashes on the first scrape, see docs/architecture.md), with the process basics
// (CPU seconds, resident memory, start time, open file descriptors) read from /proc on each scrape, and RPC counts
// and latencies per method. The HTTP server itself is common/http_server.h's.
//
//   MetricsServer metrics;
//   absl::Status s = metrics.Start("0.0.0.0:9470");     // port 0 picks a free one; see port()
//   auto& jobs = metrics.Gauges("geotrain_jobs", "Jobs by state");
//   jobs.Add({{"state", "PENDING"}}).Set(3);
//   { RpcTimer t(metrics.rpc(), "SubmitJob"); ... t.set_code(status.error_code()); }
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/http_server.h"

namespace geotrain {

// RPC count and latency families: geotrain_rpc_duration_seconds{method} (histogram) and
// geotrain_rpc_total{method,code}. prometheus-cpp's families are thread-safe.
class RpcMetrics {
 public:
  explicit RpcMetrics(prometheus::Registry& registry);
  void Observe(const std::string& method, int grpc_code, double seconds);

 private:
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Counter>& total_;
};

// Times one RPC handler and records it when it goes out of scope.
class RpcTimer {
 public:
  RpcTimer(RpcMetrics* metrics, const char* method)
      : metrics_(metrics), method_(method), start_(std::chrono::steady_clock::now()) {}
  ~RpcTimer();
  RpcTimer(const RpcTimer&) = delete;
  RpcTimer& operator=(const RpcTimer&) = delete;
  void set_code(int code) { code_ = code; }

 private:
  RpcMetrics* metrics_;
  const char* method_;
  std::chrono::steady_clock::time_point start_;
  int code_ = 0;
};

// The metrics server's whole HTTP answer to one request head (the bytes read from a connection, at most
// 16 KiB, possibly partial or garbage): 200 with `scrape()` for GET /metrics and GET /, 404 for other GETs,
// 405 otherwise; always a complete HTTP/1.1 response with Content-Length and Connection: close. Pure (fuzzed:
// fuzz/metrics_http_fuzzer.cc).
std::string MetricsHttpResponse(std::string_view request, const std::function<std::string()>& scrape);

// The metrics server's limits (common/http_server.h serves it). It serves many clients at once from one thread
// (non-blocking sockets, poll), so a slow or silent client holds only its own connection: each connection is closed
// kMetricsConnectionTimeout after it was accepted while it reads or writes; beyond kMetricsMaxConnections open
// connections a new one is answered 503 and closed at once; a request head is read up to kMetricsMaxRequestBytes
// (then answered as it is).
inline constexpr int kMetricsMaxConnections = 64;
inline constexpr size_t kMetricsMaxRequestBytes = 16 * 1024;
inline constexpr int kMetricsConnectionTimeoutMs = 5000;

// Serves GET /metrics over HTTP/1.1 (one request per connection), and, when given, other paths next to it (the
// head's dashboard). Threads: Start and the destructor from one thread; the registry and families are thread-safe;
// the serving thread and its handler pool are the server's own.
class MetricsServer {
 public:
  MetricsServer();
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Starts serving /metrics on `bind_address` (host:port). Port 0 picks a free port. With `others`, every request
  // whose head parses and whose path is not /metrics goes to `others` instead (bodies up to others_max_body_bytes
  // are read for it); without, the answers are MetricsHttpResponse's.
  absl::Status Start(const std::string& bind_address, HttpHandler others = nullptr, size_t others_max_body_bytes = 0);
  int port() const { return http_ ? http_->port() : 0; }

  prometheus::Registry& registry() { return *registry_; }
  RpcMetrics* rpc() { return &rpc_; }
  prometheus::Family<prometheus::Gauge>& Gauges(const std::string& name, const std::string& help);
  prometheus::Family<prometheus::Counter>& Counters(const std::string& name, const std::string& help);

 private:
  std::string Scrape();

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  RpcMetrics rpc_;
  std::unique_ptr<HttpServer> http_;  // last: stopped first, while the registry is still there
};

}  // namespace geotrain
