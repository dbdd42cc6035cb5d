// Moving files between nodes in chunks (data staging and checkpoint gathering, proto/staging.proto): reading a
// byte range of a file chunk by chunk, CRC-32C of a file or a prefix of it, and serving a file from an offset on a
// DataStaging stream (the FileChunk messages of FetchCheckpointFile), which the head's and the workers' services
// share. Receiving a checkpoint file, which knows the checkpoint's names and checksums, is model's
// (model/checkpoint_receive.h).
//
//   RETURN_IF_ERROR(ReadFileRange(path, offset, size, kFileChunkBytes,
//                                 [&](absl::string_view data, uint64_t at) { return Send(data, at); }));
//   ASSIGN_OR_RETURN(uint32_t crc, FileCrc32c(path));
//   grpc::Status s = ToGrpc(ServeFile(path, request->offset(), writer));
//
// Thread-safety: the functions are independent and keep no state; each ServeFile call serves one stream. Errors
// name the file.
#pragma once

#include <grpcpp/support/sync_stream.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "staging.pb.h"

namespace geotrain::comm {

// The payload of one message of a file stream: below gRPC's default 4 MiB message cap.
inline constexpr size_t kFileChunkBytes = size_t{1} << 20;

// Calls `consume(data, offset)` for consecutive chunks of at most `chunk_bytes` covering [offset, end) of the
// file; stops at the first error `consume` returns. DATA_LOSS when the file is shorter than `end`.
absl::Status ReadFileRange(const std::string& path, uint64_t offset, uint64_t end, size_t chunk_bytes,
                           const std::function<absl::Status(absl::string_view data, uint64_t offset)>& consume);

// CRC-32C of the first `bytes` bytes of the file (all of it when bytes < 0).
absl::StatusOr<uint32_t> FileCrc32c(const std::string& path, int64_t bytes = -1);
// "%08x".
std::string Hex32(uint32_t value);

// The size of a file (NOT_FOUND when it does not exist).
absl::StatusOr<uint64_t> FileSize(const std::string& path);

// Streams the file from `offset` (the first message carries the file's size). Errors name the file: NOT_FOUND,
// OUT_OF_RANGE for an offset past its end, CANCELLED when the reader went away.
absl::Status ServeFile(const std::string& path, uint64_t offset, grpc::ServerWriterInterface<FileChunk>* writer);

}  // namespace geotrain::comm
