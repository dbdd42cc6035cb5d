// The public API (geotrain.v1) through a real head in this process: the public messages mirror the head's
// records, specs given as text parse as the CLI parses files, errors carry their codes, event streams resume
// after a sequence number, and the planner ranks plans on the registered workers.
#include "head/public_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "common/rpc.h"
#include "geotrain/v1/cluster.grpc.pb.h"
#include "geotrain/v1/jobs.grpc.pb.h"
#include "geotrain/v1/planner.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "head/head_server.h"
#include "internal.grpc.pb.h"

namespace geotrain::head {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using ::testing::HasSubstr;

constexpr char kToken[] = "api-token";

// Every value of one enum is in the other, with the same number and name.
void ExpectSameEnum(const EnumDescriptor* a, const EnumDescriptor* b) {
  for (const auto& [x, y] : {std::pair{a, b}, std::pair{b, a}}) {
    for (int i = 0; i < x->value_count(); ++i) {
      const auto* other = y->FindValueByNumber(x->value(i)->number());
      ASSERT_NE(other, nullptr) << x->full_name() << " " << x->value(i)->name() << " has no twin in " << y->full_name();
      EXPECT_EQ(other->name(), x->value(i)->name()) << x->full_name();
    }
  }
}

// Every field of the public message has a twin in the record: same number, name, type and cardinality, and
// (recursively) the same shape when it is a message or an enum.
void ExpectMirror(const Descriptor* pub, const Descriptor* record) {
  for (int i = 0; i < pub->field_count(); ++i) {
    const FieldDescriptor* f = pub->field(i);
    const FieldDescriptor* twin = record->FindFieldByNumber(f->number());
    ASSERT_NE(twin, nullptr) << f->full_name() << " has no field " << f->number() << " in " << record->full_name();
    EXPECT_EQ(twin->name(), f->name()) << f->full_name();
    EXPECT_EQ(twin->type(), f->type()) << f->full_name();
    EXPECT_EQ(twin->is_repeated(), f->is_repeated()) << f->full_name();
    EXPECT_EQ(twin->is_map(), f->is_map()) << f->full_name();
    if (f->message_type() != nullptr && f->message_type() != twin->message_type()) {
      ExpectMirror(f->message_type(), twin->message_type());
    }
    if (f->enum_type() != nullptr) ExpectSameEnum(f->enum_type(), twin->enum_type());
  }
}

TEST(PublicApiMirrorTest, PublicMessagesMirrorTheHeadsRecords) {
  ExpectMirror(v1::Job::descriptor(), JobInfo::descriptor());
  ExpectMirror(v1::JobEvent::descriptor(), JobEvent::descriptor());
  ExpectMirror(v1::Worker::descriptor(), WorkerInfo::descriptor());
  ExpectMirror(v1::Actor::descriptor(), ActorRecord::descriptor());
  ExpectMirror(v1::SiteLink::descriptor(), SiteLink::descriptor());
  // The head's bookkeeping stays out of the public job.
  EXPECT_EQ(v1::Job::descriptor()->FindFieldByName("pending_shards"), nullptr);
}

TEST(PublicApiMirrorTest, ProjectionKeepsSharedFieldsAndDropsTheRest) {
  JobInfo job;
  job.set_job_id("job-000007");
  job.set_state(JOB_RESTARTING);
  job.mutable_spec()->mutable_train()->set_steps(12);
  job.add_faults()->set_cause("worker w-1 died");
  job.add_pending_shards()->set_actor_id("a");
  const v1::Job projected = ToPublic<v1::Job>(job);
  EXPECT_EQ(projected.job_id(), "job-000007");
  EXPECT_EQ(projected.state(), v1::JOB_RESTARTING);
  EXPECT_EQ(projected.spec().train().steps(), 12);
  EXPECT_EQ(projected.faults(0).cause(), "worker w-1 died");
  EXPECT_TRUE(projected.GetReflection()->GetUnknownFields(projected).empty());
}

class PublicApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_api_" + GenerateToken())).string();
    setenv("GEOTRAIN_HOME", (dir_ + "/home").c_str(), 1);
    head_ = std::make_unique<HeadServer>(InProcessHeadOptions(dir_ + "/state", kToken));
    absl::Status started = head_->Start();
    ASSERT_TRUE(started.ok()) << started;
    auto channel =
        grpc::CreateChannel("127.0.0.1:" + std::to_string(head_->port()), grpc::InsecureChannelCredentials());
    jobs_ = v1::Jobs::NewStub(channel);
    cluster_ = v1::Cluster::NewStub(channel);
    planner_ = v1::Planner::NewStub(channel);
    control_ = internal::HeadControl::NewStub(channel);
  }
  void TearDown() override {
    head_->Shutdown();
    std::filesystem::remove_all(dir_);
  }
  grpc::ClientContext* Prepare(grpc::ClientContext* ctx) {
    AttachToken(ctx, kToken);
    SetDeadlineMillis(ctx, 10000);
    return ctx;
  }
  grpc::Status Submit(const std::string& text, v1::Job* job, const std::string& base_dir = "") {
    grpc::ClientContext ctx;
    v1::SubmitJobRequest request;
    request.set_spec_text(text);
    request.set_spec_source("job.yaml");
    request.set_base_dir(base_dir);
    return jobs_->SubmitJob(Prepare(&ctx), request, job);
  }
  std::vector<v1::JobEvent> Watch(const std::string& job_id, int64_t after_seq, bool follow, grpc::Status* status) {
    grpc::ClientContext ctx;
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_after_seq(after_seq);
    request.set_follow(follow);
    auto reader = jobs_->WatchJob(Prepare(&ctx), request);
    std::vector<v1::JobEvent> events;
    v1::JobEvent event;
    while (reader->Read(&event)) events.push_back(event);
    *status = reader->Finish();
    return events;
  }
  void RegisterWorker(const std::string& id, const std::string& site) {
    grpc::ClientContext ctx;
    RegisterWorkerRequest request;
    request.set_worker_id(id);
    request.set_site(site);
    request.set_address("127.0.0.1:1");  // never dialled: no job runs here
    Device* device = request.add_devices();
    device->set_kind(DEVICE_KIND_EMULATED);
    device->set_name("T4");
    device->set_tflops(65);
    device->set_memory_bytes(16ull << 30);
    RegisterWorkerReply reply;
    ASSERT_TRUE(control_->RegisterWorker(Prepare(&ctx), request, &reply).ok());
  }

  std::string dir_;
  std::unique_ptr<HeadServer> head_;
  std::unique_ptr<v1::Jobs::Stub> jobs_;
  std::unique_ptr<v1::Cluster::Stub> cluster_;
  std::unique_ptr<v1::Planner::Stub> planner_;
  std::unique_ptr<internal::HeadControl::Stub> control_;
};

constexpr char kSpec[] =
    "name: api\nmodel: {preset: gpt2-tiny-test}\ndata: {train: data/train_*.bin}\n"
    "train: {global_batch: 8, seq_len: 16, steps: 4}\n";

TEST_F(PublicApiTest, SpecTextParsesAsTheCliParsesFiles) {
  v1::Job job;
  grpc::Status s = Submit("name: x\ntrain: {stepz: 3}\n", &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("job.yaml"));
  EXPECT_THAT(s.error_message(), HasSubstr("unknown key 'train.stepz'"));

  s = Submit(kSpec, &job, "relative/dir");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("base_dir"));

  s = Submit(kSpec, &job, "/home/someone/work");
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(job.job_id(), "job-000001");
  EXPECT_EQ(job.state(), v1::JOB_PENDING);
  EXPECT_EQ(job.spec().data().train(), "/home/someone/work/data/train_*.bin");
  EXPECT_EQ(job.spec().train().lr(), 6e-4) << "defaults filled";
}

TEST_F(PublicApiTest, ErrorsCarryTheirCodes) {
  grpc::ClientContext get_ctx;
  v1::GetJobRequest get;
  get.set_job_id("job-424242");
  v1::Job job;
  grpc::Status s = jobs_->GetJob(Prepare(&get_ctx), get, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("job-424242"));

  grpc::Status watch;
  Watch("job-424242", 0, false, &watch);
  EXPECT_EQ(watch.error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(Submit(kSpec, &job).ok());
  for (grpc::StatusCode expected : {grpc::StatusCode::OK, grpc::StatusCode::FAILED_PRECONDITION}) {
    grpc::ClientContext ctx;
    v1::CancelJobRequest cancel;
    cancel.set_job_id(job.job_id());
    v1::Job cancelled;
    s = jobs_->CancelJob(Prepare(&ctx), cancel, &cancelled);
    EXPECT_EQ(s.error_code(), expected) << s.error_message();
    if (s.ok()) EXPECT_EQ(cancelled.state(), v1::JOB_CANCELLED);
  }

  grpc::ClientContext unauthenticated;
  SetDeadlineMillis(&unauthenticated, 10000);
  v1::ListJobsReply list;
  EXPECT_EQ(jobs_->ListJobs(&unauthenticated, v1::ListJobsRequest(), &list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(PublicApiTest, EventStreamsResumeAfterASequenceNumber) {
  v1::Job job;
  ASSERT_TRUE(Submit(kSpec, &job).ok());
  grpc::ClientContext ctx;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job.job_id());
  v1::Job cancelled;
  ASSERT_TRUE(jobs_->CancelJob(Prepare(&ctx), cancel, &cancelled).ok());

  grpc::Status status;
  const std::vector<v1::JobEvent> all = Watch(job.job_id(), 0, /*follow=*/true, &status);  // ends: the job has
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_GE(all.size(), 2u);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_GT(all[i].seq(), all[i - 1].seq());
  EXPECT_EQ(all.front().kind(), "state");
  EXPECT_EQ(all.back().state(), v1::JOB_CANCELLED);

  const std::vector<v1::JobEvent> rest = Watch(job.job_id(), all.front().seq(), false, &status);
  ASSERT_EQ(rest.size(), all.size() - 1);
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].seq(), all[i + 1].seq());
  EXPECT_TRUE(Watch(job.job_id(), all.back().seq(), true, &status).empty());
}

TEST_F(PublicApiTest, PlannerRanksPlansOnTheRegisteredWorkers) {
  grpc::ClientContext empty_ctx;
  v1::PlanJobRequest request;
  request.set_spec_text(kSpec);
  v1::PlanJobReply reply;
  grpc::Status s = planner_->PlanJob(Prepare(&empty_ctx), request, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << "no workers yet";
  EXPECT_THAT(s.error_message(), HasSubstr("no alive workers"));

  RegisterWorker("a-0", "site-a");
  RegisterWorker("a-1", "site-a");
  RegisterWorker("b-0", "site-b");
  RegisterWorker("b-1", "site-b");
  grpc::ClientContext ctx;
  request.set_max_plans(3);
  s = planner_->PlanJob(Prepare(&ctx), request, &reply);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(reply.alive_workers(), 4);
  EXPECT_EQ(reply.devices(), 4);
  ASSERT_GE(reply.plans_size(), 1);
  EXPECT_LE(reply.plans_size(), 3);
  EXPECT_FALSE(reply.explanation().empty());
  for (int i = 0; i < reply.plans_size(); ++i) {
    const v1::RankedPlan& plan = reply.plans(i);
    EXPECT_EQ(plan.rank(), i + 1);
    EXPECT_EQ(plan.parallel().plan(), "manual");
    EXPECT_GT(plan.predicted_step_seconds(), 0);
    EXPECT_EQ(plan.devices(), plan.parallel().dp() * plan.parallel().pp() * plan.parallel().tp());
    EXPECT_LE(plan.devices(), 4);
    if (i > 0) EXPECT_GE(plan.predicted_step_seconds(), reply.plans(i - 1).predicted_step_seconds());
  }

  grpc::ClientContext status_ctx;
  v1::ClusterStatus cluster;
  ASSERT_TRUE(cluster_->GetClusterStatus(Prepare(&status_ctx), v1::GetClusterStatusRequest(), &cluster).ok());
  EXPECT_EQ(cluster.workers_size(), 4);
  ASSERT_EQ(cluster.sites_size(), 2);
  EXPECT_EQ(cluster.sites(0).name(), "site-a");
  EXPECT_EQ(cluster.sites(0).alive_workers(), 2);
  EXPECT_EQ(cluster.head_id(), head_->head_id());
}

// Cluster.DrainWorker: the worker is marked draining (in status, and in what the planner plans on); errors carry
// their codes; the internal HeadControl.DrainWorker (a worker's SIGTERM) does the same.
TEST_F(PublicApiTest, DrainWorkerMarksTheWorkerAndThePlannerLeavesItOut) {
  RegisterWorker("a-0", "site-a");
  RegisterWorker("a-1", "site-a");
  auto drain = [&](const std::string& id, v1::Worker* worker) {
    grpc::ClientContext ctx;
    v1::DrainWorkerRequest request;
    request.set_worker_id(id);
    return cluster_->DrainWorker(Prepare(&ctx), request, worker);
  };
  v1::Worker worker;
  EXPECT_EQ(drain("nobody", &worker).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(drain("", &worker).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::Status s = drain("a-0", &worker);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(worker.worker_id(), "a-0");
  EXPECT_TRUE(worker.draining());
  EXPECT_TRUE(drain("a-0", &worker).ok()) << "draining again is no error";

  grpc::ClientContext internal_ctx;
  DrainWorkerRequest internal_request;
  internal_request.set_worker_id("a-1");
  WorkerInfo info;
  s = control_->DrainWorker(Prepare(&internal_ctx), internal_request, &info);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(info.draining());

  grpc::ClientContext status_ctx;
  v1::ClusterStatus cluster;
  ASSERT_TRUE(cluster_->GetClusterStatus(Prepare(&status_ctx), v1::GetClusterStatusRequest(), &cluster).ok());
  ASSERT_EQ(cluster.workers_size(), 2);
  for (const v1::Worker& w : cluster.workers()) EXPECT_TRUE(w.draining()) << w.worker_id();
  grpc::ClientContext plan_ctx;
  v1::PlanJobRequest request;
  request.set_spec_text(kSpec);
  v1::PlanJobReply reply;
  EXPECT_EQ(planner_->PlanJob(Prepare(&plan_ctx), request, &reply).error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << "both workers drain: nothing to plan on";
}

}  // namespace
}  // namespace geotrain::head
