// Receiving a checkpoint file copied from the node that wrote it (PutCheckpointFile, proto/staging.proto), for the
// head's and the workers' DataStaging services: the first message names the file, which must be a plain file name
// of a step directory; the caller says which step directory it goes to; the file takes its name there only once
// its size and CRC-32 match what the sender declared (IncomingCheckpointFile, model/checkpoint_files.h). No gRPC
// here: the caller hands over the stream's messages through `read`.
//
//   ASSIGN_OR_RETURN(std::string path, ReceiveCheckpointFile(
//       [reader](CheckpointFileChunk* chunk) { return reader->Read(chunk); },
//       [&](const CheckpointFileChunk& first) { return StepDirectory(dir_for(first.job_id()), first.step()); }));
//
// Thread-safety: keeps no state; each call reads one stream.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "staging.pb.h"

namespace geotrain::model {

// Reads a PutCheckpointFile stream: `read` fills in the next message (false at the stream's end); the first message
// names the file; `step_dir_for` says which directory it goes to (or why it is refused, which is returned as is).
// Returns the file's path. INVALID_ARGUMENT for an empty stream or a name that is not a plain file name (checked
// before `step_dir_for` is asked), DATA_LOSS for a copy that does not verify, and IncomingCheckpointFile's errors
// (a full disk) naming the file.
absl::StatusOr<std::string> ReceiveCheckpointFile(
    const std::function<bool(CheckpointFileChunk* chunk)>& read,
    const std::function<absl::StatusOr<std::string>(const CheckpointFileChunk& first)>& step_dir_for);

}  // namespace geotrain::model
