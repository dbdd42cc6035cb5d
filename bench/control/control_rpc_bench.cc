// Control-plane round trips on loopback against a real head (gRPC, token checked, metrics recorded):
// a sync unary call, a round trip on one bidirectional stream, and pipelined stream writes (many in
// flight). Compare with Ray's published 1:1 actor calls: about 2,000/s sync, 8,000-9,000/s async.
//
//   build/bin/bench_control_rpc --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <filesystem>
#include <thread>

#include "common/rpc.h"
#include "head/head_server.h"
#include "internal.grpc.pb.h"

namespace geotrain {
namespace {

using head::HeadOptions;
using head::HeadServer;

struct Fixture {
  Fixture() {
    dir = (std::filesystem::temp_directory_path() / ("geotrain_bench_" + GenerateToken())).string();
    HeadOptions options;
    options.bind_host = "127.0.0.1";
    options.port = 0;
    options.metrics_port = 0;
    options.state_dir = dir;
    options.token = "bench-token";
    options.write_cluster_record = false;
    head = std::make_unique<HeadServer>(options);
    if (!head->Start().ok()) std::abort();
    stub = internal::HeadControl::NewStub(*MakeChannel("127.0.0.1:" + std::to_string(head->port()), TlsFiles{}));
  }
  ~Fixture() {
    head->Shutdown();
    std::filesystem::remove_all(dir);
  }
  std::string dir;
  std::unique_ptr<HeadServer> head;
  std::unique_ptr<internal::HeadControl::Stub> stub;
};

Fixture& Get() {
  static Fixture* f = new Fixture();
  return *f;
}

void BM_UnaryPing(benchmark::State& state) {
  Fixture& f = Get();
  PingRequest request;
  request.set_payload(std::string(state.range(0), 'x'));
  PingReply reply;
  for (auto _ : state) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, "bench-token");
    grpc::Status s = f.stub->Ping(&ctx, request, &reply);
    if (!s.ok()) state.SkipWithError(s.error_message().c_str());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_UnaryPing)->Arg(16)->Arg(4096)->UseRealTime();

void BM_StreamPingPong(benchmark::State& state) {
  Fixture& f = Get();
  grpc::ClientContext ctx;
  AttachToken(&ctx, "bench-token");
  auto stream = f.stub->PingStream(&ctx);
  PingRequest request;
  request.set_payload(std::string(state.range(0), 'x'));
  PingReply reply;
  for (auto _ : state) {
    if (!stream->Write(request) || !stream->Read(&reply)) state.SkipWithError("stream broke");
  }
  stream->WritesDone();
  (void)stream->Finish();
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_StreamPingPong)->Arg(16)->Arg(4096)->UseRealTime();

// Pipelined: a writer thread keeps calls in flight while this thread reads the replies (the shape of
// async actor calls).
void BM_StreamPipelined(benchmark::State& state) {
  Fixture& f = Get();
  constexpr int kBatch = 1000;
  PingRequest request;
  request.set_payload(std::string(16, 'x'));
  for (auto _ : state) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, "bench-token");
    auto stream = f.stub->PingStream(&ctx);
    std::thread writer([&] {
      for (int i = 0; i < kBatch; ++i) stream->Write(request);
      stream->WritesDone();
    });
    PingReply reply;
    int got = 0;
    while (stream->Read(&reply)) ++got;
    writer.join();
    (void)stream->Finish();
    if (got != kBatch) state.SkipWithError("lost replies");
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_StreamPipelined)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace geotrain

BENCHMARK_MAIN();
