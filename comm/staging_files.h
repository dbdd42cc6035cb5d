// The server side of file streams shared by the head's and the workers' DataStaging services
// (proto/staging.proto): a file served from an offset, and a checkpoint file received, verified by CRC and put in
// place under the step directory the service chooses for it.
//
//   grpc::Status s = ToGrpc(ServeFile(path, request->offset(), writer));
//   ASSIGN_OR_RETURN(std::string path, ReceiveCheckpointFile(reader, [&](const CheckpointFileChunk& first) {
//     return StepDirectory(dir_for(first.job_id()), first.step());
//   }));
//
// Thread-safety: the functions keep no state; each call serves one stream.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "staging.pb.h"

namespace geotrain::comm {

// Streams the file from `offset` (the first message carries the file's size). Errors name the file.
absl::Status ServeFile(const std::string& path, uint64_t offset, grpc::ServerWriterInterface<FileChunk>* writer);

// Reads a PutCheckpointFile stream: the first message names the file; `step_dir_for` says which directory it goes
// to (or why it is refused); the file takes its name there once its size and CRC-32 match what the sender
// declared. Returns the file's path. INVALID_ARGUMENT for a name that is not a plain file name, DATA_LOSS for a
// copy that does not verify.
absl::StatusOr<std::string> ReceiveCheckpointFile(
    grpc::ServerReaderInterface<CheckpointFileChunk>* reader,
    const std::function<absl::StatusOr<std::string>(const CheckpointFileChunk& first)>& step_dir_for);

}  // namespace geotrain::comm
