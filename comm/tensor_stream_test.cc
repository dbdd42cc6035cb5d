// Tensor stream tests with a real gRPC server on loopback: round trips of several shapes and codecs, big
// tensors over many chunks, concurrent senders, the token check, malformed chunks sent raw through the
// generated stub (with the checksums in the stream header, and in the last chunk's trailer as Send writes them when
// it encodes while sending), a prepared tensor sent again, back-pressure from a receiver that stops reading, mailbox
// limits and deadlines.
#include "comm/tensor_stream.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "comm/tensor_stream_testing.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "tensor.grpc.pb.h"

namespace geotrain::comm {
namespace {

constexpr char kToken[] = "test-token-123";

TensorKey Key(const std::string& tensor, int64_t step = 1, const std::string& src = "sender") {
  return TensorKey{"job-1", step, 0, tensor, src};
}

class Endpoint : public LoopbackEndpoint {
 public:
  explicit Endpoint(TensorStreamOptions options = {}) : LoopbackEndpoint(kToken, options) {}
};

absl::Time Soon(int seconds = 20) { return absl::Now() + absl::Seconds(seconds); }

TEST(TensorStream, RoundTripsShapesAndCodecs) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {7}, {3, 5}, {2, 3, 4, 5}, {1000, 33}};
  int id = 0;
  for (const char* codec_name : {"none", "fp16", "bf16", "int8", "bf16+zstd", "none+zstd"}) {
    const Codec codec = ParseCodec(codec_name).value();
    for (const auto& shape : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      const std::vector<float> data = RandomTensor(static_cast<size_t>(n), id);
      const TensorKey key = Key("t" + std::to_string(id++));
      ASSERT_TRUE(client.Send(endpoint.address(), key, shape, data, codec, Soon()).ok()) << codec_name;
      absl::StatusOr<ReceivedTensor> got = endpoint.streams().Recv(key, Soon());
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->shape, shape);
      EXPECT_EQ(got->codec, codec.ToString());
      // Exactly what a local encode/decode gives.
      Bytes local;
      ASSERT_TRUE(EncodeTensor(codec, data, &local).ok());
      std::vector<float> expected(data.size());
      ASSERT_TRUE(DecodeTensor(local.span(), absl::MakeSpan(expected)).ok());
      EXPECT_EQ(got->Decode().value(), expected) << codec_name;
    }
  }
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u);
}

TEST(TensorStream, BigTensorOverManyChunksIsBitExact) {
  Endpoint endpoint;
  TensorStreamOptions options;
  options.chunk_bytes = 256 * 1024;
  TensorStreamClient client(kToken, options);
  const std::vector<float> data = RandomTensor(6 * 1024 * 1024 + 3, 5);  // 24 MiB: 97 chunks
  const std::vector<int64_t> shape = {static_cast<int64_t>(data.size())};
  ASSERT_TRUE(client.Send(endpoint.address(), Key("big"), shape, data, Codec{}, Soon()).ok());
  auto got = endpoint.streams().Recv(Key("big"), Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<float> out(data.size());
  ASSERT_TRUE(got->DecodeInto(absl::MakeSpan(out)).ok());
  EXPECT_EQ(std::memcmp(out.data(), data.data(), data.size() * 4), 0);
  EXPECT_EQ(client.stats().bytes_sent, data.size() * 4 + kCodecHeaderBytes);
}

TEST(TensorStream, ConcurrentSendersAllArrive) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  constexpr int kSenders = 6, kPerSender = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int s = 0; s < kSenders; ++s) {
    threads.emplace_back([&, s] {
      for (int i = 0; i < kPerSender; ++i) {
        const std::vector<float> data(10000 + i, static_cast<float>(s * 100 + i));
        const int64_t n = static_cast<int64_t>(data.size());
        if (!client.Send(endpoint.address(), Key("x", i, "s" + std::to_string(s)), {n}, data, Codec{}, Soon()).ok()) {
          ++failures;
        }
      }
    });
  }
  // Receive in the opposite order of sending, concurrently with the senders.
  for (int s = kSenders - 1; s >= 0; --s) {
    for (int i = kPerSender - 1; i >= 0; --i) {
      auto got = endpoint.streams().Recv(Key("x", i, "s" + std::to_string(s)), Soon());
      ASSERT_TRUE(got.ok()) << got.status();
      auto values = got->Decode().value();
      ASSERT_EQ(values.size(), 10000u + i);
      EXPECT_EQ(values.front(), static_cast<float>(s * 100 + i));
      EXPECT_EQ(values.back(), static_cast<float>(s * 100 + i));
    }
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// The per-link goodput hook (TensorStreamOptions::on_acknowledged) sees every acknowledged Send, with its peer,
// its encoded bytes and a positive time; a refused Send is not reported.
TEST(TensorStream, AcknowledgedSendsAreReportedWithBytesAndTime) {
  Endpoint endpoint;
  struct Report {
    std::string address;
    uint64_t bytes;
    absl::Duration took;
  };
  absl::Mutex mu;
  std::vector<Report> reports;
  TensorStreamOptions options;
  options.chunk_bytes = 64 * 1024;
  options.on_acknowledged = [&](const std::string& address, uint64_t bytes, absl::Duration took) {
    absl::MutexLock lock(&mu);
    reports.push_back({address, bytes, took});
  };
  TensorStreamClient client(kToken, options);
  const std::vector<float> big = RandomTensor(300 * 1000, 3), small(1000, 1.0f);
  ASSERT_TRUE(client.Send(endpoint.address(), Key("big"), {300, 1000}, big, Codec{}, Soon()).ok());
  ASSERT_TRUE(client.Send(endpoint.address(), Key("small"), {1000}, small, *ParseCodec("bf16"), Soon()).ok());
  TensorStreamClient refused("not-the-token", options);
  EXPECT_FALSE(refused.Send(endpoint.address(), Key("x"), {1000}, small, Codec{}, Soon()).ok());
  absl::MutexLock lock(&mu);
  ASSERT_EQ(reports.size(), 2u);
  uint64_t bytes = 0;
  for (const Report& r : reports) {
    EXPECT_EQ(r.address, endpoint.address());
    EXPECT_GT(r.took, absl::ZeroDuration());
    bytes += r.bytes;
  }
  EXPECT_EQ(reports[0].bytes, big.size() * 4 + kCodecHeaderBytes);
  EXPECT_EQ(reports[1].bytes, small.size() * 2 + kCodecHeaderBytes);  // bf16: the encoded bytes
  EXPECT_EQ(bytes, client.stats().bytes_sent);
}

TEST(TensorStream, WrongOrMissingTokenIsUnauthenticated) {
  Endpoint endpoint;
  TensorStreamClient wrong("not-the-token");
  const std::vector<float> data(10, 1.0f);
  absl::Status s = wrong.Send(endpoint.address(), Key("a"), {10}, data, Codec{}, Soon());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  TensorStreamClient prefix("test-token-12");  // a prefix of the right token
  EXPECT_EQ(prefix.Send(endpoint.address(), Key("a"), {10}, data, Codec{}, Soon()).code(),
            absl::StatusCode::kUnauthenticated);
  // No metadata at all, through the generated stub.
  auto stub =
      geotrain::TensorStream::NewStub(grpc::CreateChannel(endpoint.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  auto stream = stub->Stream(&context);
  stream->WritesDone();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
  EXPECT_GE(endpoint.streams().stats().streams_rejected, 3u);
  EXPECT_TRUE(TokenMatches("abc", "abc"));
  EXPECT_FALSE(TokenMatches("abcd", "abc"));
  EXPECT_FALSE(TokenMatches("", ""));
}

grpc::Status SendRaw(const std::string& address, const std::vector<geotrain::TensorChunk>& chunks) {
  return SendRawChunks(address, kToken, chunks);
}

// A valid two-chunk tensor of 1000 floats ("none"), chunk size 2048 bytes.
std::vector<geotrain::TensorChunk> ValidChunks(const std::string& id) {
  return RawChunks(Key(id), {10, 100}, RandomTensor(1000, 9), 2048, /*crc_in_trailer=*/false);
}

TEST(TensorStream, RawValidChunksFromTheGeneratedStubAreAccepted) {
  Endpoint endpoint;
  ASSERT_TRUE(SendRaw(endpoint.address(), ValidChunks("ok")).ok());
  auto got = endpoint.streams().Recv(Key("ok"), Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->Decode().value(), RandomTensor(1000, 9));
}

TEST(TensorStream, MalformedChunksAreRejectedBeforeUse) {
  TensorStreamOptions options;
  options.max_tensor_bytes = 1 << 20;
  Endpoint endpoint(options);
  struct Case {
    const char* what;
    std::function<void(std::vector<geotrain::TensorChunk>&)> mutate;
    grpc::StatusCode expected;
  };
  const std::vector<Case> cases = {
      {"no header", [](auto& c) { c[0].clear_header(); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"shape disagrees with size", [](auto& c) { c[0].mutable_header()->set_shape(1, 101); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"negative dimension", [](auto& c) { c[0].mutable_header()->set_shape(1, -100); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"huge shape",
       [](auto& c) {
         for (int i = 0; i < 6; ++i) c[0].mutable_header()->add_shape(1 << 20);
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"over max_tensor_bytes",
       [](auto& c) {
         c[0].mutable_header()->set_shape(1, 1000000);
         c[0].mutable_header()->set_total_bytes(40 + 4000000000ull);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED},
      {"unknown codec", [](auto& c) { c[0].mutable_header()->set_codec("zip"); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"codec disagrees with size", [](auto& c) { c[0].mutable_header()->set_codec("bf16"); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"no dtype", [](auto& c) { c[0].mutable_header()->clear_dtype(); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"zero chunk size", [](auto& c) { c[0].mutable_header()->set_chunk_bytes(0); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"empty tensor id", [](auto& c) { c[0].mutable_header()->mutable_key()->clear_tensor_id(); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"first offset not zero", [](auto& c) { c[0].set_offset(8); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"gap between chunks", [](auto& c) { c[1].set_offset(c[1].offset() + 4); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"short chunk", [](auto& c) { c[0].mutable_payload()->pop_back(); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"long last chunk", [](auto& c) { c.back().mutable_payload()->push_back('x'); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"wrong last flag", [](auto& c) { c[0].set_last(true); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"header repeated", [](auto& c) { *c[1].mutable_header() = c[0].header(); }, grpc::StatusCode::INVALID_ARGUMENT},
      {"flipped payload byte", [](auto& c) { (*c[1].mutable_payload())[100] ^= 1; }, grpc::StatusCode::DATA_LOSS},
      {"wrong checksum", [](auto& c) { c[0].mutable_header()->set_checksum(c[0].header().checksum() + 1); },
       grpc::StatusCode::DATA_LOSS},
      {"ends inside the tensor", [](auto& c) { c.pop_back(); }, grpc::StatusCode::DATA_LOSS},
      {"codec header corrupted", [](auto& c) { (*c[0].mutable_payload())[10] ^= 1; }, grpc::StatusCode::DATA_LOSS},
  };
  for (const Case& test_case : cases) {
    std::vector<geotrain::TensorChunk> chunks = ValidChunks("bad");
    test_case.mutate(chunks);
    const grpc::Status status = SendRaw(endpoint.address(), chunks);
    EXPECT_EQ(status.error_code(), test_case.expected) << test_case.what << ": " << status.error_message();
    EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u) << test_case.what;
    EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u) << test_case.what;
  }
  EXPECT_EQ(endpoint.streams().stats().streams_rejected, cases.size());
  // The endpoint still works afterwards.
  ASSERT_TRUE(SendRaw(endpoint.address(), ValidChunks("good")).ok());
  EXPECT_TRUE(endpoint.streams().Recv(Key("good"), Soon()).ok());
}

// The same tensor as ValidChunks, as a sender that encodes while sending writes it: the stream header's checksum is
// 0, the codec header's last 8 bytes (payload CRC, header CRC) travel as zeros in the first chunk and for real in
// the last chunk's field 5 (fixed64), which the generated TensorChunk does not declare.
constexpr int kTrailerField = 5;

void SetTrailer(geotrain::TensorChunk* chunk, uint64_t trailer) {
  google::protobuf::UnknownFieldSet* unknown = chunk->GetReflection()->MutableUnknownFields(chunk);
  unknown->Clear();
  unknown->AddFixed64(kTrailerField, trailer);
}

std::vector<geotrain::TensorChunk> TrailerChunks(const std::string& id, uint64_t* trailer_out = nullptr) {
  std::vector<geotrain::TensorChunk> chunks = ValidChunks(id);
  std::string& first = *chunks[0].mutable_payload();
  uint64_t trailer;
  std::memcpy(&trailer, first.data() + kCodecHeaderBytes - 8, 8);
  std::memset(first.data() + kCodecHeaderBytes - 8, 0, 8);
  chunks[0].mutable_header()->set_checksum(0);
  if (trailer_out != nullptr) *trailer_out = trailer;
  SetTrailer(&chunks.back(), trailer);
  return chunks;
}

TEST(TensorStream, ChecksumsInTheLastChunkAreVerifiedBeforeDelivery) {
  Endpoint endpoint;
  ASSERT_TRUE(SendRaw(endpoint.address(), TrailerChunks("ok")).ok());
  auto got = endpoint.streams().Recv(Key("ok"), Soon());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->Decode().value(), RandomTensor(1000, 9));
  // The delivered buffer is exactly what EncodeTensor makes (the trailer restored the codec header).
  Bytes local;
  ASSERT_TRUE(EncodeTensor(Codec{}, RandomTensor(1000, 9), &local).ok());
  ASSERT_EQ(got->encoded.size(), local.size());
  EXPECT_EQ(std::memcmp(got->encoded.data(), local.data(), local.size()), 0);

  struct Case {
    const char* what;
    std::function<void(std::vector<geotrain::TensorChunk>&, uint64_t trailer)> mutate;
    grpc::StatusCode expected;
  };
  const std::vector<Case> cases = {
      {"flipped payload byte", [](auto& c, uint64_t) { (*c[1].mutable_payload())[100] ^= 1; },
       grpc::StatusCode::DATA_LOSS},
      {"flipped byte in the first chunk", [](auto& c, uint64_t) { (*c[0].mutable_payload())[1000] ^= 1; },
       grpc::StatusCode::DATA_LOSS},
      {"codec header corrupted", [](auto& c, uint64_t) { (*c[0].mutable_payload())[10] ^= 1; },
       grpc::StatusCode::DATA_LOSS},
      {"wrong payload CRC in the trailer", [](auto& c, uint64_t t) { SetTrailer(&c.back(), t ^ 1); },
       grpc::StatusCode::DATA_LOSS},
      {"wrong header CRC in the trailer", [](auto& c, uint64_t t) { SetTrailer(&c.back(), t ^ (uint64_t{1} << 40)); },
       grpc::StatusCode::DATA_LOSS},
      {"no trailer", [](auto& c, uint64_t) { c.back().GetReflection()->MutableUnknownFields(&c.back())->Clear(); },
       grpc::StatusCode::DATA_LOSS},
      {"trailer before the last chunk", [](auto& c, uint64_t t) { SetTrailer(&c[0], t); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"trailer and a header checksum",
       [](auto& c, uint64_t t) { c[0].mutable_header()->set_checksum(static_cast<uint32_t>(t)); },
       grpc::StatusCode::INVALID_ARGUMENT},
  };
  for (const Case& test_case : cases) {
    uint64_t trailer = 0;
    std::vector<geotrain::TensorChunk> chunks = TrailerChunks("bad", &trailer);
    test_case.mutate(chunks, trailer);
    const grpc::Status status = SendRaw(endpoint.address(), chunks);
    EXPECT_EQ(status.error_code(), test_case.expected) << test_case.what << ": " << status.error_message();
    EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u) << test_case.what;
    EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u) << test_case.what;
  }
  EXPECT_EQ(endpoint.streams().stats().streams_rejected, cases.size());
}

TEST(TensorStream, EncodeWhileSendingMatchesEncodeThenSend) {
  Endpoint endpoint;
  TensorStreamOptions options;
  options.chunk_bytes = 1025;  // chunk edges fall inside elements and inside the codec header's neighbourhood
  TensorStreamClient client(kToken, options);
  int id = 0;
  for (const char* codec_name : {"none", "fp16", "bf16"}) {
    const Codec codec = ParseCodec(codec_name).value();
    for (size_t n : {size_t{0}, size_t{1}, size_t{245}, size_t{256}, size_t{3001}}) {
      const std::vector<float> data = RandomTensor(n, static_cast<uint32_t>(n));
      const TensorKey key = Key("e" + std::to_string(id++));
      ASSERT_TRUE(client.Send(endpoint.address(), key, {static_cast<int64_t>(n)}, data, codec, Soon()).ok());
      auto got = endpoint.streams().Recv(key, Soon());
      ASSERT_TRUE(got.ok()) << got.status();
      Bytes local;
      ASSERT_TRUE(EncodeTensor(codec, data, &local).ok());
      ASSERT_EQ(got->encoded.size(), local.size()) << codec_name << " " << n;
      EXPECT_EQ(std::memcmp(got->encoded.data(), local.data(), local.size()), 0) << codec_name << " " << n;
    }
  }
  // The shape must match the data.
  const std::vector<float> data(10, 1.0f);
  EXPECT_EQ(client.Send(endpoint.address(), Key("m"), {11}, data, Codec{}, Soon()).code(),
            absl::StatusCode::kInvalidArgument);
}

// A prepared tensor sent twice (a communicator's retry) carries the same bytes both times, which are Encoded()'s;
// top-k's error feedback sees it once, in Prepare.
TEST(TensorStream, APreparedTensorSentTwiceCarriesTheSameBytes) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<float> data = RandomTensor(3001, 7);
  int id = 0;
  for (const char* codec_name : {"none", "bf16", "int8", "topk:0.1", "fp16+zstd"}) {
    const Codec codec = ParseCodec(codec_name).value();
    std::vector<float> residual;
    absl::StatusOr<OutgoingTensor> tensor = OutgoingTensor::Prepare(codec, data, &residual);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    EXPECT_EQ(tensor->encoded_while_sent(), EncodedElementBytes(codec) > 0) << codec_name;
    const std::vector<float> residual_after_prepare = residual;
    absl::StatusOr<Bytes> expected = tensor->Encoded();
    ASSERT_TRUE(expected.ok()) << expected.status();
    for (int attempt = 0; attempt < 2; ++attempt) {
      const TensorKey key = Key("p" + std::to_string(id++));
      ASSERT_TRUE(client.Send(endpoint.address(), key, {3001}, *tensor, Soon()).ok()) << codec_name;
      absl::StatusOr<ReceivedTensor> got = endpoint.streams().Recv(key, Soon());
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->encoded.size(), expected->size()) << codec_name;
      EXPECT_EQ(std::memcmp(got->encoded.data(), expected->data(), expected->size()), 0) << codec_name;
    }
    EXPECT_EQ(residual, residual_after_prepare) << codec_name;
  }
}

// A receiver that reads the first chunk and then stops reading until released.
class StalledReceiver final : public geotrain::TensorStream::Service {
 public:
  grpc::Status Stream(grpc::ServerContext* /*context*/,
                      grpc::ServerReaderWriter<geotrain::TensorAck, geotrain::TensorChunk>* stream) override {
    geotrain::TensorChunk chunk;
    geotrain::TensorAck ack;
    uint64_t bytes = 0;
    while (stream->Read(&chunk)) {
      if (chunk.has_header()) *ack.mutable_key() = chunk.header().key();
      bytes += chunk.payload().size();
      if (!first_chunk_read.HasBeenNotified()) {
        first_chunk_read.Notify();
        release.WaitForNotification();
      }
      if (chunk.last()) break;
    }
    ack.set_bytes(bytes);
    stream->Write(ack);
    return grpc::Status::OK;
  }
  absl::Notification first_chunk_read;
  absl::Notification release;
};

TEST(TensorStream, ReceiverThatStopsReadingBlocksTheSenderWithBoundedBuffering) {
  constexpr int kWindowBytes = 1 << 20;
  StalledReceiver receiver;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kWindowBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.RegisterService(&receiver);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const std::string address = "127.0.0.1:" + std::to_string(port);

  TensorStreamOptions options;
  options.chunk_bytes = 256 * 1024;
  TensorStreamClient client(kToken, options);
  const std::vector<float> data = RandomTensor(8 * 1024 * 1024, 3);  // 32 MiB, 128 chunks
  const uint64_t total = data.size() * 4 + kCodecHeaderBytes;
  std::atomic<bool> send_returned{false};
  absl::Status send_status;
  std::thread sender([&] {
    send_status = client.Send(address, Key("slow"), {static_cast<int64_t>(data.size())}, data, Codec{}, Soon(60));
    send_returned = true;
  });
  ASSERT_TRUE(receiver.first_chunk_read.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Give the sender time to push everything flow control lets through.
  absl::SleepFor(absl::Milliseconds(500));
  const uint64_t written = client.stats().bytes_written;
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(send_returned.load()) << "Send finished although the receiver stopped reading";
  EXPECT_EQ(client.stats().bytes_written, written) << "the sender kept handing chunks to gRPC";
  // The receiver's stream window plus a few chunks in gRPC's and the kernel's buffers; far below the tensor.
  EXPECT_GE(written, options.chunk_bytes);
  EXPECT_LE(written, uint64_t{kWindowBytes} + 8 * options.chunk_bytes) << written << " of " << total;
  receiver.release.Notify();
  sender.join();
  EXPECT_TRUE(send_status.ok()) << send_status;
  EXPECT_EQ(client.stats().bytes_written, total);
  EXPECT_EQ(client.stats().bytes_sent, total);
  server->Shutdown();
}

TEST(TensorStream, DuplicateKeyIsRefusedAndMailboxIsBounded) {
  TensorStreamOptions options;
  options.max_mailbox_bytes = 100000;
  Endpoint endpoint(options);
  TensorStreamClient client(kToken);
  const std::vector<float> data(10000, 2.0f);  // 40,040 bytes encoded
  ASSERT_TRUE(client.Send(endpoint.address(), Key("d"), {10000}, data, Codec{}, Soon()).ok());
  EXPECT_EQ(client.Send(endpoint.address(), Key("d"), {10000}, data, Codec{}, Soon()).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(client.Send(endpoint.address(), Key("e"), {10000}, data, Codec{}, Soon()).ok());
  // A third one would pass the mailbox limit: refused, not buffered.
  EXPECT_EQ(client.Send(endpoint.address(), Key("f"), {10000}, data, Codec{}, Soon()).code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(endpoint.streams().Recv(Key("d"), Soon()).ok());
  EXPECT_TRUE(client.Send(endpoint.address(), Key("f"), {10000}, data, Codec{}, Soon()).ok());
}

TEST(TensorStream, DiscardJobDropsOnlyThatJobsTensors) {
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<float> data(1000, 1.0f);
  ASSERT_TRUE(client.Send(endpoint.address(), Key("a"), {1000}, data, Codec{}, Soon()).ok());
  ASSERT_TRUE(client.Send(endpoint.address(), Key("b"), {1000}, data, Codec{}, Soon()).ok());
  TensorKey other = Key("a");
  other.job_id = "job-2";
  ASSERT_TRUE(client.Send(endpoint.address(), other, {1000}, data, Codec{}, Soon()).ok());
  EXPECT_EQ(endpoint.streams().DiscardJob("job-1"), 2u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 1u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 4040u);
  EXPECT_EQ(endpoint.streams().Recv(Key("a"), absl::Now() + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(endpoint.streams().Recv(other, Soon()).ok());
}

TEST(TensorStream, CancelJobEndsARecvIntoWhoseTensorIsArriving) {
  // A RecvInto whose tensor is being decoded into its buffer (the sender stalls after two of four chunks) returns
  // CANCELLED at once when its job is cancelled, as a Recv does; the stalled tensor is refused to its sender.
  Endpoint endpoint;
  const std::vector<float> data = RandomTensor(64 * 1024, 4);  // 256 KiB: four chunks of 64 KiB
  const std::vector<geotrain::TensorChunk> chunks =
      RawChunks(Key("mid"), {static_cast<int64_t>(data.size())}, data, 64 * 1024, /*crc_in_trailer=*/false);
  ASSERT_EQ(chunks.size(), 5u);  // the codec header pushes the payload into a fifth
  std::vector<float> out(data.size());
  absl::Status received;
  absl::Time returned;
  std::thread receiver([&] {
    received = endpoint.streams().RecvInto(Key("mid"), absl::MakeSpan(out), Soon(30));
    returned = absl::Now();
  });
  for (int i = 0; i < 200 && endpoint.streams().stats().receivers_waiting == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(endpoint.streams().stats().receivers_waiting, 1u);
  absl::Notification stalled, release;
  grpc::Status sent;
  std::thread sender([&] {
    sent = SendRawChunks(endpoint.address(), kToken, chunks, [&](size_t i) {
      if (i != 2) return;
      stalled.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(20));
    });
  });
  ASSERT_TRUE(stalled.WaitForNotificationWithTimeout(absl::Seconds(20)));
  absl::SleepFor(absl::Milliseconds(200));  // the first two chunks are in `out`
  const absl::Time cancelled = absl::Now();
  endpoint.streams().CancelJob(Key("mid").job_id);
  receiver.join();
  EXPECT_EQ(received.code(), absl::StatusCode::kCancelled) << received;
  EXPECT_LT(returned - cancelled, absl::Seconds(5));
  release.Notify();
  sender.join();
  EXPECT_FALSE(sent.ok());
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
}

TEST(TensorStream, CancelledJobsAreRememberedUpToABound) {
  // A cancelled job's receives return CANCELLED at once and its tensors are refused; the endpoint remembers the
  // last kMaxCancelledJobs such jobs, so that a worker that lives through many jobs does not grow without bound.
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<float> data(10, 1.0f);
  endpoint.streams().CancelJob("job-1");
  endpoint.streams().CancelJob("job-1");  // once
  EXPECT_EQ(endpoint.streams().Recv(Key("a"), Soon()).status().code(), absl::StatusCode::kCancelled);
  const absl::Status refused = client.Send(endpoint.address(), Key("a"), {10}, data, Codec{}, Soon());
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  // The sender can tell a stopped job from a failure, after the status crossed gRPC with the send's context.
  EXPECT_TRUE(IsJobStoppedOnReceiver(refused)) << refused;
  EXPECT_FALSE(IsJobStoppedOnReceiver(absl::FailedPreconditionError("job-1 has no such stage")));
  for (size_t i = 0; i + 1 < TensorStreamServer::kMaxCancelledJobs; ++i) {
    endpoint.streams().CancelJob(absl::StrCat("other-", i));
  }
  EXPECT_TRUE(endpoint.streams().JobCancelled("job-1"));  // the bound holds job-1 and the others
  endpoint.streams().CancelJob("one-more");
  EXPECT_FALSE(endpoint.streams().JobCancelled("job-1"));  // the oldest is forgotten
  EXPECT_TRUE(endpoint.streams().JobCancelled("other-0"));
  EXPECT_TRUE(endpoint.streams().JobCancelled("one-more"));
  // Its late tensors are taken again (the orphan timeout would drop them).
  EXPECT_TRUE(client.Send(endpoint.address(), Key("a"), {10}, data, Codec{}, Soon()).ok());
  EXPECT_TRUE(endpoint.streams().Recv(Key("a"), Soon()).ok());
}

TEST(TensorStream, AJobCancelledByAFailureIsRefusedAsAFailure) {
  // A job cancelled because this side failed (a send of it failed part-way) is refused as a failure, which its
  // senders report as their error; a stop is refused as a stop, which its senders end on quietly.
  Endpoint endpoint;
  TensorStreamClient client(kToken);
  const std::vector<float> data(10, 1.0f);
  endpoint.streams().CancelJob("job-1", /*stopped=*/false);
  endpoint.streams().CancelJob("job-1");  // the first word stands
  const absl::Status failed = client.Send(endpoint.address(), Key("a"), {10}, data, Codec{}, Soon());
  EXPECT_EQ(failed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(IsJobStoppedOnReceiver(failed)) << failed;
  EXPECT_TRUE(IsJobFailedOnReceiver(failed)) << failed;
  EXPECT_THAT(std::string(failed.message()), ::testing::HasSubstr("job job-1 failed on the receiver"));
  EXPECT_EQ(endpoint.streams().Recv(Key("a"), Soon()).status().code(), absl::StatusCode::kCancelled);
}

TEST(TensorStream, DeadlinesExpireCleanly) {
  Endpoint endpoint;
  absl::Time start = absl::Now();
  auto missing = endpoint.streams().Recv(Key("never"), absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  // Nobody listening: the send gives up at its deadline.
  TensorStreamClient client(kToken);
  const std::vector<float> data(1000, 1.0f);
  start = absl::Now();
  absl::Status s = client.Send("127.0.0.1:1", Key("x"), {1000}, data, Codec{}, absl::Now() + absl::Milliseconds(300));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.code(), ::testing::AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kUnavailable));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  // A deadline already passed fails fast.
  s = client.Send(endpoint.address(), Key("late"), {1000}, data, Codec{}, absl::Now() - absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;

  // Shutdown wakes a waiting Recv.
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(100));
    endpoint.streams().Shutdown();
  });
  EXPECT_EQ(endpoint.streams().Recv(Key("never"), Soon()).status().code(), absl::StatusCode::kCancelled);
  waker.join();
}

// Polls `done` for up to 10 s (the server's own threads change what it reads).
bool Eventually(const std::function<bool()>& done) {
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end; absl::SleepFor(absl::Milliseconds(10))) {
    if (done()) return true;
  }
  return done();
}

TEST(TensorStreamLimits, JobAndPeerBudgetsRefuseWithResourceExhaustedAndTheReceiverGoesOn) {
  TensorStreamOptions options;
  options.max_job_bytes = 100000;
  options.max_peer_bytes = 60000;
  Endpoint endpoint(options);
  TensorStreamClient client(kToken);
  const std::vector<float> data(10000, 2.0f);  // 40,040 bytes encoded
  auto send = [&](const TensorKey& key) {
    return client.Send(endpoint.address(), key, {10000}, data, Codec{}, Soon());
  };
  auto key = [](const std::string& job, const std::string& tensor, const std::string& src) {
    return TensorKey{job, 1, 0, tensor, src};
  };
  ASSERT_TRUE(send(key("job-1", "a", "p1")).ok());
  // p1 holds 40,040 bytes: one more tensor passes its 60,000.
  absl::Status over = send(key("job-1", "b", "p1"));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_THAT(over.message(), ::testing::HasSubstr("max_peer_bytes"));
  ASSERT_TRUE(send(key("job-1", "c", "p2")).ok());
  // job-1 holds 80,080 bytes: a third tensor from a third sender passes its 100,000.
  over = send(key("job-1", "d", "p3"));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_THAT(over.message(), ::testing::HasSubstr("max_job_bytes"));
  // Another job has a budget of its own.
  ASSERT_TRUE(send(key("job-2", "d", "p3")).ok());
  EXPECT_EQ(endpoint.streams().stats().over_budget, 2u);
  // Taking a tensor frees its budgets.
  ASSERT_TRUE(endpoint.streams().Recv(key("job-1", "a", "p1"), Soon()).ok());
  ASSERT_TRUE(send(key("job-1", "b", "p1")).ok());
  EXPECT_EQ(send(key("job-1", "e", "p4")).code(), absl::StatusCode::kResourceExhausted);  // job-1 holds b and c
  EXPECT_EQ(endpoint.streams().DiscardJob("job-1"), 2u);
  EXPECT_EQ(endpoint.streams().DiscardJob("job-2"), 1u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u);
  // Every budget is whole again: a tensor as big as a peer's budget allows fits.
  const std::vector<float> big(14990, 1.0f);  // 60,000 bytes encoded
  EXPECT_TRUE(client.Send(endpoint.address(), key("job-1", "big", "p1"), {14990}, big, Codec{}, Soon()).ok());
}

TEST(TensorStreamLimits, OrphanTensorsAreDroppedAfterTheirTimeout) {
  TensorStreamOptions options;
  options.orphan_timeout = absl::Milliseconds(300);
  Endpoint endpoint(options);
  TensorStreamClient client(kToken);
  const std::vector<float> data(1000, 1.0f);
  ASSERT_TRUE(client.Send(endpoint.address(), Key("orphan"), {1000}, data, Codec{}, Soon()).ok());
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 1u);
  ASSERT_TRUE(Eventually([&] { return endpoint.streams().stats().orphans_dropped == 1; }));
  EXPECT_EQ(endpoint.streams().stats().mailbox_tensors, 0u);
  EXPECT_EQ(endpoint.streams().stats().mailbox_bytes, 0u);
  EXPECT_EQ(endpoint.streams().Recv(Key("orphan"), absl::Now() + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // A tensor taken in time is not an orphan.
  ASSERT_TRUE(client.Send(endpoint.address(), Key("taken"), {1000}, data, Codec{}, Soon()).ok());
  EXPECT_TRUE(endpoint.streams().Recv(Key("taken"), Soon()).ok());
  EXPECT_EQ(endpoint.streams().stats().orphans_dropped, 1u);
}

TEST(TensorStreamLimits, OpenStreamsAreCapped) {
  TensorStreamOptions options;
  options.max_streams = 2;
  Endpoint endpoint(options);
  const std::vector<float> data(100, 1.0f);
  // Each client keeps its stream open (idle, pooled) after its Send.
  auto first = std::make_unique<TensorStreamClient>(kToken);
  TensorStreamClient second(kToken), third(kToken);
  ASSERT_TRUE(first->Send(endpoint.address(), Key("1"), {100}, data, Codec{}, Soon()).ok());
  ASSERT_TRUE(second.Send(endpoint.address(), Key("2"), {100}, data, Codec{}, Soon()).ok());
  EXPECT_EQ(endpoint.streams().stats().streams_open, 2u);
  const absl::Status refused = third.Send(endpoint.address(), Key("3"), {100}, data, Codec{}, Soon(5));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("max_streams"));
  // A closed stream frees its place.
  first.reset();
  ASSERT_TRUE(Eventually([&] { return endpoint.streams().stats().streams_open < 2; }));
  EXPECT_TRUE(third.Send(endpoint.address(), Key("3"), {100}, data, Codec{}, Soon()).ok());
  EXPECT_TRUE(endpoint.streams().Recv(Key("3"), Soon()).ok());
}

}  // namespace
}  // namespace geotrain::comm
