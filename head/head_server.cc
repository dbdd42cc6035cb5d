// The head daemon: gRPC adapter, failure detector thread, metrics and the cluster record.
#include "head/head_server.h"

#include <unistd.h>

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/names.h"
#include "common/rpc_call.h"
#include "common/status.h"
#include "head/dashboard_figures.h"
#include "head/scrape_targets.h"
#include "internal.grpc.pb.h"

namespace geotrain::head {

// The internal service (workers and actors): checks the token, times the call, and forwards to the components.
// The public services (Jobs, Cluster, Planner) are head/public_api.h's.
class HeadServer::Service final : public internal::HeadControl::Service {
 public:
  explicit Service(HeadServer* head) : head_(head), auth_(head->token_) {}

  grpc::Status RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                              RegisterWorkerReply* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "RegisterWorker");
    if (!call.authorized()) return call.status();
    if (request->site().empty() || request->address().empty()) {
      return call.Fail(absl::InvalidArgumentError(
          "RegisterWorker: site and address are required; start the worker with --site NAME"));
    }
    if (request->devices_size() > 1024) {
      return call.Fail(absl::InvalidArgumentError("RegisterWorker: more than 1024 devices"));
    }
    WorkerInfo stored;
    *reply = head_->registry_->Register(*request, &stored);
    if (absl::Status s = head_->store_->PutWorker(stored); !s.ok()) {
      GT_LOG(ERROR) << "persisting worker " << stored.worker_id() << ": " << s;
    }
    head_->runner_->Kick();  // a job waiting for workers may fit now
    head_->RefreshMetrics();
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* context, const HeartbeatRequest* request,
                         HeartbeatReply* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "Heartbeat");
    if (!call.authorized()) return call.status();
    *reply = head_->registry_->Heartbeat(*request);
    return grpc::Status::OK;
  }

  grpc::Status ReportStep(grpc::ServerContext* context, const StepReport* request, ReportStepReply* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "ReportStep");
    if (!call.authorized()) return call.status();
    if (request->job_id().empty() || request->actor_id().empty()) {
      return call.Fail(absl::InvalidArgumentError("ReportStep: job_id and actor_id are required"));
    }
    *reply = head_->runner_->OnStepReport(*request);
    return grpc::Status::OK;
  }

  grpc::Status DrainWorker(grpc::ServerContext* context, const DrainWorkerRequest* request,
                           WorkerInfo* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "DrainWorker");
    if (!call.authorized()) return call.status();
    absl::StatusOr<WorkerInfo> worker = head_->DrainWorker(request->worker_id());
    if (!worker.ok()) return call.Fail(worker.status());
    *reply = *std::move(worker);
    return grpc::Status::OK;
  }

  grpc::Status Ping(grpc::ServerContext* context, const PingRequest* request, PingReply* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "Ping");
    if (!call.authorized()) return call.status();
    EchoPing(*request, reply);
    return grpc::Status::OK;
  }

  grpc::Status PingStream(grpc::ServerContext* context,
                          grpc::ServerReaderWriter<PingReply, PingRequest>* stream) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "PingStream");
    if (!call.authorized()) return call.status();
    EchoPingStream(stream);
    return grpc::Status::OK;
  }

  grpc::Status PublishRendezvous(grpc::ServerContext* context, const PublishRendezvousRequest* request,
                                 PublishRendezvousReply*) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "PublishRendezvous");
    if (!call.authorized()) return call.status();
    if (absl::Status s = head_->rendezvous_->Publish(request->job_id(), request->key(), request->value()); !s.ok()) {
      return call.Fail(s);
    }
    return grpc::Status::OK;
  }

  grpc::Status FetchRendezvous(grpc::ServerContext* context, const FetchRendezvousRequest* request,
                               FetchRendezvousReply* reply) override {
    RpcCall call(head_->metrics_.get(), auth_, context, "FetchRendezvous");
    if (!call.authorized()) return call.status();
    auto value = head_->rendezvous_->Fetch(request->job_id(), request->key(), absl::Milliseconds(request->timeout_ms()),
                                           [context] { return context->IsCancelled(); });
    if (!value.ok()) return call.Fail(value.status());
    reply->set_value(std::move(*value));
    return grpc::Status::OK;
  }

 private:
  HeadServer* head_;
  TokenAuth auth_;
};

HeadOptions InProcessHeadOptions(std::string state_dir, std::string token) {
  HeadOptions options;
  options.bind_host = "127.0.0.1";
  options.port = 0;
  options.metrics_port = -1;
  options.state_dir = std::move(state_dir);
  options.token = std::move(token);
  options.write_cluster_record = false;
  return options;
}

HeadServer::HeadServer(HeadOptions options, const Clock* clock) : options_(std::move(options)), clock_(clock) {}

HeadServer::~HeadServer() { Shutdown(); }

bool HeadServer::IsStopping() {
  absl::MutexLock lock(&stop_mu_);
  return stopping_;
}

absl::Status HeadServer::Start() {
  if (options_.state_dir.empty()) {
    return absl::InvalidArgumentError("head: no state dir; pass --state-dir DIR");
  }
  RETURN_IF_ERROR(ValidateNodeTls(options_.tls, "head"));
  auto store = HeadStore::Open(options_.state_dir);
  if (!store.ok()) return store.status();
  store_ = std::move(*store);

  // The token survives restarts so that workers and users keep theirs.
  const std::string token_path = absl::StrCat(options_.state_dir, "/token");
  token_ = options_.token;
  if (token_.empty()) {
    if (auto existing = ReadSmallFile(token_path); existing.ok() && !existing->empty()) {
      token_ = std::string(absl::StripTrailingAsciiWhitespace(*existing));
    } else {
      token_ = GenerateToken();
    }
  }
  if (absl::Status s = WriteFileAtomically(token_path, token_ + "\n", 0600); !s.ok()) return s;

  // A new head id per start: workers that see it change register again.
  head_id_ = GenerateId("h");
  started_unix_ms_ = clock_->UnixMillis();
  registry_ = std::make_unique<WorkerRegistry>(
      clock_,
      WorkerRegistry::Options{options_.heartbeat_interval_ms, options_.heartbeat_timeout_ms,
                              options_.unreachable_timeout_ms},
      head_id_);
  auto workers = store_->LoadWorkers();
  if (!workers.ok()) return workers.status();
  registry_->Restore(*workers);
  registry_->set_on_suspect([this] {
    absl::MutexLock lock(&stop_mu_);
    detector_kicked_ = true;
  });
  jobs_ = std::make_unique<JobManager>(clock_, store_.get());
  if (absl::Status s = jobs_->Restore(); !s.ok()) return s;
  rendezvous_ = std::make_unique<RendezvousTable>([this](const std::string& job_id) -> absl::Status {
    auto job = jobs_->Get(job_id);
    if (!job.ok()) return job.status();
    if (IsTerminal(job->state())) {
      return absl::FailedPreconditionError(
          absl::StrCat("rendezvous: job ", job_id, " has ended (", JobStateName(job->state()), ")"));
    }
    return absl::OkStatus();
  });

  std::vector<v1::ConfiguredLink> configured_links;
  RETURN_IF_ERROR(StartHttp(&configured_links));

  JobRunnerOptions runner_options;
  runner_options.token = token_;
  runner_options.tls = options_.tls;
  // An alive worker that stops listing an actor in its heartbeats has lost it (e.g. it restarted).
  runner_options.actor_lost_after_ms = std::max<int64_t>(8000, 4 * options_.heartbeat_interval_ms);
  runner_options.drain_checkpoint_root = absl::StrCat(options_.state_dir, "/checkpoints");
  runner_ = std::make_unique<JobRunner>(jobs_.get(), registry_.get(), metrics_.get(), runner_options, clock_);
  // Jobs that were running when the head went away go on: their actors report to this head.
  runner_->Restore();
  auto creds = MakeServerCredentials(options_.tls);
  if (!creds.ok()) return creds.status();
  service_ = std::make_unique<Service>(this);
  public_api_ = std::make_unique<PublicApi>(PublicComponents(std::move(configured_links)), token_);
  dashboard_->Attach(public_api_.get());
  staging_ = std::make_unique<HeadStagingService>(
      token_, options_.state_dir,
      HeadStagingService::Hooks{.get_job = [this](const std::string& job_id) { return jobs_->Get(job_id); },
                                .log =
                                    [this](const std::string& job_id, const std::string& line) {
                                      if (absl::Status s = jobs_->Log(job_id, line); !s.ok())
                                        GT_LOG(WARNING) << "job " << job_id << ": " << s;
                                    }},
      metrics_.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options_.bind_host, ":", options_.port), *creds, &port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use must fail, not be shared
  builder.RegisterService(service_.get());
  public_api_->RegisterWith(&builder);
  builder.RegisterService(staging_.get());
  builder.SetMaxReceiveMessageSize(16 << 20);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("head: cannot listen on ", options_.bind_host, ":", options_.port,
                                               " (port in use?); choose another with --port"));
  }
  const std::string host = options_.advertise_host.empty() ? "127.0.0.1" : options_.advertise_host;
  if (options_.write_cluster_record) {
    ClusterRecord record;
    record.address = absl::StrCat(host, ":", port_);
    record.token_file = token_path;
    record.metrics_address = metrics_ ? absl::StrCat(host, ":", metrics_->port()) : "";
    record.state_dir = options_.state_dir;
    record.pid = getpid();
    record.tls = options_.tls;
    if (absl::Status s = WriteClusterRecord(record); !s.ok()) {
      GT_LOG(WARNING) << "could not record the cluster for the CLI: " << s;
    }
  }
  RefreshMetrics();
  runner_->Start([this] {
    rendezvous_->DropEndedJobs();
    RefreshMetrics();
  });
  detector_ = std::thread([this] { DetectorLoop(); });
  GT_LOG(INFO) << "head " << head_id_ << " serving on " << host << ":" << port_ << ", metrics on port "
               << metrics_port() << ", dashboard at " << (dashboard_url_.empty() ? "(none)" : dashboard_url_)
               << ", state in " << options_.state_dir << ", " << workers->size() << " known worker(s), "
               << jobs_->List().size() << " job(s)";
  return absl::OkStatus();
}

PublicApi::Components HeadServer::PublicComponents(std::vector<v1::ConfiguredLink> configured_links) {
  PublicApi::Components components;
  components.registry = registry_.get();
  components.jobs = jobs_.get();
  components.runner = runner_.get();
  components.metrics = metrics_.get();
  components.head_id = head_id_;
  components.started_unix_ms = started_unix_ms_;
  components.stopping = [this] { return IsStopping(); };
  components.changed = [this] { RefreshMetrics(); };
  components.drain_worker = [this](const std::string& worker_id) { return DrainWorker(worker_id); };
  components.dashboard_url = dashboard_url_;
  if (metrics_) components.metrics_url = absl::StrCat("http://", UrlHost(), ":", metrics_->port(), "/metrics");
  components.topology_file = options_.topology_file;
  components.configured_links = std::move(configured_links);
  return components;
}

absl::StatusOr<WorkerInfo> HeadServer::DrainWorker(const std::string& worker_id) {
  ASSIGN_OR_RETURN(WorkerInfo worker, registry_->SetDraining(worker_id));
  // Persisted, so that a restarted head places nothing on it either.
  if (absl::Status s = store_->PutWorker(worker); !s.ok()) {
    GT_LOG(ERROR) << "persisting worker " << worker.worker_id() << ": " << s;
  }
  runner_->Kick();  // its jobs' drains start now (JobRunner::CheckDrains)
  return worker;
}

absl::Status HeadServer::StartHttp(std::vector<v1::ConfiguredLink>* configured_links) {
  dashboard_ = std::make_shared<Dashboard>(DashboardOptions{.token = token_, .tls = options_.tls.enabled()});
  if (options_.metrics_port >= 0) {
    metrics_ = std::make_unique<MetricsServer>();
    const std::string metrics_host = HttpBindHost();
    // The dashboard shares the port unless the head has TLS (HTTPS on a port of its own) or was given a port for it.
    const bool with_dashboard = options_.dashboard_port == kDashboardOnMetricsPort && !options_.tls.enabled();
    HttpHandler dashboard = [d = dashboard_](const HttpRequest& r, std::string_view raw) { return d->Handle(r, raw); };
    RETURN_IF_ERROR(metrics_->Start(absl::StrCat(metrics_host, ":", options_.metrics_port),
                                    with_dashboard ? dashboard : nullptr, kDashboardMaxBodyBytes));
    metrics_host_ = metrics_host;
  }
  RETURN_IF_ERROR(StartDashboard());
  if (!options_.topology_file.empty()) {
    auto links = ConfiguredLinksOf(options_.topology_file);
    if (!links.ok()) return WithContext(links.status(), "head: --topology");
    *configured_links = *std::move(links);
  }
  return absl::OkStatus();
}

std::string HeadServer::HttpBindHost() const {
  return !options_.metrics_bind.empty()     ? options_.metrics_bind
         : !options_.advertise_host.empty() ? options_.advertise_host
                                            : "127.0.0.1";
}

std::string HeadServer::UrlHost() const {
  // What a browser on this machine or the cluster's network dials: the address the HTTP servers listen on, unless
  // that is every address.
  const std::string host = HttpBindHost();
  if (host == "0.0.0.0" || host == "::") return options_.advertise_host.empty() ? "127.0.0.1" : options_.advertise_host;
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
}

absl::Status HeadServer::StartDashboard() {
  const bool on_metrics_port = options_.dashboard_port == kDashboardOnMetricsPort && !options_.tls.enabled();
  if (options_.dashboard_port == -1 || (on_metrics_port && !metrics_)) return absl::OkStatus();
  const char* scheme = options_.tls.enabled() ? "https" : "http";
  if (on_metrics_port) {
    dashboard_url_ = absl::StrCat(scheme, "://", UrlHost(), ":", metrics_->port(), "/");
    return absl::OkStatus();
  }
  HttpServerOptions http;
  http.max_body_bytes = kDashboardMaxBodyBytes;
  http.handler_threads = 3;
  http.tls = {.cert = options_.tls.cert,
              .key = options_.tls.key,
              .ca = options_.tls.ca,
              .require_client_cert = options_.tls.require_client_cert};
  const std::string host = HttpBindHost();
  const int port = options_.dashboard_port == kDashboardOnMetricsPort ? 0 : options_.dashboard_port;
  dashboard_server_ = std::make_unique<HttpServer>();
  absl::Status started = dashboard_server_->Start(
      absl::StrCat(host, ":", port), http,
      [d = dashboard_](const HttpRequest& r, std::string_view raw) { return d->Handle(r, raw); });
  if (!started.ok()) {
    dashboard_server_.reset();
    return absl::Status(started.code(), absl::StrCat("head: cannot serve the dashboard: ", started.message(),
                                                     "; choose another port with --dashboard-port (-1: none)"));
  }
  dashboard_url_ = absl::StrCat(scheme, "://", UrlHost(), ":", dashboard_server_->port(), "/");
  return absl::OkStatus();
}

void HeadServer::DetectorLoop() {
  // Detection only: checking at a quarter of the timeout bounds detection time by timeout + timeout / 4
  // (+ a probe of at most 0.5 s); what a death means for jobs is the job runner's, on its own thread.
  const int64_t period =
      std::max<int64_t>(50, std::min(options_.heartbeat_interval_ms, options_.heartbeat_timeout_ms / 4));
  const WorkerRegistry::Probe probe = [](const std::vector<std::string>& addresses) {
    return ProbeTcp(addresses, absl::Milliseconds(500));
  };
  absl::MutexLock lock(&stop_mu_);
  while (!stopping_) {
    stop_mu_.AwaitWithTimeout(absl::Condition(
                                  +[](HeadServer* h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(h->stop_mu_) {
                                    return h->stopping_ || h->detector_kicked_;
                                  },
                                  this),
                              absl::Milliseconds(period));
    if (stopping_) break;
    detector_kicked_ = false;
    stop_mu_.Unlock();
    for (const WorkerInfo& dead : registry_->CheckLiveness(probe)) {
      if (absl::Status s = store_->PutWorker(dead); !s.ok()) {
        GT_LOG(ERROR) << "persisting worker " << dead.worker_id() << ": " << s;
      }
      runner_->OnWorkerDead(dead);
    }
    stop_mu_.Lock();
  }
}

void HeadServer::WriteScrapeTargets() {
  // Prometheus file-based discovery: the head and every alive worker's metrics endpoint, by site.
  const std::string json = ScrapeTargetsJson(
      metrics_ ? absl::StrCat(metrics_host_ == "0.0.0.0"
                                  ? (options_.advertise_host.empty() ? "127.0.0.1" : options_.advertise_host)
                                  : metrics_host_,
                              ":", metrics_->port())
               : std::string(),
      registry_->Workers());
  absl::MutexLock lock(&targets_mu_);
  if (json == scrape_targets_) return;
  if (WriteFileAtomically(absl::StrCat(options_.state_dir, "/prometheus_targets.json"), json, 0644).ok()) {
    scrape_targets_ = json;
  }
}

void HeadServer::RefreshMetrics() {
  WriteScrapeTargets();
  if (!metrics_) return;
  auto& workers = metrics_->Gauges("geotrain_workers", "Workers known to the head, by site and state");
  auto& devices = metrics_->Gauges("geotrain_devices", "Devices of alive workers, by site and kind");
  auto& tflops = metrics_->Gauges("geotrain_device_tflops", "Sum of device TFLOP/s of alive workers, by site");
  auto& jobs = metrics_->Gauges("geotrain_jobs", "Jobs by state");
  metrics_->Gauges("geotrain_head_state_writable", "1 when the head's last write of its state succeeded, else 0")
      .Add({})
      .Set(jobs_->store_error().ok() ? 1 : 0);
  auto& actors = metrics_->Gauges("geotrain_actors", "Actors by state");
  std::map<std::pair<std::string, std::string>, int> worker_counts;
  std::map<std::pair<std::string, std::string>, int> device_counts;
  std::map<std::string, double> site_tflops;
  for (const WorkerInfo& w : registry_->Workers()) {
    worker_counts[{w.site(), "ALIVE"}] += 0;
    worker_counts[{w.site(), "DEAD"}] += 0;
    ++worker_counts[{w.site(), WorkerStateName(w.state())}];
    site_tflops[w.site()] += 0;
    for (const Device& d : w.devices()) {
      device_counts[{w.site(), DeviceKindName(d.kind())}] += w.state() == WORKER_ALIVE ? 1 : 0;
      if (w.state() == WORKER_ALIVE) site_tflops[w.site()] += d.tflops();
    }
  }
  for (const auto& [key, n] : worker_counts) workers.Add({{"site", key.first}, {"state", key.second}}).Set(n);
  for (const auto& [key, n] : device_counts) devices.Add({{"site", key.first}, {"kind", key.second}}).Set(n);
  for (const auto& [site, t] : site_tflops) tflops.Add({{"site", site}}).Set(t);
  for (const auto& [state, n] : jobs_->CountByState()) jobs.Add({{"state", JobStateName(state)}}).Set(n);
  std::map<std::string, int> actor_counts = {{"PENDING_CREATION", 0}, {"ALIVE", 0}, {"DEAD", 0}};
  for (const ActorRecord& a : registry_->Actors()) ++actor_counts[ActorStateName(a.state())];
  for (const auto& [state, n] : actor_counts) actors.Add({{"state", state}}).Set(n);
}

void HeadServer::Wait() {
  if (server_) server_->Wait();
}

void HeadServer::Shutdown() {
  {
    absl::MutexLock lock(&stop_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (dashboard_) dashboard_->Detach();  // before the components it reads go
  dashboard_server_.reset();
  if (detector_.joinable()) detector_.join();
  if (rendezvous_) rendezvous_->Shutdown();  // wakes waiting fetches before the server drains
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  // After the server: a handler in flight (ReportStep, CancelJob) may still call the runner and its executor.
  if (runner_) runner_->Shutdown();
  if (options_.write_cluster_record) RemoveClusterRecordIfOwned(getpid());
  GT_LOG(INFO) << "head " << head_id_ << " stopped";
}

}  // namespace geotrain::head
