// Prometheus metrics for geotrain processes: one registry per process (prometheus-cpp core), served in the text
// format over HTTP by a small built-in server (GET /metrics; many clients at once, within the limits below;
// Debian's civetweb-based exposer crashes on the first scrape, see docs/architecture.md), with the process basics
// (CPU seconds, resident memory, start time, open file descriptors) read from /proc on each scrape, and RPC counts
// and latencies per method.
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
#include <thread>
#include <vector>

#include "absl/status/status.h"

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

// The metrics server's limits. It serves many clients at once from one thread (non-blocking sockets, poll), so a
// slow or silent client holds only its own connection: each connection is closed kMetricsConnectionTimeout after
// it was accepted, whatever state it is in; beyond kMetricsMaxConnections open connections a new one is answered
// 503 and closed at once; a request head is read up to kMetricsMaxRequestBytes (then answered as it is).
inline constexpr int kMetricsMaxConnections = 64;
inline constexpr size_t kMetricsMaxRequestBytes = 16 * 1024;
inline constexpr int kMetricsConnectionTimeoutMs = 5000;

// Serves GET /metrics over HTTP/1.1 (one request per connection). Threads: Start and the destructor from one
// thread; the registry and families are thread-safe; the serving thread is the server's own.
class MetricsServer {
 public:
  MetricsServer();
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Starts serving /metrics on `bind_address` (host:port). Port 0 picks a free port.
  absl::Status Start(const std::string& bind_address);
  int port() const { return port_; }

  prometheus::Registry& registry() { return *registry_; }
  RpcMetrics* rpc() { return &rpc_; }
  prometheus::Family<prometheus::Gauge>& Gauges(const std::string& name, const std::string& help);
  prometheus::Family<prometheus::Counter>& Counters(const std::string& name, const std::string& help);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  RpcMetrics rpc_;
  struct Connection;
  void ServeLoop();
  std::string Scrape();
  // Accepts every pending connection (non-blocking), answering 503 beyond kMetricsMaxConnections.
  void AcceptAll(std::vector<Connection>* connections);
  // Reads or writes what `c` is ready for; false once the connection is done (to be closed).
  bool Progress(Connection* c);

  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: the destructor writes to wake the serving thread
  int port_ = 0;
  std::thread server_thread_;  // owns the listening socket and every connection
};

}  // namespace geotrain
