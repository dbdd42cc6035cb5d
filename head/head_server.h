// The head daemon: one per cluster. On one port it serves the public API (head/public_api.h: geotrain.v1 Jobs,
// Cluster and Planner, what the CLI and clients call) and the internal HeadControl service (workers register,
// heartbeat and ask to drain, actors report steps and exchange NCCL unique ids through its rendezvous); it runs the failure
// detector, keeps the job table, persists its state
// under the state dir, serves Prometheus metrics and its web dashboard (head/dashboard.h), and records its address
// and token so that the CLI on this machine finds it with no flags.
//
//   HeadOptions options;  options.state_dir = "/var/lib/geotrain";
//   HeadServer head(options);
//   if (absl::Status s = head.Start(); !s.ok()) { ... }
//   head.Wait();  // until Shutdown() from another thread (e.g. on SIGTERM)
//
// Its server also carries DataStaging (head/staging_service.h): the token shards workers stage, and the checkpoint
// files actors copy to checkpoint.dir on this machine.
//
// Threads: gRPC's sync server threads run the handlers; they call the registry, job manager, job
// runner and rendezvous table, which lock their own state (FetchRendezvous blocks its handler thread for
// up to 60 s). One detector thread only detects: it calls CheckLiveness() (probing silent workers) and
// hands each death to the job runner, which queues it; the job runner's own control thread plans, places,
// launches, restarts and reconciles jobs, with the RPCs to workers on its executor, then drops the
// rendezvous keys of ended jobs and refreshes metrics. So neither a slow plan nor a slow worker delays
// detection. Shutdown() stops the detector, the job runner, then the server.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "head/dashboard.h"
#include "head/job_manager.h"
#include "head/job_runner.h"
#include "head/public_api.h"
#include "head/registry.h"
#include "head/rendezvous.h"
#include "head/staging_service.h"
#include "head/store.h"

namespace geotrain::head {

// HeadOptions::dashboard_port's default: the dashboard shares the metrics port.
inline constexpr int kDashboardOnMetricsPort = -2;

struct HeadOptions {
  std::string bind_host = "0.0.0.0";
  int port = 6380;
  int metrics_port = 9470;     // -1 disables metrics; 0 picks a free port
  std::string advertise_host;  // host written to the cluster record; default 127.0.0.1
  std::string metrics_bind;    // address /metrics listens on; default the advertised host (never 0.0.0.0 unasked)
  std::string state_dir;       // required
  std::string token;           // empty: reuse <state_dir>/token or make a new one
  int64_t heartbeat_interval_ms = 1000;
  int64_t heartbeat_timeout_ms = 4000;
  // A silent worker whose port still answers, or that cannot be reached, is declared dead after this long
  // (one whose port refuses connections at the heartbeat timeout): head/liveness_probe.h.
  int64_t unreachable_timeout_ms = 30000;
  TlsFiles tls;  // one configuration for the head's server and its calls to workers (common/rpc.h)
  bool write_cluster_record = true;
  // The web dashboard (head/dashboard.h), where /metrics listens: kDashboardOnMetricsPort serves it on the metrics
  // port, except under TLS, where /metrics stays plaintext for Prometheus and the dashboard gets HTTPS on a free port
  // of its own; 0: a free port of its own; N: port N (HTTPS under TLS); -1: no dashboard.
  int dashboard_port = kDashboardOnMetricsPort;
  std::string topology_file;  // the cluster's topology file: its links are the configured ones (optional)
};

// Options for a head inside a test's or a benchmark's process: loopback, a free port (port() after Start),
// no metrics, no cluster record.
HeadOptions InProcessHeadOptions(std::string state_dir, std::string token);

class HeadServer {
 public:
  explicit HeadServer(HeadOptions options, const Clock* clock = RealClock::Get());
  ~HeadServer();
  HeadServer(const HeadServer&) = delete;
  HeadServer& operator=(const HeadServer&) = delete;

  // Opens the state, binds the ports and starts serving. Errors name the cause and the fix
  // (port in use, unwritable state dir, bad TLS files).
  absl::Status Start();
  void Wait();
  void Shutdown();

  int port() const { return port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  const std::string& head_id() const { return head_id_; }
  const std::string& token() const { return token_; }
  // The dashboard's address ("http://127.0.0.1:9470/"; https under TLS), "" when it is not served.
  const std::string& dashboard_url() const { return dashboard_url_; }
  bool IsStopping();
  // A worker leaves on notice (the public Cluster.DrainWorker, and a worker's own SIGTERM through HeadControl): it
  // is marked draining, persisted, and the job runner drains its jobs (head/job_drain.h). Errors: the registry's
  // (NOT_FOUND, FAILED_PRECONDITION for a dead worker).
  absl::StatusOr<WorkerInfo> DrainWorker(const std::string& worker_id);

 private:
  class Service;
  void DetectorLoop();
  void RefreshMetrics();
  void WriteScrapeTargets();
  // What the public API calls (the components, and the head's answers about itself).
  PublicApi::Components PublicComponents(std::vector<v1::ConfiguredLink> configured_links);
  // Starts /metrics and the dashboard (on the metrics port, or its own server), and reads the topology's links.
  absl::Status StartHttp(std::vector<v1::ConfiguredLink>* configured_links);
  // Starts the dashboard's own server when it has one (not on the metrics port), and sets dashboard_url_.
  absl::Status StartDashboard();
  // Where /metrics and the dashboard listen: --metrics-bind, else the advertised host, else 127.0.0.1.
  std::string HttpBindHost() const;
  // The host part of the URLs the head prints: the HTTP servers' address, or the advertised host.
  std::string UrlHost() const;

  HeadOptions options_;
  const Clock* clock_;
  std::string head_id_;
  std::string token_;
  std::string metrics_host_;  // the address /metrics listens on
  int port_ = 0;
  int64_t started_unix_ms_ = 0;

  std::unique_ptr<HeadStore> store_;
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<MetricsServer> metrics_;
  std::unique_ptr<JobRunner> runner_;
  std::unique_ptr<RendezvousTable> rendezvous_;  // values a job's actors exchange (NCCL unique ids)
  std::unique_ptr<Service> service_;             // internal.proto's HeadControl
  std::unique_ptr<PublicApi> public_api_;
  std::unique_ptr<HeadStagingService> staging_;  // shards to workers, checkpoint files from actors
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<Dashboard> dashboard_;          // shared with the HTTP server that serves it
  std::unique_ptr<HttpServer> dashboard_server_;  // when it has a port of its own
  std::string dashboard_url_;

  absl::Mutex targets_mu_;  // RefreshMetrics runs on handler threads and the detector thread
  std::string scrape_targets_ ABSL_GUARDED_BY(targets_mu_);  // last written prometheus_targets.json
  absl::Mutex stop_mu_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool detector_kicked_ ABSL_GUARDED_BY(stop_mu_) = false;  // a suspect worker: check liveness now
  std::thread detector_;
};

}  // namespace geotrain::head
