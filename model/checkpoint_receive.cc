// A checkpoint file received in chunks (see checkpoint_receive.h).
#include "model/checkpoint_receive.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/checkpoint_files.h"

namespace geotrain::model {

absl::StatusOr<std::string> ReceiveCheckpointFile(
    const std::function<bool(CheckpointFileChunk* chunk)>& read,
    const std::function<absl::StatusOr<std::string>(const CheckpointFileChunk& first)>& step_dir_for) {
  CheckpointFileChunk chunk;
  if (!read(&chunk)) return absl::InvalidArgumentError("PutCheckpointFile: an empty stream");
  if (!IsCheckpointFileName(chunk.name())) {
    return absl::InvalidArgumentError(absl::StrCat("PutCheckpointFile: '", chunk.name(), "' is not a plain file name"));
  }
  ASSIGN_OR_RETURN(std::string step_dir, step_dir_for(chunk));
  const std::string path = absl::StrCat(step_dir, "/", chunk.name());
  ASSIGN_OR_RETURN(std::unique_ptr<IncomingCheckpointFile> file,
                   IncomingCheckpointFile::Create(path, chunk.bytes(), chunk.crc32()));
  do {
    RETURN_IF_ERROR(file->Append(chunk.data()));
  } while (read(&chunk));
  RETURN_IF_ERROR(file->Finish());
  return path;
}

}  // namespace geotrain::model
