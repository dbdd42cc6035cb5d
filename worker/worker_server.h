// The worker daemon: one per node (or per GPU). It discovers its devices, serves the Worker gRPC
// service (the head creates and stops actors on it), joins the head and keeps heartbeating.
//
//   WorkerOptions options;  options.head_address = "10.0.0.1:6380";  options.site = "utah";
//   WorkerServer worker(options);
//   absl::Status s = worker.Start();  // binds and serves; joining the head happens in the background
//   worker.Wait();
//
// A worker that loses the head keeps trying with exponential backoff (0.2 s to 5 s) and logs it; it
// never exits on its own, unless it drains. When the head restarts (its head id changes) or declares the worker
// dead, the worker registers again under the same worker id.
//
// Leaving on notice (a drain: `geotrain worker drain ID`, or Drain() on SIGTERM, which asks the head itself): the
// head moves the worker's jobs elsewhere, their actors leaving at one step boundary after a checkpoint of it
// (head/job_drain.h), and WaitForExit() returns once the worker's actors are gone, for the caller to Shutdown():
//
//   server.Drain(absl::Minutes(2));   // SIGTERM
//   server.WaitForExit();             // its actors are gone (or 2 min passed, or Shutdown())
//   server.Shutdown();
//
// Threads: gRPC's sync server threads run the Worker service; one "join" thread owns the connection to
// the head (registration and heartbeats); one "probe" thread measures latency and bandwidth to the peers
// the head hands out, queues the results for the next heartbeat and shows them on /metrics (link_metrics.h). Shared state is guarded by mu_; the jobs'
// data staging (worker/job_staging.h, one per job shared by its actors here) by staging_mu_.
//
// Besides the Worker service, its server carries the actors' tensor streams (comm/tensor_stream.h) and DataStaging
// (worker/staging_service.h: shards relayed to site peers, checkpoint replicas), all under one TLS configuration.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/tensor_stream.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "internal.grpc.pb.h"
#include "worker/devices.h"
#include "worker/gpu_telemetry.h"
#include "worker/job_staging.h"
#include "worker/link_metrics.h"
#include "worker/shard_cache.h"
#include "worker/stage_actor.h"
#include "worker/staging_service.h"

namespace geotrain::worker {

struct WorkerOptions {
  std::string head_address;  // host:port of the head
  std::string site;          // required
  std::string bind_host = "0.0.0.0";
  int port = 0;                   // 0 picks a free port
  std::string advertise_address;  // host[:port] others dial; default 127.0.0.1:<port>
  int metrics_port = 0;           // -1 disables; 0 picks a free port
  std::string metrics_bind;       // address /metrics listens on; default the advertised host
  // Where the worker keeps what outlives a job: the shard cache (cache_dir, default <state_dir>/cache, shared by
  // jobs), local checkpoint shards until the head has them, checkpoint replicas and resume copies. Default
  // $GEOTRAIN_HOME/worker.
  std::string state_dir;
  std::string cache_dir;
  std::string worker_id;  // stable id; empty lets the head assign one
  std::string token;
  TlsFiles tls;  // one configuration for its server (the head's calls, peers' streams and fetches) and its calls
  std::vector<Device> emulated_devices;
  // Timed compute (docs/timed-compute.md): the stage actors of emulated device i run on a timed backend of
  // timed_profiles[i], waiting the device's time instead of computing. Needs one profile per emulated device.
  bool timed_compute = false;
  std::vector<DeviceProfile> timed_profiles;
  // Slowed CPU devices (--slowdown, docs/timed-compute.md): a factor >= 1 by which every device's compute is slowed,
  // for sites of unequal speed with real numerics; 1: not slowed. Refused with timed compute or CUDA devices.
  double slowdown = 1;
  // Addresses for peers at given sites (site -> host:port), e.g. routes through a WAN emulator.
  std::map<std::string, std::string> address_for_site;
  // How often to probe latency and bandwidth to the other workers; 0 disables probing.
  int64_t probe_interval_ms = 30000;
  // How long a finished actor stays listed (heartbeats, ListActors) once the head has all of its reports; then
  // the worker forgets it, so that a long-lived worker's heartbeats do not carry every actor it ever ran. The
  // head keeps each actor's final state in its job record.
  int64_t finished_actor_retention_ms = 600000;
};

class WorkerServer {
 public:
  explicit WorkerServer(WorkerOptions options);
  ~WorkerServer();
  WorkerServer(const WorkerServer&) = delete;
  WorkerServer& operator=(const WorkerServer&) = delete;

  absl::Status Start();
  void Wait();
  void Shutdown();

  // Asks the head to drain this worker (the join thread sends it, again while the head is away); WaitForExit gives
  // up `timeout` from now. Once; later calls do nothing.
  void Drain(absl::Duration timeout);
  // Blocks until the worker should exit: it drains (Drain, or the head says so) and every actor of it has finished
  // with its reports delivered (at once when it has none): true; Shutdown() was called, or a Drain's timeout passed:
  // false. The caller calls Shutdown() then.
  bool WaitForExit();
  bool draining() const;

  int port() const { return port_; }
  std::string worker_id() const;
  bool registered() const;
  std::vector<ActorRecord> Actors() const;

  // Measures round trip (best of 5 small pings) and one-way bandwidth (a 1 MiB ping that is not
  // echoed) to `address`. Every call has a deadline.
  static absl::StatusOr<LinkMeasurement> ProbePeer(const std::string& address, const std::string& token,
                                                   const TlsFiles& tls);

 private:
  class Service;
  void JoinLoop();
  // Exports the CUDA devices' utilisation and memory through NVML when this worker computes on real GPUs and the
  // driver has NVML; otherwise logs once why there are no GPU gauges.
  void StartGpuTelemetry();
  void ProbeLoop();
  absl::Status RegisterOnce();
  // The shards of `pattern` for an actor of `job_id`: staged once per job on this worker, from the site's relay.
  absl::StatusOr<model::ShardSource> StageData(const std::string& job_id, const std::string& pattern,
                                               const std::string& head_address, const JobSpec& spec,
                                               const std::vector<ActorPeer>& peers);
  // Sleeps up to `ms` or until Shutdown() (or, with `wake_for_drain`, a Drain() call); returns false when stopping.
  bool SleepMillis(int64_t ms, bool wake_for_drain = false);
  // Asks the head to drain this worker (HeadControl.DrainWorker); on success the worker drains.
  void AskToDrain();
  // Every actor here has finished and the head has its reports.
  bool ActorsGone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes and returns the finished actors whose reports were all delivered finished_actor_retention_ms ago.
  std::vector<std::unique_ptr<StageActor>> TakeSettledActors() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  WorkerOptions options_;
  std::vector<Device> devices_;
  int port_ = 0;
  std::string advertise_address_;
  std::string metrics_host_;  // where /metrics listens
  std::unique_ptr<MetricsServer> metrics_;
  std::unique_ptr<LinkMetrics> links_;           // per-link RTT and goodput on metrics_; outlives the actors
  std::unique_ptr<GpuTelemetry> gpu_telemetry_;  // NVML gauges on metrics_ (CUDA workers with a driver)
  std::unique_ptr<Service> service_;
  std::unique_ptr<comm::TensorStreamServer> tensor_streams_;  // the actors' mailbox, served with service_
  std::unique_ptr<ShardCache> shard_cache_;
  std::unique_ptr<WorkerStagingService> staging_service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> head_channel_;
  std::unique_ptr<internal::HeadControl::Stub> head_;
  std::thread join_thread_;
  std::thread probe_thread_;  // owns the peer channels it dials

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string head_id_ ABSL_GUARDED_BY(mu_);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  int64_t heartbeat_interval_ms_ ABSL_GUARDED_BY(mu_) = 1000;
  // A drain: the head drains this worker (its answer to AskToDrain, or a heartbeat's); Drain() was called (and woke
  // the join thread to ask); when WaitForExit gives up.
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_wake_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // Running (and finished) stage actors by id; their records come from StageActor::Record().
  std::map<std::string, std::unique_ptr<StageActor>> actors_ ABSL_GUARDED_BY(mu_);
  // Since when (ms, steady clock) each finished actor has had every report delivered: it is forgotten
  // finished_actor_retention_ms later (the heartbeat loop).
  std::map<std::string, int64_t> settled_since_ms_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> discarded_jobs_ ABSL_GUARDED_BY(mu_);        // jobs whose tensors were dropped
  std::vector<PeerInfo> peers_ ABSL_GUARDED_BY(mu_);                 // from the latest heartbeat reply
  std::vector<LinkMeasurement> pending_links_ ABSL_GUARDED_BY(mu_);  // probes not yet reported

  absl::Mutex staging_mu_;
  // By job and pattern; the actors' loaders own them, so a job's staging ends with its last actor here.
  std::map<std::string, std::weak_ptr<JobStaging>> stagings_ ABSL_GUARDED_BY(staging_mu_);
};

}  // namespace geotrain::worker
