// The head's rendezvous through the real service: a head in this process on a loopback port, a real
// channel, comm::ExchangeRendezvous as the client. Publish then fetch, a fetch that waits for the publish,
// timeouts naming the key, size and count limits, write-once keys, unknown and ended jobs, wrong tokens.
#include "comm/rendezvous.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <future>
#include <thread>

#include "common/rpc.h"
#include "geotrain/v1/jobs.grpc.pb.h"
#include "head/head_server.h"

namespace geotrain {
namespace {

using head::HeadOptions;
using head::HeadServer;
using head::InProcessHeadOptions;
using head::RendezvousTable;

using ::testing::HasSubstr;

constexpr char kToken[] = "rendezvous-token";

class RendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_rendezvous_" + GenerateToken())).string();
    setenv("GEOTRAIN_HOME", (dir_ + "/home").c_str(), 1);
    HeadOptions options = InProcessHeadOptions(dir_ + "/state", kToken);
    options.heartbeat_interval_ms = 100;  // the detector, which drops ended jobs' keys, ticks every 100 ms
    options.heartbeat_timeout_ms = 400;
    head_ = std::make_unique<HeadServer>(options);
    absl::Status started = head_->Start();
    ASSERT_TRUE(started.ok()) << started;
    auto channel =
        grpc::CreateChannel("127.0.0.1:" + std::to_string(head_->port()), grpc::InsecureChannelCredentials());
    stub_ = internal::HeadControl::NewStub(channel);
    jobs_ = v1::Jobs::NewStub(channel);
    job_id_ = SubmitJob();  // no workers: it stays PENDING, so it may rendezvous
  }
  void TearDown() override {
    head_->Shutdown();
    std::filesystem::remove_all(dir_);
  }

  std::string SubmitJob() {
    grpc::ClientContext context;
    AttachToken(&context, kToken);
    v1::SubmitJobRequest request;
    request.mutable_spec()->set_name("rendezvous");
    v1::Job reply;
    grpc::Status s = jobs_->SubmitJob(&context, request, &reply);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return reply.job_id();
  }

  absl::StatusOr<std::string> Publish(const std::string& key, const std::string& value,
                                      const std::string& token = kToken) {
    return comm::ExchangeRendezvous(stub_.get(), token, job_id_, key, /*publisher=*/true, value, absl::Seconds(5));
  }
  absl::StatusOr<std::string> Fetch(const std::string& key, absl::Duration timeout, const std::string& token = kToken) {
    return comm::ExchangeRendezvous(stub_.get(), token, job_id_, key, /*publisher=*/false, "", timeout);
  }

  std::string dir_;
  std::unique_ptr<HeadServer> head_;
  std::unique_ptr<internal::HeadControl::Stub> stub_;
  std::unique_ptr<v1::Jobs::Stub> jobs_;  // the public API: jobs to rendezvous in
  std::string job_id_;
};

TEST_F(RendezvousTest, PublishThenFetch) {
  std::string id(128, '\0');
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(i * 7);  // binary bytes, zeros included
  auto published = Publish("nccl/site-a/attempt1", id);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(*published, id);
  auto fetched = Fetch("nccl/site-a/attempt1", absl::Seconds(5));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(*fetched, id);
  auto again = Fetch("nccl/site-a/attempt1", absl::ZeroDuration());  // already there: no wait needed
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, id);
}

TEST_F(RendezvousTest, FetchWaitsForThePublish) {
  const absl::Time start = absl::Now();
  auto fetchers = std::vector<std::future<absl::StatusOr<std::string>>>();
  for (int i = 0; i < 3; ++i) {
    fetchers.push_back(std::async(std::launch::async, [&] { return Fetch("late", absl::Seconds(20)); }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  ASSERT_TRUE(Publish("late", "the-id").ok());
  for (auto& f : fetchers) {
    auto fetched = f.get();
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    EXPECT_EQ(*fetched, "the-id");
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(400));
  EXPECT_LT(took, absl::Seconds(5)) << "the waiters are woken by the publish, not by their timeout";
}

TEST_F(RendezvousTest, FetchTimesOutNamingTheKey) {
  const absl::Time start = absl::Now();
  auto fetched = Fetch("never-published", absl::Milliseconds(300));
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kDeadlineExceeded) << fetched.status();
  EXPECT_THAT(fetched.status().message(), HasSubstr("never-published"));
  EXPECT_THAT(fetched.status().message(), HasSubstr(job_id_));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(RendezvousTest, HeadRefusesWaitsOverSixtySeconds) {
  grpc::ClientContext context;
  AttachToken(&context, kToken);
  FetchRendezvousRequest request;
  request.set_job_id(job_id_);
  request.set_key("k");
  request.set_timeout_ms(60001);
  FetchRendezvousReply reply;
  grpc::Status s = stub_->FetchRendezvous(&context, request, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("60000"));
}

TEST_F(RendezvousTest, ValueSizeAndKeyLimits) {
  EXPECT_TRUE(Publish("fits", std::string(4096, 'x')).ok());
  auto oversize = Publish("too-big", std::string(4097, 'x'));
  EXPECT_EQ(oversize.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(oversize.status().message(), HasSubstr("4097"));
  EXPECT_EQ(Fetch("too-big", absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded)
      << "nothing of a refused value is stored";
  EXPECT_EQ(Publish("", "v").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(std::string(257, 'k'), "v").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RendezvousTest, KeysAreWriteOnce) {
  ASSERT_TRUE(Publish("once", "first").ok());
  EXPECT_TRUE(Publish("once", "first").ok()) << "a retried publish of the same value is fine";
  auto different = Publish("once", "second");
  EXPECT_EQ(different.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*Fetch("once", absl::ZeroDuration()), "first");
}

TEST_F(RendezvousTest, KeysPerJobAreBounded) {
  for (int i = 0; i < RendezvousTable::kMaxKeysPerJob; ++i) {
    ASSERT_TRUE(Publish("key-" + std::to_string(i), "v").ok()) << i;
  }
  EXPECT_EQ(Publish("one-too-many", "v").status().code(), absl::StatusCode::kResourceExhausted);
  job_id_ = SubmitJob();
  EXPECT_TRUE(Publish("key-0", "v").ok()) << "the bound is per job";
}

TEST_F(RendezvousTest, UnknownAndEndedJobs) {
  const std::string known = job_id_;
  job_id_ = "job-999999";
  EXPECT_EQ(Publish("k", "v").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Fetch("k", absl::ZeroDuration()).status().code(), absl::StatusCode::kNotFound);
  job_id_ = known;

  ASSERT_TRUE(Publish("published", "v").ok());
  auto waiting = std::async(std::launch::async, [&] { return Fetch("unpublished", absl::Seconds(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  grpc::ClientContext context;
  AttachToken(&context, kToken);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job_id_);
  v1::Job cancelled;
  ASSERT_TRUE(jobs_->CancelJob(&context, cancel, &cancelled).ok());

  const absl::Time start = absl::Now();
  auto woken = waiting.get();
  EXPECT_EQ(woken.status().code(), absl::StatusCode::kFailedPrecondition) << woken.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the job's end wakes its waiters";
  EXPECT_EQ(Fetch("published", absl::ZeroDuration()).status().code(), absl::StatusCode::kFailedPrecondition)
      << "an ended job's keys are gone";
  EXPECT_EQ(Publish("new", "v").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(RendezvousTest, WrongTokenIsRefused) {
  EXPECT_EQ(Publish("k", "v", "wrong-token").status().code(), absl::StatusCode::kUnauthenticated);
  ASSERT_TRUE(Publish("k", "v").ok());
  EXPECT_EQ(Fetch("k", absl::Seconds(1), "wrong-token").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Fetch("k", absl::Seconds(1), "").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(RendezvousTest, UnreachableHeadEndsByTheDeadline) {
  auto unreachable =
      internal::HeadControl::NewStub(grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
  const absl::Time start = absl::Now();
  auto fetched = comm::ExchangeRendezvous(unreachable.get(), kToken, job_id_, "k", false, "", absl::Milliseconds(800));
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kDeadlineExceeded) << fetched.status();
  EXPECT_THAT(fetched.status().message(), HasSubstr("'k'"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

}  // namespace
}  // namespace geotrain
