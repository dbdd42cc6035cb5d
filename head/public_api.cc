// The head's public API: thin adapters from geotrain.v1 calls to the head's components (see public_api.h).
#include "head/public_api.h"

#include <filesystem>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/names.h"
#include "common/rpc_call.h"
#include "common/spec.h"
#include "common/status.h"
#include "geotrain/v1/cluster.grpc.pb.h"
#include "geotrain/v1/jobs.grpc.pb.h"
#include "geotrain/v1/planner.grpc.pb.h"
#include "head/dashboard_figures.h"
#include "head/placement.h"

namespace geotrain::head {
namespace {

constexpr int kDefaultPlans = 5;
constexpr int kMaxPlans = 100;

// The spec of a SubmitJob or PlanJob request: its text parsed as `geotrain job submit` parses files (spec_text
// wins), else its message; relative paths resolved against base_dir when given. Defaults are not filled.
template <typename Request>
absl::StatusOr<JobSpec> RequestSpec(const Request& request) {
  JobSpec spec = request.spec();
  const std::string source = request.spec_source().empty() ? "spec" : request.spec_source();
  if (!request.spec_text().empty()) {
    spec.Clear();
    RETURN_IF_ERROR(ParseYamlOrJson(request.spec_text(), source, &spec));
  }
  if (!request.base_dir().empty()) {
    if (!std::filesystem::path(request.base_dir()).is_absolute()) {
      return absl::InvalidArgumentError(absl::StrCat("base_dir '", request.base_dir(),
                                                     "' is not an absolute path; pass the client's working directory"));
    }
    MakeSpecPathsAbsolute(&spec, request.base_dir());
  }
  return spec;
}

// The job with the workers' latest reports of its actors over its placement records.
JobInfo WithReportedActors(JobInfo job, const WorkerRegistry& registry) {
  std::map<std::string, ActorRecord> actors;
  for (const ActorRecord& a : job.actors()) actors[a.actor_id()] = a;
  for (const ActorRecord& a : registry.Actors()) {
    if (a.job_id() == job.job_id()) actors[a.actor_id()] = a;
  }
  job.clear_actors();
  for (const auto& [id, a] : actors) *job.add_actors() = a;
  return job;
}

v1::RankedPlan PublicPlan(const RankedAutoPlan& plan, const scheduler::Cluster& cluster, int rank) {
  const scheduler::Prediction& p = plan.candidate.prediction;
  const ParallelSpec& parallel = plan.parallel;
  v1::RankedPlan out;
  out.set_rank(rank);
  *out.mutable_parallel() = parallel;
  out.set_predicted_step_seconds(plan.predicted_step_seconds);  // DiLoCo's when the plan is DiLoCo
  out.set_predicted_tokens_per_second(p.tokens_per_s);
  out.set_pipeline_seconds(p.pipeline_time_s);
  out.set_exposed_allreduce_seconds(p.dp_exposed_s);
  out.set_bubble_fraction(p.bubble_fraction);
  out.set_max_memory_fraction(p.max_memory_fraction);
  out.set_devices(parallel.dp() * parallel.pp() * parallel.tp());
  out.set_subset(scheduler::DevicesUsedName(cluster, plan.candidate));  // the devices the plan uses, in words
  for (const scheduler::LinkTraffic& link : p.cross_site) {
    v1::CrossSiteTraffic* traffic = out.add_cross_site();
    traffic->set_site_a(cluster.site_names.at(link.site_a));
    traffic->set_site_b(cluster.site_names.at(link.site_b));
    traffic->set_bytes_per_step(link.bytes);
    traffic->set_gradient_codec(link.gradient_codec);
    traffic->set_activation_codec(link.activation_codec);
  }
  out.set_summary(absl::StrFormat("dp %d x pp %d x tp %d, %s, %d microbatches: %.3f s/step, %.0f tokens/s (%s)",
                                  parallel.dp(), parallel.pp(), parallel.tp(), parallel.schedule(),
                                  parallel.microbatches(), p.step_time_s, p.tokens_per_s, plan.candidate.subset));
  return out;
}

// The calls' logic, shared by the gRPC services and PublicApi's in-process methods.
using Components = PublicApi::Components;

absl::StatusOr<v1::Job> SubmitJobOf(const Components& head, const v1::SubmitJobRequest& request) {
  ASSIGN_OR_RETURN(JobSpec spec, RequestSpec(request));
  ASSIGN_OR_RETURN(JobInfo job, head.jobs->Submit(std::move(spec), request.spec_source()));
  head.runner->Kick();
  head.changed();
  return ToPublic<v1::Job>(job);
}

absl::StatusOr<v1::Job> GetJobOf(const Components& head, const std::string& job_id) {
  ASSIGN_OR_RETURN(JobInfo job, head.jobs->Get(job_id));
  return ToPublic<v1::Job>(WithReportedActors(std::move(job), *head.registry));
}

v1::ListJobsReply ListJobsOf(const Components& head) {
  v1::ListJobsReply reply;
  for (const JobInfo& job : head.jobs->List()) *reply.add_jobs() = ToPublic<v1::Job>(job);
  return reply;
}

absl::StatusOr<v1::Job> CancelJobOf(const Components& head, const std::string& job_id) {
  ASSIGN_OR_RETURN(JobInfo job, head.jobs->Cancel(job_id));
  head.runner->StopJob(job_id, "job cancelled by the user");
  head.changed();
  return ToPublic<v1::Job>(job);
}

absl::StatusOr<v1::JobEfficiency> JobEfficiencyOfJob(const Components& head, const std::string& job_id) {
  ASSIGN_OR_RETURN(JobInfo job, head.jobs->Get(job_id));
  return JobEfficiencyOf(job, head.registry->Workers());
}

v1::ClusterStatus ClusterStatusOf(const Components& head) {
  v1::ClusterStatus reply;
  reply.set_head_id(head.head_id);
  reply.set_head_started_unix_ms(head.started_unix_ms);
  std::map<std::string, v1::Site> sites;
  for (const WorkerInfo& w : head.registry->Workers()) {
    v1::Site& site = sites[w.site()];
    site.set_name(w.site());
    if (w.state() == WORKER_ALIVE) {
      site.set_alive_workers(site.alive_workers() + 1);
      site.set_devices(site.devices() + w.devices_size());
      for (const Device& d : w.devices()) site.set_tflops(site.tflops() + d.tflops());
    } else {
      site.set_dead_workers(site.dead_workers() + 1);
    }
    *reply.add_workers() = ToPublic<v1::Worker>(w);
  }
  for (auto& [name, site] : sites) *reply.add_sites() = std::move(site);
  for (const ActorRecord& a : head.registry->Actors()) *reply.add_actors() = ToPublic<v1::Actor>(a);
  for (const SiteLink& link : head.registry->SiteLinks()) *reply.add_site_links() = ToPublic<v1::SiteLink>(link);
  for (const auto& [state, count] : head.jobs->CountByState()) {
    (*reply.mutable_jobs_by_state())[JobStateName(state)] = count;
  }
  return reply;
}

v1::ClusterInfo ClusterInfoOf(const Components& head) {
  v1::ClusterInfo info;
  info.set_dashboard_url(head.dashboard_url);
  info.set_metrics_url(head.metrics_url);
  info.set_topology_file(head.topology_file);
  for (const v1::ConfiguredLink& link : head.configured_links) *info.add_configured_links() = link;
  return info;
}

absl::StatusOr<v1::Worker> DrainWorkerOf(const Components& head, const std::string& worker_id) {
  if (worker_id.empty()) return absl::InvalidArgumentError("DrainWorker: worker_id is required");
  if (!head.drain_worker) return absl::UnimplementedError("DrainWorker: this head cannot drain workers");
  ASSIGN_OR_RETURN(WorkerInfo worker, head.drain_worker(worker_id));
  head.changed();
  return ToPublic<v1::Worker>(worker);
}

absl::StatusOr<v1::PlanJobReply> PlanJobOf(const Components& head, const v1::PlanJobRequest& request) {
  if (request.max_plans() < 0 || request.max_plans() > kMaxPlans) {
    return absl::InvalidArgumentError(absl::StrCat("max_plans must be 0..", kMaxPlans));
  }
  ASSIGN_OR_RETURN(JobSpec spec, RequestSpec(request));
  ApplyJobDefaults(&spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return WithContext(s, request.spec_source().empty() ? "spec" : request.spec_source());
  }
  absl::StatusOr<RankedAutoPlans> ranked =
      RankAutoPlans(spec, head.registry->Workers(), head.registry->SiteLinks(),
                    request.max_plans() == 0 ? kDefaultPlans : request.max_plans());
  if (!ranked.ok() && absl::IsUnavailable(ranked.status())) {
    // UNAVAILABLE means the head cannot be reached, to clients: nothing to plan on is the cluster's state.
    return absl::FailedPreconditionError(
        absl::StrCat(ranked.status().message(), "; start workers with `geotrain worker start`"));
  }
  if (!ranked.ok()) return ranked.status();
  v1::PlanJobReply reply;
  for (size_t i = 0; i < ranked->plans.size(); ++i) {
    *reply.add_plans() = PublicPlan(ranked->plans[i], ranked->cluster, static_cast<int>(i) + 1);
  }
  for (const std::string& line : ranked->explanation) reply.add_explanation(line);
  reply.set_plans_simulated(ranked->plans_simulated);
  reply.set_planning_seconds(ranked->planning_seconds);
  reply.set_alive_workers(ranked->alive_workers);
  reply.set_devices(static_cast<int>(ranked->cluster.devices.size()));
  return reply;
}

// Answers a call with `result`: its value into `reply`, or its error through `call`.
template <typename Reply>
grpc::Status Answer(RpcCall& call, absl::StatusOr<Reply> result, Reply* reply) {
  if (!result.ok()) return call.Fail(result.status());
  *reply = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace

class PublicApi::JobsService final : public v1::Jobs::Service {
 public:
  JobsService(const Components& head, const TokenAuth& auth) : head_(head), auth_(auth) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "SubmitJob");
    if (!call.authorized()) return call.status();
    return Answer(call, SubmitJobOf(head_, *request), reply);
  }

  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "GetJob");
    if (!call.authorized()) return call.status();
    return Answer(call, GetJobOf(head_, request->job_id()), reply);
  }

  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest*, v1::ListJobsReply* reply) override {
    RpcCall call(head_.metrics, auth_, context, "ListJobs");
    if (!call.authorized()) return call.status();
    *reply = ListJobsOf(head_);
    return grpc::Status::OK;
  }

  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "CancelJob");
    if (!call.authorized()) return call.status();
    return Answer(call, CancelJobOf(head_, request->job_id()), reply);
  }

  grpc::Status GetJobEfficiency(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                v1::JobEfficiency* reply) override {
    RpcCall call(head_.metrics, auth_, context, "GetJobEfficiency");
    if (!call.authorized()) return call.status();
    return Answer(call, JobEfficiencyOfJob(head_, request->job_id()), reply);
  }

  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    RpcCall call(head_.metrics, auth_, context, "WatchJob");
    if (!call.authorized()) return call.status();
    int64_t after = request->after_seq();
    while (!context->IsCancelled()) {
      bool ended = false;
      absl::StatusOr<std::vector<JobEvent>> events = head_.jobs->WaitEvents(request->job_id(), after, 500, &ended);
      if (!events.ok()) return call.Fail(events.status());
      for (const JobEvent& event : *events) {
        if (!writer->Write(ToPublic<v1::JobEvent>(event))) return grpc::Status::OK;  // the client went away
        after = event.seq();
      }
      if (!request->follow() || (ended && events->empty())) break;
      if (head_.stopping()) {
        return call.Fail(absl::UnavailableError(
            absl::StrCat("the head is shutting down; watch again with after_seq ", after, " once it is back")));
      }
    }
    return grpc::Status::OK;
  }

 private:
  const Components& head_;
  const TokenAuth& auth_;
};

class PublicApi::ClusterService final : public v1::Cluster::Service {
 public:
  ClusterService(const Components& head, const TokenAuth& auth) : head_(head), auth_(auth) {}

  grpc::Status GetClusterStatus(grpc::ServerContext* context, const v1::GetClusterStatusRequest*,
                                v1::ClusterStatus* reply) override {
    RpcCall call(head_.metrics, auth_, context, "GetClusterStatus");
    if (!call.authorized()) return call.status();
    *reply = ClusterStatusOf(head_);
    return grpc::Status::OK;
  }

  grpc::Status GetClusterInfo(grpc::ServerContext* context, const v1::GetClusterInfoRequest*,
                              v1::ClusterInfo* reply) override {
    RpcCall call(head_.metrics, auth_, context, "GetClusterInfo");
    if (!call.authorized()) return call.status();
    *reply = ClusterInfoOf(head_);
    return grpc::Status::OK;
  }

  grpc::Status DrainWorker(grpc::ServerContext* context, const v1::DrainWorkerRequest* request,
                           v1::Worker* reply) override {
    RpcCall call(head_.metrics, auth_, context, "DrainWorker");
    if (!call.authorized()) return call.status();
    return Answer(call, DrainWorkerOf(head_, request->worker_id()), reply);
  }

 private:
  const Components& head_;
  const TokenAuth& auth_;
};

class PublicApi::PlannerService final : public v1::Planner::Service {
 public:
  PlannerService(const Components& head, const TokenAuth& auth) : head_(head), auth_(auth) {}

  grpc::Status PlanJob(grpc::ServerContext* context, const v1::PlanJobRequest* request,
                       v1::PlanJobReply* reply) override {
    RpcCall call(head_.metrics, auth_, context, "PlanJob");
    if (!call.authorized()) return call.status();
    return Answer(call, PlanJobOf(head_, *request), reply);
  }

 private:
  const Components& head_;
  const TokenAuth& auth_;
};

PublicApi::PublicApi(Components components, std::string token)
    : components_(std::move(components)),
      auth_(std::move(token)),
      jobs_(std::make_unique<JobsService>(components_, auth_)),
      cluster_(std::make_unique<ClusterService>(components_, auth_)),
      planner_(std::make_unique<PlannerService>(components_, auth_)) {}

PublicApi::~PublicApi() = default;

void PublicApi::RegisterWith(grpc::ServerBuilder* builder) {
  builder->RegisterService(jobs_.get());
  builder->RegisterService(cluster_.get());
  builder->RegisterService(planner_.get());
}

absl::StatusOr<v1::Job> PublicApi::SubmitJob(const v1::SubmitJobRequest& request) const {
  return SubmitJobOf(components_, request);
}
absl::StatusOr<v1::Job> PublicApi::GetJob(const std::string& job_id) const { return GetJobOf(components_, job_id); }
v1::ListJobsReply PublicApi::ListJobs() const { return ListJobsOf(components_); }
absl::StatusOr<v1::Job> PublicApi::CancelJob(const std::string& job_id) const {
  return CancelJobOf(components_, job_id);
}
absl::StatusOr<std::vector<v1::JobEvent>> PublicApi::JobEvents(const std::string& job_id, int64_t after_seq,
                                                               int64_t limit, bool newest) const {
  bool ended = false;
  ASSIGN_OR_RETURN(std::vector<JobEvent> events,
                   components_.jobs->WaitEvents(job_id, after_seq, 0, &ended, limit, newest));
  std::vector<v1::JobEvent> out;
  out.reserve(events.size());
  for (const JobEvent& event : events) out.push_back(ToPublic<v1::JobEvent>(event));
  return out;
}
absl::StatusOr<v1::JobEfficiency> PublicApi::GetJobEfficiency(const std::string& job_id) const {
  return JobEfficiencyOfJob(components_, job_id);
}
v1::ClusterStatus PublicApi::GetClusterStatus() const { return ClusterStatusOf(components_); }
v1::ClusterInfo PublicApi::GetClusterInfo() const { return ClusterInfoOf(components_); }
absl::StatusOr<v1::Worker> PublicApi::DrainWorker(const std::string& worker_id) const {
  return DrainWorkerOf(components_, worker_id);
}
absl::StatusOr<v1::PlanJobReply> PublicApi::PlanJob(const v1::PlanJobRequest& request) const {
  return PlanJobOf(components_, request);
}

}  // namespace geotrain::head
