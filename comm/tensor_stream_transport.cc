// Transport settings shared by the tensor-stream server and client (see tensor_stream_transport.h).
#include "comm/tensor_stream_transport.h"

#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace geotrain::comm {
namespace {

// gRPC reads the socket into 64 KiB buffers that it frees on another thread once the message is consumed.
// With glibc's default trim threshold (128 KiB) every such free can hand the pages back to the kernel
// (madvise/brk shrink, with TLB shoot-downs), so the next read page-faults fresh zeroed pages: on loopback
// that cost ~10x the transfer itself (docs/results/2026-12-02-comm.md). Keeping up to kRetainFreedBytes of freed heap
// makes the buffers warm again. Setting a threshold turns off glibc's dynamic mmap threshold (which would
// otherwise rise to 32 MiB as large blocks are freed), so the mmap threshold is set to that ceiling too, or
// every allocation above 128 KiB elsewhere in the process would be mmap'ed and faulted in afresh.
// Process-wide; skipped when GLIBC_TUNABLES already sets either threshold.
constexpr int kRetainFreedBytes = 256 << 20;
constexpr int kMmapThresholdBytes = 32 << 20;

template <typename Args>
void SetTransportArgs(const TensorStreamOptions& o, Args* args) {
  if (o.http2_window_bytes > 0) {
    args->SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.http2_window_bytes);
    // BDP probing would shrink the window back to its (tiny, on a fast link) estimate.
    args->SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  if (o.http2_max_frame_bytes > 0) args->SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, o.http2_max_frame_bytes);
  if (o.tcp_read_chunk_bytes > 0) {
    args->SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
    args->SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
  }
}

// ServerBuilder has AddChannelArgument rather than SetInt.
struct BuilderArgs {
  grpc::ServerBuilder* builder;
  void SetInt(const char* key, int value) { builder->AddChannelArgument(key, value); }
};

}  // namespace

void RetainFreedMemory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (tunables != nullptr &&
        (std::strstr(tunables, "trim_threshold") != nullptr || std::strstr(tunables, "mmap_threshold") != nullptr)) {
      return;
    }
    mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
    mallopt(M_TRIM_THRESHOLD, kRetainFreedBytes);
  });
#endif
}

void ApplyTransportOptions(const TensorStreamOptions& options, grpc::ChannelArguments* args) {
  SetTransportArgs(options, args);
}

void ApplyTransportOptions(const TensorStreamOptions& options, grpc::ServerBuilder* builder) {
  BuilderArgs args{builder};
  SetTransportArgs(options, &args);
}

}  // namespace geotrain::comm
