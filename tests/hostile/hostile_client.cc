// hostile_client: sends COUNT malformed or random-byte requests to one geotrain port, from 8 threads, and prints
// how each kind of request ended. Used by tests/hostile/hostile_test.py (which then checks that the processes still
// serve); reproducible for one SEED.
//
//   hostile_client head    127.0.0.1:PORT COUNT SEED TOKEN   # the head's gRPC port
//   hostile_client worker  127.0.0.1:PORT COUNT SEED TOKEN   # a worker's port: its service and tensor streams
//   hostile_client metrics 127.0.0.1:PORT COUNT SEED         # a /metrics port
//
// Requests (chosen per request number, each with its own random bytes):
//   raw      a TCP connection that sends random bytes (sometimes after the HTTP/2 preface) and reads what comes back;
//   garbage  a gRPC call to one of the service's methods (found in the proto descriptors) with the right token and
//            a payload that cannot parse (it starts with field number 0);
//   notoken  the same with no token or a wrong one and a random payload;
//   unknown  a gRPC call to a method that does not exist;
//   chunks   (worker) a tensor stream with the right token carrying 1-4 random or mutated TensorChunks, some
//            announcing tensors of up to 64 MiB that never come;
//   http     (metrics) random bytes, a request cut short, an oversized head, or a real GET /metrics (answered 200
//            or, at the connection cap, 503: counted as "http:get-ok" / "http:get-busy" / "http:get-failed").
// Every call has a 5 s deadline and every socket 2 s timeouts, so the run is bounded. Output: one line per
// outcome, "KIND:OUTCOME COUNT", then "elapsed_s S". Exit status 0 (the caller judges the outcomes).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "control.pb.h"
#include "geotrain/v1/cluster.pb.h"
#include "geotrain/v1/jobs.pb.h"
#include "geotrain/v1/planner.pb.h"
#include "google/protobuf/descriptor.h"
#include "internal.pb.h"
#include "proto/service_descriptors.h"
#include "staging.pb.h"
#include "tensor.pb.h"

namespace {

constexpr char kTokenKey[] = "x-geotrain-token";
constexpr int kThreads = 8;

struct Target {
  std::string kind, address, token;
  std::shared_ptr<grpc::Channel> channel;
  std::vector<std::string> methods;  // "/package.Service/Method"
};

class Tally {
 public:
  void Add(const std::string& outcome) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[outcome];
  }
  void Print() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [outcome, n] : counts_) std::printf("%s %d\n", outcome.c_str(), n);
  }

 private:
  std::mutex mu_;
  std::map<std::string, int> counts_;
};

std::string RandomBytes(std::mt19937_64& rng, size_t max_len) {
  std::string out(std::uniform_int_distribution<size_t>(0, max_len)(rng), '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

std::vector<std::string> MethodsOf(const std::vector<std::string>& services) {
  std::vector<std::string> out;
  for (const std::string& name : services) {
    const google::protobuf::ServiceDescriptor* s = geotrain::FindServiceDescriptor(name);
    if (s == nullptr) {  // a renamed service: attacking fewer methods than the server has would prove little
      std::fprintf(stderr, "hostile_client: no service %s in this binary's protos\n", name.c_str());
      std::exit(2);
    }
    for (int i = 0; i < s->method_count(); ++i) out.push_back("/" + name + "/" + s->method(i)->name());
  }
  return out;
}

// Sends `bytes` on a new connection, reads the answer until the peer closes (or 2 s), returns what came back.
std::string RawExchange(const std::string& address, const std::string& bytes, bool* connected) {
  const size_t colon = address.rfind(':');
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  *connected = false;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints, &found) != 0) return "";
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval timeout{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string answer;
  if (::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    *connected = true;
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::shutdown(fd, SHUT_WR);
    char buf[4096];
    ssize_t n;
    while (answer.size() < (1 << 20) && (n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, n);
  }
  ::close(fd);
  freeaddrinfo(found);
  return answer;
}

std::string CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "CODE_" + std::to_string(c);
}

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

void Deadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

grpc::Status Unary(const Target& t, const std::string& method, const std::string& token, const std::string& payload) {
  grpc::ClientContext context;
  Deadline(&context);
  if (!token.empty()) context.AddMetadata(kTokenKey, token);
  grpc::ByteBuffer response;
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      t.channel.get(), grpc::internal::RpcMethod(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC), &context,
      ToBuffer(payload), &response);
}

// A TensorChunk that looks like the first chunk of a real tensor (header, offset 0), then mutated.
std::string NearlyValidChunk(std::mt19937_64& rng) {
  geotrain::TensorChunk chunk;
  geotrain::TensorHeader* h = chunk.mutable_header();
  h->mutable_key()->set_job_id(rng() % 2 ? "job-hostile" : std::string(rng() % 600, 'j'));
  h->mutable_key()->set_tensor_id("t" + std::to_string(rng() % 1000));
  h->mutable_key()->set_src("hostile-" + std::to_string(rng() % 50));
  h->set_dtype(geotrain::TENSOR_DTYPE_F32);
  const int64_t elements = static_cast<int64_t>(rng() % (16 << 20));  // up to 64 MiB as fp32
  h->add_shape(elements);
  if (rng() % 8 == 0) h->add_shape(-1);
  h->set_codec(rng() % 4 == 0 ? "bf16" : "none");
  h->set_total_bytes(rng() % 4 == 0 ? rng() : 40 + 4 * static_cast<uint64_t>(elements));
  h->set_checksum(static_cast<uint32_t>(rng()));
  h->set_chunk_bytes(rng() % 3 == 0 ? rng() : 1 << 20);
  chunk.set_offset(rng() % 4 == 0 ? rng() % 100 : 0);
  chunk.set_last(rng() % 2);
  chunk.set_payload(RandomBytes(rng, 4096));
  std::string bytes = chunk.SerializeAsString();
  const int flips = static_cast<int>(rng() % 4);
  for (int i = 0; i < flips && !bytes.empty(); ++i) bytes[rng() % bytes.size()] = static_cast<char>(rng());
  if (rng() % 4 == 0 && !bytes.empty()) bytes.resize(rng() % bytes.size());
  return bytes;
}

grpc::Status TensorStream(const Target& t, const std::string& token, std::mt19937_64& rng) {
  grpc::ClientContext context;
  Deadline(&context);
  if (!token.empty()) context.AddMetadata(kTokenKey, token);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          t.channel.get(),
          grpc::internal::RpcMethod("/geotrain.TensorStream/Stream", grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
  const int messages = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < messages; ++i) {
    const std::string bytes = rng() % 3 == 0 ? RandomBytes(rng, 8192) : NearlyValidChunk(rng);
    if (!call->Write(ToBuffer(bytes))) break;
  }
  // Half the streams stop mid-tensor by ending the call, the others just go away (cancelled at the end of scope).
  if (rng() % 2 == 0) {
    call->WritesDone();
    grpc::ByteBuffer ack;
    while (call->Read(&ack)) {
    }
    return call->Finish();
  }
  context.TryCancel();
  return call->Finish();
}

void OneRequest(const Target& t, uint64_t i, uint64_t seed, Tally* tally) {
  std::mt19937_64 rng(seed * 1000003 + i);
  bool connected = false;
  if (t.kind == "metrics") {
    switch (i % 5) {
      case 0:
        RawExchange(t.address, RandomBytes(rng, 4096), &connected);
        tally->Add(connected ? "http:random" : "http:refused");
        return;
      case 1:
        RawExchange(t.address, "GET /metr", &connected);
        tally->Add(connected ? "http:cut-short" : "http:refused");
        return;
      case 2:
        RawExchange(t.address, "GET /metrics HTTP/1.1\r\nX: " + std::string(64 << 10, 'x'), &connected);
        tally->Add(connected ? "http:oversized" : "http:refused");
        return;
      case 3:
        RawExchange(t.address, "", &connected);
        tally->Add(connected ? "http:empty" : "http:refused");
        return;
      default: {
        const std::string answer = RawExchange(t.address, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &connected);
        tally->Add(answer.starts_with("HTTP/1.1 200") && answer.find("process_open_fds") != std::string::npos
                       ? "http:get-ok"
                   : answer.starts_with("HTTP/1.1 503") ? "http:get-busy"
                                                        : "http:get-failed");
        return;
      }
    }
  }
  const int kinds = t.kind == "worker" ? 5 : 4;
  switch (i % kinds) {
    case 0: {
      std::string bytes = RandomBytes(rng, 2048);
      if (rng() % 2 == 0) bytes = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes;
      RawExchange(t.address, bytes, &connected);
      tally->Add(connected ? "raw:sent" : "raw:refused");
      return;
    }
    case 1: {
      const std::string& method = t.methods[rng() % t.methods.size()];
      tally->Add("garbage:" +
                 CodeName(Unary(t, method, t.token, std::string(1, '\0') + RandomBytes(rng, 2048)).error_code()));
      return;
    }
    case 2: {
      const std::string& method = t.methods[rng() % t.methods.size()];
      const std::string token = rng() % 2 ? "" : RandomBytes(rng, 40);
      // Metadata values must be printable: a wrong token of random letters.
      std::string printable = token;
      for (char& c : printable) c = static_cast<char>('a' + static_cast<unsigned char>(c) % 26);
      tally->Add("notoken:" + CodeName(Unary(t, method, printable, RandomBytes(rng, 2048)).error_code()));
      return;
    }
    case 3:
      tally->Add(
          "unknown:" +
          CodeName(
              Unary(t, "/geotrain.Nope/M" + std::to_string(rng() % 100), t.token, RandomBytes(rng, 256)).error_code()));
      return;
    default:
      tally->Add("chunks:" + CodeName(TensorStream(t, rng() % 8 == 0 ? "" : t.token, rng).error_code()));
      return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s head|worker|metrics HOST:PORT COUNT SEED [TOKEN]\n", argv[0]);
    return 2;
  }
  Target t;
  t.kind = argv[1];
  t.address = argv[2];
  const uint64_t count = std::strtoull(argv[3], nullptr, 10);
  const uint64_t seed = std::strtoull(argv[4], nullptr, 10);
  t.token = argc > 5 ? argv[5] : "";
  if (t.kind != "metrics") {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
    t.channel = grpc::CreateCustomChannel(t.address, grpc::InsecureChannelCredentials(), args);
    t.methods = MethodsOf(
        t.kind == "head"
            ? std::vector<std::string>{"geotrain.internal.HeadControl", "geotrain.v1.Jobs", "geotrain.v1.Cluster",
                                       "geotrain.v1.Planner", "geotrain.DataStaging"}
            : std::vector<std::string>{"geotrain.internal.Worker", "geotrain.TensorStream", "geotrain.DataStaging"});
    if (t.methods.empty()) {
      std::fprintf(stderr, "hostile_client: no methods found for %s\n", t.kind.c_str());
      return 2;
    }
  }
  Tally tally;
  std::atomic<uint64_t> next{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&] {
      for (uint64_t i = next++; i < count; i = next++) OneRequest(t, i, seed, &tally);
    });
  }
  for (std::thread& thread : threads) thread.join();
  tally.Print();
  std::printf("elapsed_s %.2f\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}
