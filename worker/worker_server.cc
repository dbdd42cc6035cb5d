// Worker daemon: Worker service adapter, the join/heartbeat loop with backoff, actor table.
#include "worker/worker_server.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/names.h"
#include "common/rpc_call.h"
#include "common/spec.h"
#include "common/status.h"
#include "worker/checkpoint_store.h"
#include "worker/devices.h"

namespace geotrain::worker {

class WorkerServer::Service final : public internal::Worker::Service {
 public:
  Service(WorkerServer* worker, const std::string& token, MetricsServer* metrics)
      : worker_(worker), auth_(token), metrics_(metrics) {}

  grpc::Status CreateActor(grpc::ServerContext* context, const CreateActorRequest* request,
                           CreateActorReply* reply) override {
    RpcCall call(metrics_, auth_, context, "CreateActor");
    if (!call.authorized()) return call.status();
    const ActorRecord& a = request->actor();
    if (a.actor_id().empty() || a.job_id().empty()) {
      return call.Fail(absl::InvalidArgumentError("CreateActor: actor_id and job_id are required"));
    }
    if (a.device_index() < 0 || a.device_index() >= static_cast<int>(worker_->devices_.size())) {
      return call.Fail(absl::InvalidArgumentError(absl::StrCat("CreateActor: device_index ", a.device_index(),
                                                               " out of range [0, ", worker_->devices_.size(), ")")));
    }
    // Everything the actor will index with comes from the network: check it all first.
    const ParallelSpec& plan = request->spec().parallel();
    auto invalid = [&call](const std::string& why) {
      return call.Fail(absl::InvalidArgumentError(absl::StrCat("CreateActor: ", why)));
    };
    if (absl::Status s = ValidateJobSpec(request->spec()); !s.ok()) return invalid(std::string(s.message()));
    if (plan.dp() > 4096 || plan.pp() > 4096 || plan.tp() > 4096 ||
        static_cast<int64_t>(plan.dp()) * plan.pp() * plan.tp() != request->peers_size()) {
      return invalid(absl::StrCat("the plan needs dp x pp x tp actors, the request lists ", request->peers_size()));
    }
    if (a.replica() < 0 || a.replica() >= plan.dp() || a.stage() < 0 || a.stage() >= plan.pp() || a.tp_rank() < 0 ||
        a.tp_rank() >= plan.tp()) {
      return invalid(absl::StrCat("actor (replica ", a.replica(), ", stage ", a.stage(), ", tp rank ", a.tp_rank(),
                                  ") is outside the plan"));
    }
    bool listed = false;
    for (const ActorPeer& p : request->peers()) listed |= p.actor_id() == a.actor_id();
    if (!listed) return invalid("the actor is missing from its own peer list");
    absl::MutexLock lock(&worker_->mu_);
    if (worker_->stopping_) return call.Fail(absl::UnavailableError("the worker is shutting down"));
    auto it = worker_->actors_.find(a.actor_id());
    if (it != worker_->actors_.end() && !it->second->finished()) {
      return call.Fail(
          absl::AlreadyExistsError(absl::StrCat("actor ", a.actor_id(), " already exists on this worker")));
    }
    StageActorConfig config;
    config.actor = a;
    config.actor.set_worker_id(worker_->worker_id_);
    config.spec = request->spec();
    config.peers.assign(request->peers().begin(), request->peers().end());
    config.site = worker_->options_.site;
    config.token = worker_->options_.token;
    config.head_address = request->head_address().empty() ? worker_->options_.head_address : request->head_address();
    config.tls = worker_->options_.tls;
    if (request->attempt() < 0) return invalid("attempt must not be negative");
    config.attempt = request->attempt();
    config.resume_from = request->resume_from();
    if (request->has_join()) {
      const Regroup& join = request->join();
      const int dp = config.spec.parallel().dp();
      const auto& replicas = join.replicas();
      const bool sorted = std::is_sorted(replicas.begin(), replicas.end()) &&
                          std::adjacent_find(replicas.begin(), replicas.end()) == replicas.end();
      const auto in = [&](int r) { return std::find(replicas.begin(), replicas.end(), r) != replicas.end(); };
      const auto joining = [&](int r) {
        return std::find(join.joining().begin(), join.joining().end(), r) != join.joining().end();
      };
      const bool joining_in = std::all_of(join.joining().begin(), join.joining().end(), in);
      if (join.epoch() <= 0 || replicas.empty() || !sorted || replicas[0] < 0 || replicas[replicas.size() - 1] >= dp ||
          !in(join.donor()) || joining(join.donor()) || !joining(a.replica()) || !joining_in ||
          !config.resume_from.empty()) {
        return invalid(
            absl::StrCat("a joining actor needs a positive epoch, its membership's replicas (ascending, "
                         "below dp = ",
                         dp,
                         "), the joining ones among them (its own included), a donor that is not "
                         "joining, and no resume_from"));
      }
      config.join = join;
    }
    const Device& device = worker_->devices_[a.device_index()];
    config.slowdown = device.slowdown() > 1 ? device.slowdown() : 1;
    if (device.kind() == DEVICE_KIND_CUDA) {
      config.device = absl::StrCat("cuda:", device.index());
      config.device_index = device.index();
    } else if (device.timed_compute()) {
      absl::StatusOr<std::string> timed = TimedDeviceName(worker_->options_.timed_profiles[a.device_index()]);
      if (!timed.ok()) return invalid(std::string(timed.status().message()));
      config.device = *timed;
    }
    if (it != worker_->actors_.end()) {  // a finished actor of the same id
      worker_->actors_.erase(it);
      worker_->settled_since_ms_.erase(a.actor_id());
    }
    ActorServices services{.mailbox = worker_->tensor_streams_.get(), .links = worker_->links_.get()};
    services.data = [worker = worker_, job_id = a.job_id(), head = config.head_address, spec = config.spec,
                     peers = config.peers](const std::string& pattern) {
      return worker->StageData(job_id, pattern, head, spec, peers);
    };
    GrpcCheckpointStoreOptions store;
    store.state_dir = worker_->options_.state_dir;
    store.job_id = a.job_id();
    store.actor_id = a.actor_id();
    store.worker_id = worker_->worker_id_;
    store.site = worker_->options_.site;
    store.head_address = config.head_address;
    store.token = worker_->options_.token;
    store.tls = worker_->options_.tls;
    if (config.spec.checkpoint().replicate()) store.replica = ReplicaWorker(config.peers, worker_->options_.site);
    services.checkpoints = MakeGrpcCheckpointStore(std::move(store));
    auto actor = std::make_unique<StageActor>(config, std::move(services));
    actor->Start();
    *reply->mutable_actor() = actor->Record();
    worker_->actors_[a.actor_id()] = std::move(actor);
    GT_LOG(INFO) << "actor " << a.actor_id() << " of job " << a.job_id() << " (replica " << a.replica() << ", stage "
                 << a.stage() << ", tp rank " << a.tp_rank() << ") created";
    return grpc::Status::OK;
  }

  grpc::Status StopActor(grpc::ServerContext* context, const StopActorRequest* request,
                         StopActorReply* reply) override {
    RpcCall call(metrics_, auth_, context, "StopActor");
    if (!call.authorized()) return call.status();
    absl::MutexLock lock(&worker_->mu_);
    auto it = worker_->actors_.find(request->actor_id());
    if (it == worker_->actors_.end()) return call.Fail(NoActor(request->actor_id()));
    it->second->Stop(request->reason().empty() ? "stopped" : request->reason(),
                     /*job_stopping=*/!request->job_goes_on());
    *reply->mutable_actor() = it->second->Record();
    return grpc::Status::OK;
  }

  grpc::Status InterruptActor(grpc::ServerContext* context, const InterruptActorRequest* request,
                              StopActorReply* reply) override {
    RpcCall call(metrics_, auth_, context, "InterruptActor");
    if (!call.authorized()) return call.status();
    absl::MutexLock lock(&worker_->mu_);
    auto it = worker_->actors_.find(request->actor_id());
    if (it == worker_->actors_.end()) return call.Fail(NoActor(request->actor_id()));
    if (request->epoch() <= 0) {
      return call.Fail(absl::InvalidArgumentError(
          absl::StrCat("a regroup's membership epoch must be positive, not ", request->epoch())));
    }
    it->second->Interrupt(request->epoch());
    *reply->mutable_actor() = it->second->Record();
    return grpc::Status::OK;
  }

  grpc::Status ListActors(grpc::ServerContext* context, const ListActorsRequest*, ListActorsReply* reply) override {
    RpcCall call(metrics_, auth_, context, "ListActors");
    if (!call.authorized()) return call.status();
    for (const ActorRecord& a : worker_->Actors()) *reply->add_actors() = a;
    return grpc::Status::OK;
  }

  grpc::Status Ping(grpc::ServerContext* context, const PingRequest* request, PingReply* reply) override {
    RpcCall call(metrics_, auth_, context, "Ping");
    if (!call.authorized()) return call.status();
    EchoPing(*request, reply);
    return grpc::Status::OK;
  }

  grpc::Status PingStream(grpc::ServerContext* context,
                          grpc::ServerReaderWriter<PingReply, PingRequest>* stream) override {
    RpcCall call(metrics_, auth_, context, "PingStream");
    if (!call.authorized()) return call.status();
    EchoPingStream(stream);
    return grpc::Status::OK;
  }

 private:
  static absl::Status NoActor(const std::string& actor_id) {
    return absl::NotFoundError(absl::StrCat("no actor ", actor_id, " on this worker"));
  }

  WorkerServer* worker_;
  TokenAuth auth_;
  MetricsServer* metrics_;
};

WorkerServer::WorkerServer(WorkerOptions options) : options_(std::move(options)) {
  absl::MutexLock lock(&mu_);
  worker_id_ = options_.worker_id;
}

WorkerServer::~WorkerServer() { Shutdown(); }

std::string WorkerServer::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

bool WorkerServer::registered() const {
  absl::MutexLock lock(&mu_);
  return registered_;
}

std::vector<ActorRecord> WorkerServer::Actors() const {
  absl::MutexLock lock(&mu_);
  std::vector<ActorRecord> out;
  for (const auto& [id, a] : actors_) out.push_back(a->Record());
  return out;
}

absl::Status WorkerServer::Start() {
  if (options_.site.empty()) return absl::InvalidArgumentError("worker: no site; pass --site NAME");
  if (options_.head_address.empty()) {
    return absl::InvalidArgumentError("worker: no head; pass --head HOST:PORT or set GEOTRAIN_HEAD");
  }
  if (options_.token.empty()) {
    return absl::InvalidArgumentError(
        "worker: no cluster token; pass --token or set GEOTRAIN_TOKEN (the head's <state-dir>/token)");
  }
  RETURN_IF_ERROR(ValidateNodeTls(options_.tls, "worker"));
  if (options_.timed_compute) {
    if (options_.emulated_devices.empty() || options_.timed_profiles.size() != options_.emulated_devices.size()) {
      return absl::InvalidArgumentError(
          "worker: --timed-compute needs the devices to emulate; pass --emulate-device NAME (e.g. H100)");
    }
    for (const DeviceProfile& p : options_.timed_profiles) RETURN_IF_ERROR(TimedDeviceName(p).status());
  }
  devices_ = DiscoverDevices(options_.emulated_devices);
  for (Device& d : devices_) {
    if (!options_.timed_compute || d.kind() != DEVICE_KIND_EMULATED) continue;
    d.set_timed_compute(true);
    const DeviceProfile& p = options_.timed_profiles[d.index()];
    GT_LOG(INFO) << "timed compute: device " << d.index() << " EMULATES a " << p.name << " (" << p.peak_tflops
                 << " TFLOP/s peak x " << p.flops_efficiency << ", " << p.bandwidth_gbs << " GB/s x "
                 << p.bandwidth_efficiency << ", " << p.launch_us << " us per op; " << p.source
                 << "): its step times are emulated, its losses are not real";
  }
  RETURN_IF_ERROR(WithContext(SlowDevices(options_.slowdown, &devices_), "worker"));
  if (options_.slowdown > 1) {
    GT_LOG(INFO) << "slowed: every device computes on the CPU " << options_.slowdown
                 << " times slower than it can (--slowdown): its step times are EMULATED, its losses real";
  }
  if (options_.state_dir.empty()) {
    // One directory per worker: workers on one machine must not share a shard cache (one relaying shards to the
    // other would wait on the cache's lock held by the other's fetch).
    const std::string name = !options_.worker_id.empty() ? options_.worker_id
                             : options_.port > 0         ? absl::StrCat("port-", options_.port)
                                                         : absl::StrCat("pid-", getpid());
    options_.state_dir = absl::StrCat(GeotrainHome(), "/worker/", name);
  }
  if (options_.cache_dir.empty()) options_.cache_dir = absl::StrCat(options_.state_dir, "/cache");
  std::error_code ec;
  std::filesystem::create_directories(options_.state_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("worker: cannot create the state dir ", options_.state_dir, ": ",
                                                    ec.message(), "; pass a writable --state-dir"));
  }
  // /metrics listens where the worker is advertised (or where --metrics-bind says), not on every address.
  const std::string advertised_host = options_.advertise_address.empty()
                                          ? "127.0.0.1"
                                          : options_.advertise_address.substr(0, options_.advertise_address.rfind(':'));
  metrics_host_ = options_.metrics_bind.empty() ? advertised_host : options_.metrics_bind;

  if (options_.metrics_port >= 0) {
    metrics_ = std::make_unique<MetricsServer>();
    RETURN_IF_ERROR(metrics_->Start(absl::StrCat(metrics_host_, ":", options_.metrics_port)));
    auto& devices = metrics_->Gauges("geotrain_devices", "Devices of this worker, by kind and name");
    for (const Device& d : devices_) {
      devices.Add({{"site", options_.site}, {"name", d.name()}}).Increment();
    }
    // 1 when this worker's stages wait an emulated GPU's time instead of computing: its figures are emulated.
    metrics_->Gauges("geotrain_timed_compute", "1 when the worker's compute is emulated (timed compute), else 0")
        .Add({{"site", options_.site}})
        .Set(options_.timed_compute ? 1 : 0);
    // Above 1 when this worker's CPU is slowed (--slowdown): its step times are emulated too.
    metrics_->Gauges("geotrain_slowdown", "The factor this worker's compute is slowed by (--slowdown), 1 when not")
        .Add({{"site", options_.site}})
        .Set(options_.slowdown);
    StartGpuTelemetry();
  }
  links_ = std::make_unique<LinkMetrics>(metrics_.get(), options_.site);

  auto creds = MakeServerCredentials(options_.tls);
  if (!creds.ok()) return creds.status();
  service_ = std::make_unique<Service>(this, options_.token, metrics_.get());
  ShardCacheOptions cache;
  cache.dir = options_.cache_dir;
  cache.site = options_.site;
  cache.token = options_.token;
  cache.tls = options_.tls;
  cache.metrics = metrics_.get();
  cache.worker_id = [this] { return worker_id(); };
  shard_cache_ = std::make_unique<ShardCache>(std::move(cache));
  staging_service_ = std::make_unique<WorkerStagingService>(
      shard_cache_.get(), options_.token, options_.state_dir,
      ShardServer{options_.head_address, "the head", ShardOrigin::kHead}, metrics_.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(options_.bind_host, ":", options_.port), *creds, &port_);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use must fail, not be shared
  builder.RegisterService(service_.get());
  builder.RegisterService(staging_service_.get());
  tensor_streams_ = std::make_unique<comm::TensorStreamServer>(options_.token);
  tensor_streams_->Register(&builder);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("worker: cannot listen on ", options_.bind_host, ":", options_.port,
                                               " (port in use?); choose another with --port"));
  }
  advertise_address_ = options_.advertise_address;
  if (advertise_address_.empty()) {
    advertise_address_ = absl::StrCat("127.0.0.1:", port_);
  } else if (advertise_address_.find(':') == std::string::npos) {
    advertise_address_ = absl::StrCat(advertise_address_, ":", port_);
  }
  auto channel = MakeChannel(options_.head_address, options_.tls);
  if (!channel.ok()) return channel.status();
  head_channel_ = *channel;
  head_ = internal::HeadControl::NewStub(head_channel_);
  join_thread_ = std::thread([this] { JoinLoop(); });
  if (options_.probe_interval_ms > 0) probe_thread_ = std::thread([this] { ProbeLoop(); });
  GT_LOG(INFO) << "worker serving on " << options_.bind_host << ":" << port_ << " (advertised as " << advertise_address_
               << "), site " << options_.site << ", " << devices_.size() << " device(s): " << devices_[0].name() << " "
               << devices_[0].tflops() << " TFLOP/s";
  return absl::OkStatus();
}

void WorkerServer::StartGpuTelemetry() {
  const bool real_gpu = std::any_of(devices_.begin(), devices_.end(),
                                    [](const Device& d) { return d.kind() == DEVICE_KIND_CUDA && !d.timed_compute(); });
  if (!real_gpu || options_.timed_compute) return;  // emulated or CPU devices: no GPU to read, no series
  gpu_telemetry_ = std::make_unique<GpuTelemetry>(metrics_.get(), options_.site, CudaDevicesToWatch());
  if (absl::Status s = gpu_telemetry_->Start(absl::Seconds(2)); !s.ok()) GT_LOG(INFO) << s.message();
}

absl::Status WorkerServer::RegisterOnce() {
  RegisterWorkerRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_worker_id(worker_id_);
  }
  request.set_site(options_.site);
  request.set_address(advertise_address_);
  request.set_listen_address(absl::StrCat(options_.bind_host, ":", port_));
  for (const auto& [site, address] : options_.address_for_site) (*request.mutable_address_for_site())[site] = address;
  for (const Device& d : devices_) *request.add_devices() = d;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  request.set_hostname(host);
  request.set_pid(getpid());
  if (metrics_) {
    const std::string metrics_host =
        metrics_host_ == "0.0.0.0" ? advertise_address_.substr(0, advertise_address_.rfind(':')) : metrics_host_;
    request.set_metrics_address(absl::StrCat(metrics_host, ":", metrics_->port()));
  }
  grpc::ClientContext context;
  AttachToken(&context, options_.token);
  SetDeadlineMillis(&context, 3000);
  RegisterWorkerReply reply;
  grpc::Status s = head_->RegisterWorker(&context, request, &reply);
  if (!s.ok()) return FromGrpc(s);
  absl::MutexLock lock(&mu_);
  worker_id_ = reply.worker_id();
  incarnation_ = reply.incarnation();
  head_id_ = reply.head_id();
  heartbeat_interval_ms_ = std::max(50, reply.heartbeat_interval_ms());
  registered_ = true;
  // A head that (re)admits this worker sees every finished actor for a whole retention period before it is
  // forgotten, whatever the previous head saw.
  settled_since_ms_.clear();
  return absl::OkStatus();
}

absl::StatusOr<model::ShardSource> WorkerServer::StageData(const std::string& job_id, const std::string& pattern,
                                                           const std::string& head_address, const JobSpec& spec,
                                                           const std::vector<ActorPeer>& peers) {
  absl::MutexLock lock(&staging_mu_);
  const std::string key = absl::StrCat(job_id, "\n", pattern);
  if (std::shared_ptr<JobStaging> staging = stagings_[key].lock()) return staging->Source();
  JobStaging::Options options;
  options.job_id = job_id;
  options.pattern = pattern;
  options.worker_id = worker_id();
  options.site = options_.site;
  options.head = ShardServer{head_address, "the head", ShardOrigin::kHead};
  options.source = SiteRelay(spec, peers, options_.site, options.worker_id, options.head);
  options.token = options_.token;
  options.tls = options_.tls;
  ASSIGN_OR_RETURN(std::shared_ptr<JobStaging> staging, JobStaging::Start(shard_cache_.get(), std::move(options)));
  stagings_[key] = staging;
  return staging->Source();
}

std::vector<std::unique_ptr<StageActor>> WorkerServer::TakeSettledActors() {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  std::vector<std::unique_ptr<StageActor>> settled;
  for (auto it = actors_.begin(); it != actors_.end();) {
    const std::string& id = it->first;
    if (!it->second->finished() || !it->second->ReportsDelivered()) {
      settled_since_ms_.erase(id);
      ++it;
      continue;
    }
    const int64_t since = settled_since_ms_.emplace(id, now).first->second;
    if (now - since < options_.finished_actor_retention_ms) {
      ++it;
      continue;
    }
    GT_LOG(INFO) << "actor " << id << " of job " << it->second->Record().job_id() << " forgotten "
                 << options_.finished_actor_retention_ms << " ms after it finished and its reports were delivered";
    settled_since_ms_.erase(id);
    settled.push_back(std::move(it->second));
    it = actors_.erase(it);
  }
  return settled;
}

bool WorkerServer::SleepMillis(int64_t ms, bool wake_for_drain) {
  absl::MutexLock lock(&mu_);
  if (wake_for_drain) {
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](WorkerServer* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || w->drain_wake_; },
            this),
        absl::Milliseconds(ms));
  } else {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(ms));
  }
  return !stopping_;
}

void WorkerServer::Drain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (drain_requested_) return;
  drain_requested_ = true;
  drain_wake_ = true;
  drain_deadline_ = absl::Now() + timeout;
  GT_LOG(INFO) << "draining: the head moves this worker's jobs elsewhere (their actors leave at one step boundary "
               << "after a checkpoint of it); exiting once its actors are gone, within " << timeout;
}

bool WorkerServer::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_ || drain_requested_;
}

bool WorkerServer::ActorsGone() const {
  for (const auto& [id, actor] : actors_) {
    if (!actor->finished() || !actor->ReportsDelivered()) return false;
  }
  return true;
}

bool WorkerServer::WaitForExit() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    if ((draining_ || drain_requested_) && ActorsGone()) {
      GT_LOG(INFO) << "drained: no actor left on this worker; exiting";
      return true;
    }
    if (absl::Now() >= drain_deadline_) {
      GT_LOG(WARNING) << "the drain did not end in time (--drain-timeout-ms): exiting now, the actors left stop";
      return false;
    }
    // Actors finish without touching mu_: look again every 0.2 s.
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(200));
  }
  return false;
}

void WorkerServer::AskToDrain() {
  DrainWorkerRequest request;
  request.set_worker_id(worker_id());
  grpc::ClientContext context;
  AttachToken(&context, options_.token);
  SetDeadlineMillis(&context, 3000);
  WorkerInfo reply;
  grpc::Status s = head_->DrainWorker(&context, request, &reply);
  if (!s.ok() && s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    GT_LOG(WARNING) << "cannot ask the head to drain this worker: " << s.error_message() << "; retrying";
    return;
  }
  // Any other refusal (the head does not know this worker) leaves nothing to move: it drains all the same.
  if (!s.ok()) GT_LOG(WARNING) << "the head refused to drain this worker: " << s.error_message();
  absl::MutexLock lock(&mu_);
  draining_ = true;
  if (s.ok()) GT_LOG(INFO) << "the head drains this worker: its jobs restart elsewhere";
}

void WorkerServer::JoinLoop() {
  int64_t backoff_ms = 200;
  int failures = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    if (!registered()) {
      absl::Status s = RegisterOnce();
      if (!s.ok()) {
        ++failures;
        // Log the first failure, then every tenth, so a long outage does not flood the log.
        if (failures == 1 || failures % 10 == 0) {
          GT_LOG(WARNING) << "cannot join the head at " << options_.head_address << " (attempt " << failures
                          << "): " << s << "; retrying in " << backoff_ms << " ms";
        }
        if (!SleepMillis(backoff_ms)) return;
        backoff_ms = std::min<int64_t>(backoff_ms * 2, 5000);
        continue;
      }
      GT_LOG(INFO) << "joined the head at " << options_.head_address << " as " << worker_id()
                   << (failures > 0 ? absl::StrCat(" after ", failures, " failed attempt(s)") : "");
      failures = 0;
      backoff_ms = 200;
    }
    bool ask_to_drain;
    {
      absl::MutexLock lock(&mu_);
      ask_to_drain = drain_requested_ && !draining_;
      drain_wake_ = false;
    }
    if (ask_to_drain) AskToDrain();
    int64_t interval;
    HeartbeatRequest beat;
    std::vector<std::unique_ptr<StageActor>> forgotten;  // destroyed outside mu_
    {
      absl::MutexLock lock(&mu_);
      forgotten = TakeSettledActors();
      interval = heartbeat_interval_ms_;
      beat.set_worker_id(worker_id_);
      beat.set_incarnation(incarnation_);
      std::map<std::string, bool> job_finished;  // job -> every actor of it here has finished
      for (const auto& [id, a] : actors_) {
        *beat.add_actors() = a->Record();
        auto [it, inserted] = job_finished.emplace(a->comm_job_id(), a->finished());
        if (!inserted) it->second = it->second && a->finished();
      }
      // A job that is over on this worker leaves nothing in the mailbox (late or orphaned tensors).
      for (const auto& [job, finished] : job_finished) {
        if (finished && discarded_jobs_.insert(job).second) tensor_streams_->DiscardJob(job);
      }
      // Jobs with no actor left here: their tensors were discarded and none will be again.
      std::erase_if(discarded_jobs_, [&](const std::string& job) { return !job_finished.contains(job); });
    }
    forgotten.clear();
    if (!SleepMillis(interval, /*wake_for_drain=*/true)) return;
    std::vector<LinkMeasurement> links;
    {
      absl::MutexLock lock(&mu_);
      links.swap(pending_links_);
    }
    for (const LinkMeasurement& link : links) *beat.add_links() = link;
    beat.clear_sent();
    for (const auto& [peer, totals] : links_->SentTotalsByPeer()) {
      LinkSent* sent = beat.add_sent();
      sent->set_dst_worker(peer);
      sent->set_bytes(static_cast<int64_t>(totals.bytes));
      sent->set_seconds(totals.seconds);
    }
    grpc::ClientContext context;
    AttachToken(&context, options_.token);
    SetDeadlineMillis(&context, std::max<int64_t>(1000, interval * 2));
    HeartbeatReply reply;
    grpc::Status s = head_->Heartbeat(&context, beat, &reply);
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      GT_LOG(WARNING) << "lost the head at " << options_.head_address << ": " << s.error_message() << "; reconnecting";
      registered_ = false;
    } else if (!reply.reregister() && reply.head_id() == head_id_) {
      peers_.assign(reply.peers().begin(), reply.peers().end());
      if (reply.draining() && !draining_) {
        GT_LOG(INFO) << "the head drains this worker (`geotrain worker drain`): it exits once its actors are gone";
      }
      // A head that lost the drain a SIGTERM asked for (its state) is asked again.
      draining_ = reply.draining() || (draining_ && !drain_requested_);
    }
    if (s.ok() && (reply.reregister() || reply.head_id() != head_id_)) {
      GT_LOG(INFO) << "the head asks this worker to register again (head "
                   << (reply.head_id() != head_id_ ? "restarted" : "declared it dead") << ")";
      registered_ = false;
    }
  }
}

absl::StatusOr<LinkMeasurement> WorkerServer::ProbePeer(const std::string& address, const std::string& token,
                                                        const TlsFiles& tls) {
  auto channel = MakeChannel(address, tls);
  if (!channel.ok()) return channel.status();
  auto stub = internal::Worker::NewStub(*channel);
  double best_rtt_ms = 1e18;
  PingRequest small;
  small.set_payload("geotrain");
  PingReply reply;
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, token);
    SetDeadlineMillis(&ctx, 3000);
    const auto start = std::chrono::steady_clock::now();
    grpc::Status s = stub->Ping(&ctx, small, &reply);
    if (!s.ok()) return FromGrpc(s);
    best_rtt_ms = std::min(best_rtt_ms,
                           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  PingRequest big;
  big.set_payload(std::string(1 << 20, 'g'));
  big.set_no_echo(true);
  grpc::ClientContext ctx;
  AttachToken(&ctx, token);
  SetDeadlineMillis(&ctx, 20000);
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s = stub->Ping(&ctx, big, &reply);
  if (!s.ok()) return FromGrpc(s);
  const double total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  LinkMeasurement m;
  m.set_rtt_ms(best_rtt_ms);
  // The transfer time is what the big ping took beyond a small one's round trip.
  m.set_bandwidth_mbps(8.0 * (1 << 20) / std::max(total_ms - best_rtt_ms, 0.05) / 1000.0);
  m.set_measured_unix_ms(RealClock::Get()->UnixMillis());
  return m;
}

void WorkerServer::ProbeLoop() {
  constexpr size_t kMaxPeersPerRound = 16;
  int64_t wait_ms = 1000;  // the first round soon after joining
  while (SleepMillis(wait_ms)) {
    std::vector<PeerInfo> peers;
    {
      absl::MutexLock lock(&mu_);
      peers = peers_;
    }
    if (peers.empty()) {
      wait_ms = 1000;
      continue;
    }
    if (peers.size() > kMaxPeersPerRound) peers.resize(kMaxPeersPerRound);
    std::set<std::string> listed;
    for (const PeerInfo& peer : peers) listed.insert(peer.worker_id());
    links_->KeepProbedPeers(listed);
    for (const PeerInfo& peer : peers) {
      auto m = ProbePeer(peer.address(), options_.token, options_.tls);
      if (!m.ok()) {
        GT_LOG(DEBUG) << "probe of " << peer.worker_id() << " at " << peer.address() << " failed: " << m.status();
        continue;
      }
      m->set_dst_worker(peer.worker_id());
      m->set_dst_site(peer.site());
      m->set_src_site(options_.site);
      links_->RecordProbe(peer.worker_id(), peer.site(), m->rtt_ms() / 1000.0, m->bandwidth_mbps() * 1e6 / 8.0);
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      m->set_src_worker(worker_id_);
      pending_links_.push_back(*m);
    }
    wait_ms = options_.probe_interval_ms;
  }
}

void WorkerServer::Wait() {
  if (server_) server_->Wait();
}

void WorkerServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (join_thread_.joinable()) join_thread_.join();
  if (probe_thread_.joinable()) probe_thread_.join();
  std::map<std::string, std::unique_ptr<StageActor>> actors;
  {
    absl::MutexLock lock(&mu_);
    actors.swap(actors_);
  }
  for (auto& [id, actor] : actors) actor->Stop("the worker is shutting down", /*job_stopping=*/false);
  if (tensor_streams_) tensor_streams_->Shutdown();  // wakes actors blocked in a receive
  actors.clear();                                    // joins their threads
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  shard_cache_.reset();  // joins the relays' fetches
}

}  // namespace geotrain::worker
