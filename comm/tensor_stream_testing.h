// Helpers for the tensor-stream tests (tests only): a TensorStreamServer behind a real gRPC server on loopback,
// reproducible random tensors, and hand-made chunks sent through the generated (protobuf) stub, for malformed
// input.
//
//   LoopbackEndpoint endpoint(token);                 // or (token, options, port)
//   client.Send(endpoint.address(), key, shape, RandomTensor(1000, seed), codec, deadline);
//   endpoint.streams().Recv(key, deadline);
//   std::vector<geotrain::TensorChunk> chunks = RawChunks(key, {10, 100}, data, 2048, /*crc_in_trailer=*/false);
//   chunks[1].mutable_payload()->pop_back();           // break something
//   grpc::Status status = SendRawChunks(endpoint.address(), token, chunks);
//
// Not thread-safe itself (TensorStreamServer is); Stop() (also run by the destructor) shuts the TensorStreamServer
// down before the grpc::Server, as tensor_stream.h requires.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/tensor_stream.h"
#include "tensor.grpc.pb.h"

namespace geotrain::comm {

// n values from N(0, 1), the same for the same seed.
inline std::vector<float> RandomTensor(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class LoopbackEndpoint {
 public:
  // port 0: any free port.
  explicit LoopbackEndpoint(const std::string& token, TensorStreamOptions options = {}, int port = 0)
      : streams_(token, options) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &port_);
    streams_.Register(&builder);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port_);
  }
  ~LoopbackEndpoint() { Stop(); }
  LoopbackEndpoint(const LoopbackEndpoint&) = delete;
  LoopbackEndpoint& operator=(const LoopbackEndpoint&) = delete;

  void Stop() {
    if (server_ == nullptr) return;
    streams_.Shutdown();
    server_->Shutdown();
    server_.reset();
  }
  TensorStreamServer& streams() { return streams_; }
  int port() const { return port_; }
  const std::string& address() const { return address_; }

 private:
  TensorStreamServer streams_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
};

// The chunks of `data` encoded with "none", `chunk_bytes` of payload each, as a sender writes them: with the
// payload CRC in the stream header, or (`crc_in_trailer`) with zeros in the codec header's CRC fields, the stream
// header's checksum 0 and the CRCs in the last chunk's trailer, as Send does when it encodes while sending.
inline std::vector<geotrain::TensorChunk> RawChunks(const TensorKey& key, const std::vector<int64_t>& shape,
                                                    const std::vector<float>& data, uint64_t chunk_bytes,
                                                    bool crc_in_trailer) {
  Bytes encoded;
  if (!EncodeTensor(Codec{}, data, &encoded).ok()) return {};
  uint64_t trailer;  // the codec header's payload CRC and header CRC
  std::memcpy(&trailer, encoded.data() + kCodecHeaderBytes - 8, 8);
  std::vector<geotrain::TensorChunk> chunks;
  for (uint64_t offset = 0; offset < encoded.size(); offset += chunk_bytes) {
    geotrain::TensorChunk c;
    const uint64_t len = std::min<uint64_t>(chunk_bytes, encoded.size() - offset);
    if (offset == 0) {
      auto* h = c.mutable_header();
      h->mutable_key()->set_job_id(key.job_id);
      h->mutable_key()->set_step(key.step);
      h->mutable_key()->set_microbatch(key.microbatch);
      h->mutable_key()->set_tensor_id(key.tensor_id);
      h->mutable_key()->set_src(key.src);
      h->set_dtype(geotrain::TENSOR_DTYPE_F32);
      for (int64_t d : shape) h->add_shape(d);
      h->set_codec("none");
      h->set_total_bytes(encoded.size());
      h->set_checksum(crc_in_trailer ? 0 : static_cast<uint32_t>(trailer));
      h->set_chunk_bytes(chunk_bytes);
    }
    c.set_offset(offset);
    c.set_last(offset + len == encoded.size());
    std::string payload(reinterpret_cast<const char*>(encoded.data()) + offset, len);
    if (offset == 0 && crc_in_trailer) std::memset(payload.data() + kCodecHeaderBytes - 8, 0, 8);
    c.set_payload(payload);
    if (c.last() && crc_in_trailer) c.set_trailer(trailer);
    chunks.push_back(c);
  }
  return chunks;
}

// Writes `chunks` on one stream through the generated stub (calling `before_chunk(i)`, if given, before chunk i),
// half-closes, reads every ack and returns the call's status.
inline grpc::Status SendRawChunks(const std::string& address, const std::string& token,
                                  const std::vector<geotrain::TensorChunk>& chunks,
                                  const std::function<void(size_t)>& before_chunk = nullptr) {
  auto stub = geotrain::TensorStream::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata(kTokenMetadataKey, token);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = stub->Stream(&context);
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (before_chunk) before_chunk(i);
    if (!stream->Write(chunks[i])) break;
  }
  stream->WritesDone();
  geotrain::TensorAck ack;
  while (stream->Read(&ack)) {
  }
  return stream->Finish();
}

}  // namespace geotrain::comm
