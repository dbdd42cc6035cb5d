// Tensor streams kept open across Sends (one stream per peer reused, a closed pooled stream replaced, the deadline
// of a Send on a reused stream, Shutdown ending streams that clients keep open) and tensors decoded on arrival into
// a waiting RecvInto (bit-exact for none, fp16 and bf16 at odd sizes, the mailbox path when the tensor came first or
// its codec is not element-wise, and malformed or late tensors never reported as received). Real gRPC servers on
// loopback; malformed chunks go through the generated stub.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "comm/tensor_stream.h"
#include "comm/tensor_stream_testing.h"
#include "gtest/gtest.h"
#include "tensor.grpc.pb.h"

namespace geotrain::comm {
namespace {

constexpr char kToken[] = "reuse-token";

TensorKey Key(const std::string& tensor, int64_t step = 1) { return TensorKey{"job-r", step, 0, tensor, "sender"}; }

absl::Time Soon(int seconds = 20) { return absl::Now() + absl::Seconds(seconds); }

class Endpoint : public LoopbackEndpoint {
 public:
  explicit Endpoint(int port = 0, TensorStreamOptions options = {}) : LoopbackEndpoint(kToken, options, port) {}
};

// What a local encode and decode of `data` gives: the values a receiver must see.
std::vector<float> ThroughCodec(const Codec& codec, const std::vector<float>& data) {
  Bytes encoded;
  EXPECT_TRUE(EncodeTensor(codec, data, &encoded).ok());
  std::vector<float> out(data.size());
  EXPECT_TRUE(DecodeTensor(encoded.span(), absl::MakeSpan(out)).ok());
  return out;
}

// Starts RecvInto on a thread and returns once it is waiting.
class WaitingReceiver {
 public:
  WaitingReceiver(TensorStreamServer* streams, const TensorKey& key, std::vector<float>* out, absl::Time deadline)
      : thread_([=, this] { status_ = streams->RecvInto(key, absl::MakeSpan(*out), deadline); }) {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (streams->stats().receivers_waiting == 0 && absl::Now() < give_up) absl::SleepFor(absl::Microseconds(50));
  }
  ~WaitingReceiver() {
    if (thread_.joinable()) thread_.join();
  }
  absl::Status Join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  std::thread thread_;
};

TEST(TensorStreamReuse, SequentialSendsShareOneStream) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  for (int i = 0; i < 40; ++i) {
    const std::vector<float> data = RandomTensor(1000 + 37 * i, i);
    ASSERT_TRUE(
        client.Send(endpoint.address(), Key("s", i), {static_cast<int64_t>(data.size())}, data, Codec{}, Soon()).ok());
    auto got = endpoint.streams().Recv(Key("s", i), Soon());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->Decode().value(), data);
  }
  EXPECT_EQ(client.stats().streams_opened, 1u);
  EXPECT_EQ(client.stats().tensors_sent, 40u);
}

TEST(TensorStreamReuse, ConcurrentSendsUseSeparateStreamsThenReuseThem) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  constexpr int kThreads = 4, kPerThread = 10;
  std::atomic<int> failures{0};
  for (int round = 0; round < 2; ++round) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) {
          const std::vector<float> data(20000, static_cast<float>(t * 1000 + i));
          const TensorKey key = Key("c" + std::to_string(t), round * 100 + i);
          if (!client.Send(endpoint.address(), key, {20000}, data, Codec{}, Soon()).ok()) ++failures;
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
  EXPECT_EQ(failures.load(), 0);
  for (int round = 0; round < 2; ++round) {
    for (int t = 0; t < kThreads; ++t) {
      for (int i = 0; i < kPerThread; ++i) {
        auto got = endpoint.streams().Recv(Key("c" + std::to_string(t), round * 100 + i), Soon());
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(got->Decode().value().back(), static_cast<float>(t * 1000 + i));
      }
    }
  }
  // At most one stream per concurrent Send, kept for the second round.
  EXPECT_LE(client.stats().streams_opened, static_cast<uint64_t>(kThreads));
}

TEST(TensorStreamReuse, AStreamClosedByARestartedReceiverIsReplaced) {
  TensorStreamClient client(kToken);
  auto first = std::make_unique<Endpoint>();
  const int port = first->port();
  const std::vector<float> data = RandomTensor(5000, 1);
  ASSERT_TRUE(client.Send(first->address(), Key("before"), {5000}, data, Codec{}, Soon()).ok());
  first.reset();  // Shutdown ends the stream the client keeps open
  Endpoint second(port);
  ASSERT_EQ(second.port(), port);
  // The pooled stream is closed: the Send notices before anything of the tensor is delivered, and sends it again
  // on a new stream.
  const absl::Status sent = client.Send(second.address(), Key("after"), {5000}, data, Codec{}, Soon());
  ASSERT_TRUE(sent.ok()) << sent;
  auto got = second.streams().Recv(Key("after"), Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->Decode().value(), data);
  EXPECT_EQ(client.stats().streams_opened, 2u);
}

TEST(TensorStreamReuse, ShutdownEndsStreamsClientsKeepOpen) {
  auto endpoint = std::make_unique<Endpoint>();
  TensorStreamClient client(kToken);
  const std::vector<float> data(100, 1.0f);
  ASSERT_TRUE(client.Send(endpoint->address(), Key("x"), {100}, data, Codec{}, Soon()).ok());
  // The client still holds its stream: grpc::Server::Shutdown() would wait for it without TensorStreamServer's.
  const absl::Time start = absl::Now();
  endpoint->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A receiver that reads the first chunk of every stream and then stops reading until released.
class StallingReceiver final : public geotrain::TensorStream::Service {
 public:
  grpc::Status Stream(grpc::ServerContext* /*context*/,
                      grpc::ServerReaderWriter<geotrain::TensorAck, geotrain::TensorChunk>* stream) override {
    geotrain::TensorChunk chunk;
    geotrain::TensorAck ack;
    uint64_t bytes = 0;
    while (stream->Read(&chunk)) {
      if (chunk.has_header()) *ack.mutable_key() = chunk.header().key();
      bytes += chunk.payload().size();
      if (stall_next.exchange(false)) release.WaitForNotification();
      if (chunk.last()) {
        ack.set_bytes(bytes);
        bytes = 0;
        stream->Write(ack);
      }
    }
    return grpc::Status::OK;
  }
  std::atomic<bool> stall_next{false};
  absl::Notification release;
};

TEST(TensorStreamReuse, DeadlineOfASendOnAReusedStream) {
  StallingReceiver receiver;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.RegisterService(&receiver);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  // Whatever happens below, the stalled handler is released before the server goes (its Shutdown waits for it).
  absl::Cleanup release_receiver = [&receiver] {
    if (!receiver.release.HasBeenNotified()) receiver.release.Notify();
  };
  {
    TensorStreamOptions options;
    options.chunk_bytes = 256 * 1024;
    TensorStreamClient client(kToken, options);
    const std::vector<float> small(1000, 1.0f);
    ASSERT_TRUE(client.Send(address, Key("first"), {1000}, small, Codec{}, Soon()).ok());
    // The next Send reuses that stream; the receiver stops reading after its first chunk, so flow control holds
    // the 32 MiB tensor until the Send's deadline cancels the call.
    receiver.stall_next = true;
    const std::vector<float> big(8 * 1024 * 1024, 2.0f);
    const absl::Time start = absl::Now();
    const absl::Status late = client.Send(address, Key("late"), {static_cast<int64_t>(big.size())}, big, Codec{},
                                          absl::Now() + absl::Milliseconds(500));
    EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(450));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    EXPECT_EQ(client.stats().streams_opened, 1u);
    std::move(release_receiver).Invoke();
    // The cancelled stream is not reused: the next Send opens another one.
    ASSERT_TRUE(client.Send(address, Key("next"), {1000}, small, Codec{}, Soon()).ok());
    EXPECT_EQ(client.stats().streams_opened, 2u);
  }  // the client closes its streams, which the test receiver (not a TensorStreamServer) would wait for
  server->Shutdown();
}

TEST(TensorStreamReuse, RecvIntoDecodesOnArrivalBitExact) {
  Endpoint endpoint;
  TensorStreamOptions options;
  options.chunk_bytes = 1025;  // many chunks, edges inside elements and inside the codec header's neighbourhood
  TensorStreamClient small_chunks(kToken, options);
  TensorStreamClient default_chunks(kToken);
  int id = 0;
  uint64_t expected_direct = 0;
  for (TensorStreamClient* client : {&small_chunks, &default_chunks}) {
    for (const char* codec_name : {"none", "fp16", "bf16"}) {
      const Codec codec = ParseCodec(codec_name).value();
      for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{245}, size_t{3001}, size_t{300001}}) {
        const std::vector<float> data = RandomTensor(n, static_cast<uint32_t>(n + id));
        const TensorKey key = Key("d" + std::to_string(id++));
        std::vector<float> out(n, -7.0f);
        WaitingReceiver receiver(&endpoint.streams(), key, &out, Soon());
        const absl::Status sent = client->Send(endpoint.address(), key, {static_cast<int64_t>(n)}, data, codec, Soon());
        ASSERT_TRUE(sent.ok()) << sent;
        const absl::Status received = receiver.Join();
        ASSERT_TRUE(received.ok()) << received;
        EXPECT_EQ(out, ThroughCodec(codec, data)) << codec_name << " " << n;
        ++expected_direct;
      }
    }
  }
  EXPECT_EQ(endpoint.streams().stats().tensors_decoded_on_arrival, expected_direct);
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u);
  EXPECT_EQ(endpoint.streams().stats().receivers_waiting, 0u);
}

TEST(TensorStreamReuse, RecvIntoTakesTensorsThroughTheMailbox) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<float> data = RandomTensor(4000, 5);
  // Arrived before the receiver asked for it.
  ASSERT_TRUE(client.Send(endpoint.address(), Key("early"), {40, 100}, data, Codec{}, Soon()).ok());
  std::vector<float> out(4000);
  ASSERT_TRUE(endpoint.streams().RecvInto(Key("early"), absl::MakeSpan(out), Soon()).ok());
  EXPECT_EQ(out, data);
  // Not element-wise (int8, zstd): through the mailbox even when the receiver is waiting.
  for (const char* codec_name : {"int8", "bf16+zstd"}) {
    const Codec codec = ParseCodec(codec_name).value();
    const TensorKey key = Key(codec_name);
    WaitingReceiver receiver(&endpoint.streams(), key, &out, Soon());
    ASSERT_TRUE(client.Send(endpoint.address(), key, {4000}, data, codec, Soon()).ok());
    ASSERT_TRUE(receiver.Join().ok()) << codec_name;
    EXPECT_EQ(out, ThroughCodec(codec, data)) << codec_name;
  }
  EXPECT_EQ(endpoint.streams().stats().tensors_decoded_on_arrival, 0u);
  // A tensor of another size than the buffer is not decoded into it; RecvInto reports the mismatch.
  std::vector<float> wrong_size(3999);
  {
    WaitingReceiver receiver(&endpoint.streams(), Key("size"), &wrong_size, Soon());
    ASSERT_TRUE(client.Send(endpoint.address(), Key("size"), {4000}, data, Codec{}, Soon()).ok());
    EXPECT_EQ(receiver.Join().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u);
}

TEST(TensorStreamReuse, RecvIntoDeadlinesShutdownAndOneReceiverPerKey) {
  Endpoint endpoint;
  std::vector<float> out(10);
  const absl::Time start = absl::Now();
  EXPECT_EQ(
      endpoint.streams().RecvInto(Key("never"), absl::MakeSpan(out), absl::Now() + absl::Milliseconds(200)).code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  std::vector<float> other(10);
  {
    WaitingReceiver waiting(&endpoint.streams(), Key("k"), &out, Soon());
    EXPECT_EQ(endpoint.streams().RecvInto(Key("k"), absl::MakeSpan(other), Soon()).code(),
              absl::StatusCode::kFailedPrecondition);
    endpoint.streams().Shutdown();
    EXPECT_EQ(waiting.Join().code(), absl::StatusCode::kCancelled);
  }
  EXPECT_EQ(endpoint.streams().stats().receivers_waiting, 0u);
}

// A `none` tensor as Send writes it (codec header CRCs in the last chunk's trailer), 1024-byte chunks.
std::vector<geotrain::TensorChunk> Chunks(const std::string& id, const std::vector<float>& data) {
  return RawChunks(Key(id), {static_cast<int64_t>(data.size())}, data, 1024, /*crc_in_trailer=*/true);
}

grpc::Status SendRaw(const std::string& address, const std::vector<geotrain::TensorChunk>& chunks,
                     const std::function<void(size_t)>& before_chunk = nullptr) {
  return SendRawChunks(address, kToken, chunks, before_chunk);
}

TEST(TensorStreamReuse, MalformedTensorsAreNeverReportedToAWaitingRecvInto) {
  Endpoint endpoint;
  const std::vector<float> data = RandomTensor(1000, 3);
  struct Case {
    const char* what;
    std::function<void(std::vector<geotrain::TensorChunk>&)> mutate;
    grpc::StatusCode expected;
  };
  const std::vector<Case> cases = {
      {"flipped payload byte", [](auto& c) { (*c[2].mutable_payload())[100] ^= 1; }, grpc::StatusCode::DATA_LOSS},
      {"flipped byte in the first chunk", [](auto& c) { (*c[0].mutable_payload())[500] ^= 1; },
       grpc::StatusCode::DATA_LOSS},
      {"codec header corrupted", [](auto& c) { (*c[0].mutable_payload())[10] ^= 1; }, grpc::StatusCode::DATA_LOSS},
      {"codec header of another element count, CRC recomputed",
       [](auto& c) {
         std::string& p = *c[0].mutable_payload();
         p[8] ^= 1;  // element count
         const uint32_t payload_crc = static_cast<uint32_t>(c.back().trailer());
         uint8_t header[kCodecHeaderBytes];
         std::memcpy(header, p.data(), kCodecHeaderBytes);
         std::memcpy(header + 32, &payload_crc, 4);
         const uint32_t header_crc = Crc32c(header, kCodecHeaderBytes - 4);
         c.back().set_trailer(payload_crc | (uint64_t{header_crc} << 32));
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"wrong payload CRC in the trailer", [](auto& c) { c.back().set_trailer(c.back().trailer() ^ 1); },
       grpc::StatusCode::DATA_LOSS},
      {"no trailer", [](auto& c) { c.back().clear_trailer(); }, grpc::StatusCode::DATA_LOSS},
      {"ends inside the tensor", [](auto& c) { c.pop_back(); }, grpc::StatusCode::DATA_LOSS},
      {"short chunk", [](auto& c) { c[1].mutable_payload()->pop_back(); }, grpc::StatusCode::INVALID_ARGUMENT},
  };
  std::vector<float> out(1000);
  for (const Case& test_case : cases) {
    std::vector<geotrain::TensorChunk> chunks = Chunks("bad", data);
    test_case.mutate(chunks);
    WaitingReceiver receiver(&endpoint.streams(), Key("bad"), &out, absl::Now() + absl::Milliseconds(300));
    const grpc::Status status = SendRaw(endpoint.address(), chunks);
    EXPECT_EQ(status.error_code(), test_case.expected) << test_case.what << ": " << status.error_message();
    // The receiver was not told the tensor arrived: it waited until its deadline.
    EXPECT_EQ(receiver.Join().code(), absl::StatusCode::kDeadlineExceeded) << test_case.what;
  }
  EXPECT_EQ(endpoint.streams().stats().tensors_received, 0u);
  EXPECT_EQ(endpoint.streams().stats().streams_rejected, cases.size());
  // A valid tensor after a malformed one fills the same waiting buffer.
  {
    WaitingReceiver receiver(&endpoint.streams(), Key("ok"), &out, Soon());
    std::vector<geotrain::TensorChunk> bad = Chunks("ok", data);
    (*bad[1].mutable_payload())[7] ^= 1;
    EXPECT_EQ(SendRaw(endpoint.address(), bad).error_code(), grpc::StatusCode::DATA_LOSS);
    ASSERT_TRUE(SendRaw(endpoint.address(), Chunks("ok", data)).ok());
    ASSERT_TRUE(receiver.Join().ok());
    EXPECT_EQ(out, data);
  }
  EXPECT_EQ(endpoint.streams().stats().tensors_decoded_on_arrival, 1u);
}

TEST(TensorStreamReuse, NothingIsWrittenIntoTheBufferAfterRecvIntoGaveUp) {
  Endpoint endpoint;
  const std::vector<float> data = RandomTensor(1000, 4);
  std::vector<float> out(1000, 0.0f);
  absl::Notification receiver_gave_up;
  absl::Status received;
  std::thread receiver([&] {
    received = endpoint.streams().RecvInto(Key("slow"), absl::MakeSpan(out), absl::Now() + absl::Milliseconds(300));
    // The caller owns the buffer again: whatever it writes must stay.
    std::fill(out.begin(), out.end(), 42.0f);
    receiver_gave_up.Notify();
  });
  while (endpoint.streams().stats().receivers_waiting == 0) absl::SleepFor(absl::Microseconds(50));
  // The first two chunks arrive in time, the rest after the receiver's deadline.
  const grpc::Status status = SendRaw(endpoint.address(), Chunks("slow", data), [&](size_t i) {
    if (i == 2) receiver_gave_up.WaitForNotification();
  });
  receiver.join();
  EXPECT_EQ(received.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  for (float x : out) ASSERT_EQ(x, 42.0f);
  EXPECT_EQ(endpoint.streams().stats().tensors_received, 0u);
  EXPECT_EQ(endpoint.streams().stats().receivers_waiting, 0u);
}

}  // namespace
}  // namespace geotrain::comm
