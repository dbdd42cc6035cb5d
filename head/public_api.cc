// The head's public API: thin adapters from geotrain.v1 calls to the head's components (see public_api.h).
#include "head/public_api.h"

#include <filesystem>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/names.h"
#include "common/spec.h"
#include "common/status.h"
#include "geotrain/v1/cluster.grpc.pb.h"
#include "geotrain/v1/jobs.grpc.pb.h"
#include "geotrain/v1/planner.grpc.pb.h"
#include "head/placement.h"
#include "head/rpc_call.h"

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

}  // namespace

class PublicApi::JobsService final : public v1::Jobs::Service {
 public:
  JobsService(const Components& head, const TokenAuth& auth) : head_(head), auth_(auth) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "SubmitJob");
    if (!call.authorized()) return call.status();
    absl::StatusOr<JobSpec> spec = RequestSpec(*request);
    if (!spec.ok()) return call.Fail(spec.status());
    absl::StatusOr<JobInfo> job = head_.jobs->Submit(*std::move(spec), request->spec_source());
    if (!job.ok()) return call.Fail(job.status());
    head_.runner->Kick();
    head_.changed();
    *reply = ToPublic<v1::Job>(*job);
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "GetJob");
    if (!call.authorized()) return call.status();
    absl::StatusOr<JobInfo> job = head_.jobs->Get(request->job_id());
    if (!job.ok()) return call.Fail(job.status());
    *reply = ToPublic<v1::Job>(WithReportedActors(*std::move(job), *head_.registry));
    return grpc::Status::OK;
  }

  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest*, v1::ListJobsReply* reply) override {
    RpcCall call(head_.metrics, auth_, context, "ListJobs");
    if (!call.authorized()) return call.status();
    for (const JobInfo& job : head_.jobs->List()) *reply->add_jobs() = ToPublic<v1::Job>(job);
    return grpc::Status::OK;
  }

  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request, v1::Job* reply) override {
    RpcCall call(head_.metrics, auth_, context, "CancelJob");
    if (!call.authorized()) return call.status();
    absl::StatusOr<JobInfo> job = head_.jobs->Cancel(request->job_id());
    if (!job.ok()) return call.Fail(job.status());
    head_.runner->StopJob(request->job_id(), "job cancelled by the user");
    head_.changed();
    *reply = ToPublic<v1::Job>(*job);
    return grpc::Status::OK;
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
    reply->set_head_id(head_.head_id);
    reply->set_head_started_unix_ms(head_.started_unix_ms);
    std::map<std::string, v1::Site> sites;
    for (const WorkerInfo& w : head_.registry->Workers()) {
      v1::Site& site = sites[w.site()];
      site.set_name(w.site());
      if (w.state() == WORKER_ALIVE) {
        site.set_alive_workers(site.alive_workers() + 1);
        site.set_devices(site.devices() + w.devices_size());
        for (const Device& d : w.devices()) site.set_tflops(site.tflops() + d.tflops());
      } else {
        site.set_dead_workers(site.dead_workers() + 1);
      }
      *reply->add_workers() = ToPublic<v1::Worker>(w);
    }
    for (auto& [name, site] : sites) *reply->add_sites() = std::move(site);
    for (const ActorRecord& a : head_.registry->Actors()) *reply->add_actors() = ToPublic<v1::Actor>(a);
    for (const SiteLink& link : head_.registry->SiteLinks()) *reply->add_site_links() = ToPublic<v1::SiteLink>(link);
    for (const auto& [state, count] : head_.jobs->CountByState()) {
      (*reply->mutable_jobs_by_state())[JobStateName(state)] = count;
    }
    return grpc::Status::OK;
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
    if (request->max_plans() < 0 || request->max_plans() > kMaxPlans) {
      return call.Fail(absl::InvalidArgumentError(absl::StrCat("max_plans must be 0..", kMaxPlans)));
    }
    absl::StatusOr<JobSpec> spec = RequestSpec(*request);
    if (!spec.ok()) return call.Fail(spec.status());
    ApplyJobDefaults(&*spec);
    if (absl::Status s = ValidateJobSpec(*spec); !s.ok()) {
      return call.Fail(WithContext(s, request->spec_source().empty() ? "spec" : request->spec_source()));
    }
    absl::StatusOr<RankedAutoPlans> ranked =
        RankAutoPlans(*spec, head_.registry->Workers(), head_.registry->SiteLinks(),
                      request->max_plans() == 0 ? kDefaultPlans : request->max_plans());
    if (!ranked.ok() && absl::IsUnavailable(ranked.status())) {
      // UNAVAILABLE means the head cannot be reached, to clients: nothing to plan on is the cluster's state.
      return call.Fail(absl::FailedPreconditionError(
          absl::StrCat(ranked.status().message(), "; start workers with `geotrain worker start`")));
    }
    if (!ranked.ok()) return call.Fail(ranked.status());
    for (size_t i = 0; i < ranked->plans.size(); ++i) {
      *reply->add_plans() = PublicPlan(ranked->plans[i], ranked->cluster, static_cast<int>(i) + 1);
    }
    for (const std::string& line : ranked->explanation) reply->add_explanation(line);
    reply->set_plans_simulated(ranked->plans_simulated);
    reply->set_planning_seconds(ranked->planning_seconds);
    reply->set_alive_workers(ranked->alive_workers);
    reply->set_devices(static_cast<int>(ranked->cluster.devices.size()));
    return grpc::Status::OK;
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

}  // namespace geotrain::head
