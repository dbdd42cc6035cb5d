// Every RPC of the head's services (the public geotrain.v1 ones and the internal HeadControl) and the worker's
// refuses calls without the cluster token or with a wrong one (UNAUTHENTICATED), and accepts the right one. Methods are enumerated from the service
// descriptors and called through a generic stub, so a method added later is covered too.
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "common/rpc.h"
#include "common/spec.h"
#include "google/protobuf/descriptor.h"
#include "head/head_server.h"
#include "internal.grpc.pb.h"
#include "internal.pb.h"
#include "proto/service_descriptors.h"
#include "worker/worker_server.h"

namespace geotrain {
namespace {

using head::HeadServer;
using head::InProcessHeadOptions;
using worker::WorkerOptions;
using worker::WorkerServer;

grpc::StatusCode CallWithToken(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                               const std::string* token) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  if (token != nullptr) AttachToken(&context, *token);
  SetDeadlineMillis(&context, 5000);
  grpc::CompletionQueue cq;
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  auto call = stub.PrepareUnaryCall(&context, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status.error_code();
}

std::vector<std::string> Methods(const google::protobuf::ServiceDescriptor* service) {
  std::vector<std::string> out;
  for (int i = 0; i < service->method_count(); ++i) {
    out.push_back("/" + service->full_name() + "/" + service->method(i)->name());
  }
  return out;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_auth_" + GenerateToken())).string();
    setenv("GEOTRAIN_HOME", (dir_ + "/home").c_str(), 1);
    head_ = std::make_unique<HeadServer>(InProcessHeadOptions(dir_ + "/state", "right-token"));
    absl::Status started = head_->Start();
    ASSERT_TRUE(started.ok()) << started;
    WorkerOptions w;
    w.head_address = "127.0.0.1:" + std::to_string(head_->port());
    w.site = "s";
    w.bind_host = "127.0.0.1";
    w.metrics_port = -1;
    w.token = "right-token";
    w.emulated_devices.push_back(Device());
    w.emulated_devices[0].set_name("T4");
    w.emulated_devices[0].set_tflops(65);
    worker_ = std::make_unique<WorkerServer>(w);
    started = worker_->Start();
    ASSERT_TRUE(started.ok()) << started;
  }
  void TearDown() override {
    worker_->Shutdown();
    head_->Shutdown();
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
  std::unique_ptr<HeadServer> head_;
  std::unique_ptr<WorkerServer> worker_;
};

TEST_F(AuthTest, EveryMethodNeedsTheToken) {
  const std::string wrong = "wrong-token";
  const std::string right = "right-token";
  struct Target {
    int port;
    const google::protobuf::ServiceDescriptor* service;
  };
  for (const Target& t : {Target{head_->port(), FindServiceDescriptor("geotrain.internal.HeadControl")},
                          Target{head_->port(), FindServiceDescriptor("geotrain.v1.Jobs")},
                          Target{head_->port(), FindServiceDescriptor("geotrain.v1.Cluster")},
                          Target{head_->port(), FindServiceDescriptor("geotrain.v1.Planner")},
                          Target{worker_->port(), FindServiceDescriptor("geotrain.internal.Worker")}}) {
    ASSERT_NE(t.service, nullptr);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(t.port), grpc::InsecureChannelCredentials());
    for (const std::string& method : Methods(t.service)) {
      EXPECT_EQ(CallWithToken(channel, method, nullptr), grpc::StatusCode::UNAUTHENTICATED) << method;
      EXPECT_EQ(CallWithToken(channel, method, &wrong), grpc::StatusCode::UNAUTHENTICATED) << method;
      EXPECT_NE(CallWithToken(channel, method, &right), grpc::StatusCode::UNAUTHENTICATED) << method;
    }
  }
}

// The rendezvous methods are among the enumerated ones; with the right token an empty request reaches the
// handler, which refuses it at once (no job id) rather than waiting.
TEST_F(AuthTest, RendezvousMethodsAreCovered) {
  const auto* head = FindServiceDescriptor("geotrain.internal.HeadControl");
  ASSERT_NE(head, nullptr);
  const std::vector<std::string> methods = Methods(head);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(head_->port()), grpc::InsecureChannelCredentials());
  const std::string right = "right-token";
  for (const std::string method :
       {"/geotrain.internal.HeadControl/PublishRendezvous", "/geotrain.internal.HeadControl/FetchRendezvous"}) {
    EXPECT_NE(std::find(methods.begin(), methods.end(), method), methods.end()) << method;
    EXPECT_EQ(CallWithToken(channel, method, nullptr), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_EQ(CallWithToken(channel, method, &right), grpc::StatusCode::INVALID_ARGUMENT) << method;
  }
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// Inputs from the network are checked before the actor indexes with them: a plan with dp 0 or an
// actor outside its plan is refused, and the worker keeps serving.
TEST_F(AuthTest, CreateActorRefusesMalformedPlans) {
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(worker_->port()), grpc::InsecureChannelCredentials());
  auto stub = internal::Worker::NewStub(channel);
  auto call = [&](const CreateActorRequest& request) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, "right-token");
    CreateActorReply reply;
    return stub->CreateActor(&ctx, request, &reply);
  };
  CreateActorRequest request;
  request.mutable_actor()->set_actor_id("a-1");
  request.mutable_actor()->set_job_id("job-1");
  ApplyJobDefaults(request.mutable_spec());
  request.mutable_spec()->mutable_parallel()->set_dp(0);
  grpc::Status s = call(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();

  request.mutable_spec()->mutable_parallel()->set_dp(1);
  request.mutable_actor()->set_stage(3);  // pp is 1
  ActorPeer* peer = request.add_peers();
  peer->set_actor_id("a-1");
  s = call(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("outside the plan"), std::string::npos);

  request.mutable_actor()->set_stage(0);
  peer->set_actor_id("someone-else");
  s = call(request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("peer list"), std::string::npos);

  grpc::ClientContext ctx;
  AttachToken(&ctx, "right-token");
  PingReply reply;
  EXPECT_TRUE(stub->Ping(&ctx, PingRequest(), &reply).ok()) << "the worker still serves";
}

}  // namespace
}  // namespace geotrain
