// The head's worker registry: who is in the cluster, at which site, with which devices, and whether it
// is alive. Failure detection is heartbeat-based: a worker not heard from for `timeout_ms` is probed
// (head/liveness_probe.h): when its port refuses connections the process is gone and the worker is
// declared dead at once, together with every actor it hosted; when it cannot be reached (a partition, a
// host down) or its port answers without heartbeats, it is declared dead only after
// `unreachable_timeout_ms` of silence. Without a probe, silence beyond `timeout_ms` is death.
//
//   WorkerRegistry registry(clock, {.heartbeat_interval_ms = 1000, .timeout_ms = 4000}, head_id);
//   RegisterWorkerReply r = registry.Register(request);
//   HeartbeatReply h = registry.Heartbeat(beat);
//   for (const WorkerInfo& dead : registry.CheckLiveness()) ...   // call every interval
//
// Thread-safety: all methods are safe to call from any thread (one mutex guards the table).
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "control.pb.h"
#include "head/liveness_probe.h"

namespace geotrain::head {

class WorkerRegistry {
 public:
  struct Options {
    int64_t heartbeat_interval_ms = 1000;
    int64_t timeout_ms = 4000;
    int64_t unreachable_timeout_ms = 30000;
  };
  // Tells how each address answers a connection (head/liveness_probe.h ProbeTcp, or a fake in tests).
  using Probe = std::function<std::vector<Reachability>(const std::vector<std::string>& addresses)>;

  WorkerRegistry(const Clock* clock, Options options, std::string head_id);

  // Restores workers from persisted state. Workers that were alive get a fresh grace period: they are
  // declared dead if they do not come back within the timeout.
  void Restore(const std::vector<WorkerInfo>& workers);

  // Adds or re-admits a worker. A request without worker_id gets a new one. The stored record is
  // returned in `stored` (for persistence).
  RegisterWorkerReply Register(const RegisterWorkerRequest& request, WorkerInfo* stored);

  // Records liveness, the worker's actors and its link probes, and hands it the other alive workers
  // (with the address to dial from its site). Asks the worker to register again when the head does not
  // know it, has declared it dead, or the incarnation is stale.
  HeartbeatReply Heartbeat(const HeartbeatRequest& request);

  // Declares dead every alive worker silent for longer than the timeout (with `probe`: whose port refuses
  // connections, or silent for longer than the unreachable timeout), marks its actors dead, and returns the
  // newly dead workers. The probe runs without the registry's lock.
  std::vector<WorkerInfo> CheckLiveness(const Probe& probe = nullptr);
  // Workers a job suspects (its actors lost contact with them, or it stalled): the next CheckLiveness with a probe
  // probes them at once, silent or not, and declares dead one whose port refuses connections (the process is gone),
  // without waiting for its heartbeat timeout. `why` starts the dead reason ("its job's actors lost contact with
  // it"). Each is probed once.
  void Suspect(const std::vector<std::string>& worker_ids, const std::string& why);
  // Called (outside the registry's lock) after each Suspect: the detector checks now rather than at its next period.
  void set_on_suspect(std::function<void()> f) { on_suspect_ = std::move(f); }

  // The worker leaves on notice (a drain): it is marked draining (placement skips it, its heartbeats are answered
  // `draining`) until a new process registers under its id. Returns its record, to persist. NOT_FOUND: no such
  // worker; FAILED_PRECONDITION: it is dead.
  absl::StatusOr<WorkerInfo> SetDraining(const std::string& worker_id);

  std::vector<WorkerInfo> Workers() const;
  std::vector<ActorRecord> Actors() const;
  // Site-to-site links from the latest probe of each worker pair whose ends are alive: one-way latency
  // (half the median round trip) and median bandwidth.
  std::vector<SiteLink> SiteLinks() const;
  const Options& options() const { return options_; }

 private:
  // Turns the growth of the heartbeat's sent totals into each worker pair's goodput (sent_).
  void RecordSent(const HeartbeatRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Clock* clock_;
  const Options options_;
  const std::string head_id_;

  mutable absl::Mutex mu_;
  std::map<std::string, WorkerInfo> workers_ ABSL_GUARDED_BY(mu_);
  // Last seen heartbeat on the monotonic clock, by worker id.
  std::map<std::string, int64_t> last_seen_ms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<ActorRecord>> actors_ ABSL_GUARDED_BY(mu_);
  // Silent workers that did not refuse the probe, with what it found (logged once per silence).
  std::map<std::string, Reachability> suspected_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> peer_suspects_
      ABSL_GUARDED_BY(mu_);           // Suspect's (id -> why), until the next probe
  std::function<void()> on_suspect_;  // set before the registry is shared
  // Latest probe by (src worker, dst worker).
  std::map<std::pair<std::string, std::string>, LinkMeasurement> links_ ABSL_GUARDED_BY(mu_);
  // (src worker, dst worker) -> the sender's totals at its last heartbeat, and the goodput their last growth gave.
  struct SentSample {
    int64_t bytes = 0;
    double seconds = 0;
    double goodput_mbps = 0;
    int64_t goodput_at_ms = 0;  // clock's monotonic milliseconds; 0: no goodput yet
  };
  std::map<std::pair<std::string, std::string>, SentSample> sent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::head
