// Tensor streams: peer-to-peer transfer of encoded tensors over gRPC (service geotrain.TensorStream in
// proto/tensor.proto), with a receiving mailbox keyed by (job, step, microbatch, tensor id, sender). This header
// is the protocol's contract and includes both ends; each end's own contract is in its header.
//
//   // Receiving side (a worker hosts it next to its own services):
//   TensorStreamServer streams(token);
//   grpc::ServerBuilder builder;  builder.AddListeningPort(...);  streams.Register(&builder);
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   RETURN_IF_ERROR(streams.RecvInto(key, absl::MakeSpan(values), absl::Now() + absl::Seconds(30)));
//   // or: absl::StatusOr<ReceivedTensor> t = streams.Recv(key, deadline);  t->DecodeInto(...)
//
//   // Sending side:
//   TensorStreamClient client(token);
//   absl::Status s = client.Send("10.0.0.2:7000", key, shape, values, codec, absl::Now() + absl::Seconds(30));
//
// Files: tensor_stream_server.h (TensorStreamServer: the service, the mailbox, RecvInto; delivery, limits and
// validation), tensor_stream_client.h (TensorStreamClient and OutgoingTensor: pooled streams, how a codec goes on
// the wire), tensor_chunks.h (the receiving side's chunk parser and assembler, without gRPC), tensor_types.h (the
// key, options and received tensor both ends share), tensor_stream_transport.h (their shared gRPC settings).
//
// Protocol: the client keeps its streams to a peer open and reuses them: a Send takes an idle stream (or opens
// one; the token is checked when a stream opens), writes the tensor in chunks (at most options.chunk_bytes of
// payload each, the first carrying the TensorHeader) and waits for the receiver's ack, which comes once the
// tensor is complete, validated and delivered; then the stream goes back to the pool for the next Send. Send
// returns OK only after that ack. Concurrent Sends to one peer use different streams (one HTTP/2 connection per
// peer address). A stream that broke while idle (the receiver restarted or shut down) is found on the first
// write and the tensor is sent again on a new stream; nothing else is retried. For the element-wise codecs (none,
// fp16, bf16 without zstd) Send encodes each chunk while the previous one is being written; the codec header's
// two CRCs are then zeros in the first chunk and come in the last chunk's trailer (TensorChunk field 5, fixed64),
// the stream header's checksum being 0. The receiver accepts both forms (docs/comm.md).
// Back-pressure: the sender has one write outstanding at a time (and one more chunk encoded), and gRPC's HTTP/2
// flow control holds it when the receiver does not read; the receiver reads one chunk at a time per stream.
// Copies: sender: one encode pass (fp32 -> codec bytes, a memcpy for "none"), chunk by chunk where the codec
// allows; the chunks reference the encoded buffer through grpc::Slice without copying. Receiver through the
// mailbox: one copy from gRPC's slices into the tensor's buffer (the CRC is computed on the same pass over
// cache-hot data), and one decode pass in Recv's caller; through a waiting RecvInto: one decode pass from gRPC's
// slices into the caller's buffer, chunk by chunk (the CRC on the same cache-hot data).
// Memory: the first TensorStreamServer or TensorStreamClient raises glibc's malloc trim threshold for the
// process (mallopt M_TRIM_THRESHOLD = 256 MiB, and M_MMAP_THRESHOLD = 32 MiB, glibc's own dynamic ceiling,
// unless GLIBC_TUNABLES sets either) so that gRPC's receive buffers stay resident between reads instead of
// being returned to the kernel and page-faulted back in on every read, which cut loopback throughput ~10x
// (docs/results/2026-12-02-comm.md). Freed heap up to that size is kept by the process rather than returned.
// Threading and ownership: see each end's header; all methods of both ends are thread-safe.
#pragma once

#include "comm/tensor_stream_client.h"
#include "comm/tensor_stream_server.h"
#include "common/token.h"

namespace geotrain::comm {

// The cluster token's key and check are common/token.h's (kTokenMetadataKey, TokenMatches): one rule for
// every service.
using ::geotrain::kTokenMetadataKey;
using ::geotrain::TokenMatches;

}  // namespace geotrain::comm
