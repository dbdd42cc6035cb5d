// What the two ends of a tensor stream share below their public headers (tensor_stream_server.cc and
// tensor_stream_client.cc): the transport options of TensorStreamOptions as gRPC channel arguments, and the
// process's heap setting that keeps gRPC's receive buffers resident. Internal to comm/: callers of the streams use
// tensor_stream.h.
//
//   RetainFreedMemory();                               // in each endpoint's constructor
//   ApplyTransportOptions(options, &channel_arguments);  // or (options, &server_builder)
//
// Thread-safety: RetainFreedMemory may be called from any thread (it acts once per process); ApplyTransportOptions
// only writes the arguments it is given.
#pragma once

#include "comm/tensor_types.h"

namespace grpc {
class ChannelArguments;
class ServerBuilder;
}  // namespace grpc

namespace geotrain::comm {

// Raises glibc's malloc trim threshold (and the mmap threshold with it) for the whole process, once, unless
// GLIBC_TUNABLES sets either (tensor_stream.h, "Memory", says why). A no-op off glibc.
void RetainFreedMemory();

// Sets the HTTP/2 window (with BDP probing off), the largest HTTP/2 frame and the TCP read chunk that `options`
// asks for (each only when it is > 0), on a client channel's arguments or on a server's builder.
void ApplyTransportOptions(const TensorStreamOptions& options, grpc::ChannelArguments* args);
void ApplyTransportOptions(const TensorStreamOptions& options, grpc::ServerBuilder* builder);

}  // namespace geotrain::comm
