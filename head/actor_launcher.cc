// The job runner's launcher: CreateActor and StopActor fan-out on the head's executor (see actor_launcher.h).
#include "head/actor_launcher.h"

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "internal.grpc.pb.h"

namespace geotrain::head {
namespace {

// The worker of that id, or an empty record when the registry did not list it (its actor then fails to be created
// on an empty address, as a worker that went away would).
const WorkerInfo& WorkerOf(const WorkersById& workers, const std::string& worker_id) {
  static const WorkerInfo* const kUnknown = new WorkerInfo();
  auto it = workers.find(worker_id);
  return it == workers.end() ? *kUnknown : it->second;
}

}  // namespace

std::vector<ActorPeer> ActorLauncher::Peers(const std::vector<ActorPlacement>& actors, const WorkersById& workers) {
  std::vector<ActorPeer> peers;
  for (const ActorPlacement& p : actors) {
    const WorkerInfo& w = WorkerOf(workers, p.actor.worker_id());
    ActorPeer* peer = &peers.emplace_back();
    peer->set_actor_id(p.actor.actor_id());
    peer->set_replica(p.actor.replica());
    peer->set_stage(p.actor.stage());
    peer->set_tp_rank(p.actor.tp_rank());
    peer->set_worker_id(w.worker_id());
    peer->set_site(w.site());
    peer->set_address(w.address());
    *peer->mutable_address_for_site() = w.address_for_site();
    const int d = p.actor.device_index();
    peer->set_device_kind(d >= 0 && d < w.devices_size() ? w.devices(d).kind() : DEVICE_KIND_UNSPECIFIED);
  }
  return peers;
}

ActorLauncher::ActorLauncher(WorkerRegistry* registry, ActorLauncherOptions options)
    : registry_(registry),
      options_(std::move(options)),
      executor_(std::make_unique<Executor>(options_.rpc_threads, "head-rpc")) {}

void ActorLauncher::Shutdown() { executor_.reset(); }

void ActorLauncher::NameForRun(std::vector<ActorPlacement>* placement, int64_t attempt) {
  if (attempt == 0) return;
  for (ActorPlacement& p : *placement) p.actor.set_actor_id(absl::StrCat(p.actor.actor_id(), "-a", attempt));
}

absl::Status ActorLauncher::CreateActors(const JobSpec& spec, const std::vector<ActorPlacement>& placement,
                                         const WorkersById& workers, int64_t attempt, const std::string& resume_from,
                                         const std::vector<ActorPeer>* peers, const Regroup* join) {
  // What every actor of the run is told: the spec, where to report, the run, and each peer's place and address.
  CreateActorRequest request;
  *request.mutable_spec() = spec;
  request.set_head_address(options_.head_address);
  request.set_attempt(attempt);
  request.set_resume_from(resume_from);
  for (const ActorPeer& peer : peers != nullptr ? *peers : Peers(placement, workers)) *request.add_peers() = peer;
  if (join != nullptr) *request.mutable_join() = *join;
  // Every actor at once: a slow worker costs one deadline, not one per actor.
  std::vector<absl::Status> created = executor_->Map(static_cast<int>(placement.size()), [&](int i) -> absl::Status {
    const ActorPlacement& p = placement[i];
    const WorkerInfo& w = WorkerOf(workers, p.actor.worker_id());
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(w.address(), options_.tls));
    auto stub = internal::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, options_.token);
    SetDeadlineMillis(&ctx, options_.create_deadline_ms);
    CreateActorRequest one = request;
    *one.mutable_actor() = p.actor;
    CreateActorReply reply;
    grpc::Status s = stub->CreateActor(&ctx, one, &reply);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("creating actor ", p.actor.actor_id(), " on worker ", w.worker_id(),
                                                 " (", w.address(), "): ", s.error_message()));
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : created) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void ActorLauncher::StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason, bool wait,
                               bool job_goes_on) {
  StopActorRequest request;
  request.set_reason(reason);
  request.set_job_goes_on(job_goes_on);
  OnAliveWorkers(actors, wait, "stopping",
                 [request](internal::Worker::Stub& stub, grpc::ClientContext& ctx, const std::string& actor_id) {
                   // One copy per call: the executor's threads run this same function for several actors at once.
                   StopActorRequest one = request;
                   one.set_actor_id(actor_id);
                   StopActorReply reply;
                   return stub.StopActor(&ctx, one, &reply);
                 });
}

void ActorLauncher::InterruptActors(const std::vector<ActorPlacement>& actors, int64_t epoch) {
  OnAliveWorkers(actors, /*wait=*/false, "interrupting",
                 [epoch](internal::Worker::Stub& stub, grpc::ClientContext& ctx, const std::string& actor_id) {
                   InterruptActorRequest request;
                   request.set_actor_id(actor_id);
                   request.set_epoch(epoch);
                   StopActorReply reply;
                   return stub.InterruptActor(&ctx, request, &reply);
                 });
}

void ActorLauncher::OnAliveWorkers(const std::vector<ActorPlacement>& actors, bool wait, const std::string& what,
                                   ActorCall call) {
  const WorkersById workers = ById(registry_->Workers());
  auto targets = std::make_shared<std::vector<std::pair<WorkerInfo, std::string>>>();
  for (const ActorPlacement& p : actors) {
    auto it = workers.find(p.actor.worker_id());
    if (it == workers.end() || it->second.state() != WORKER_ALIVE) continue;
    targets->push_back({it->second, p.actor.actor_id()});
  }
  auto one = [targets, what, call, options = options_](int i) -> absl::Status {
    const auto& [worker, actor_id] = (*targets)[i];
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(worker.address(), options.tls));
    auto stub = internal::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, options.token);
    SetDeadlineMillis(&ctx, options.stop_deadline_ms);
    grpc::Status s = call(*stub, ctx, actor_id);
    // NOT_FOUND: the worker restarted and the actor is gone, which is what a stop wants.
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
      GT_LOG(WARNING) << what << " actor " << actor_id << " on worker " << worker.worker_id() << ": "
                      << s.error_message();
    }
    return absl::OkStatus();
  };
  if (wait) {
    executor_->Map(static_cast<int>(targets->size()), one);
  } else {
    for (int i = 0; i < static_cast<int>(targets->size()); ++i) executor_->Submit([one, i] { (void)one(i); });
  }
}

}  // namespace geotrain::head
