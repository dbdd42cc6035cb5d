// Serving and receiving files on DataStaging streams (see staging_files.h).
#include "comm/staging_files.h"

#include "absl/strings/str_cat.h"
#include "comm/file_transfer.h"
#include "common/status.h"
#include "model/checkpoint_files.h"

namespace geotrain::comm {

absl::Status ServeFile(const std::string& path, uint64_t offset, grpc::ServerWriterInterface<FileChunk>* writer) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(path));
  if (offset > size) return absl::OutOfRangeError(absl::StrCat(path, ": offset ", offset, " is past its end"));
  bool first = true;
  auto send = [&](absl::string_view data, uint64_t at) -> absl::Status {
    FileChunk chunk;
    if (first) chunk.set_bytes(size);
    first = false;
    chunk.set_offset(at);
    chunk.set_data(std::string(data));
    if (!writer->Write(chunk)) return absl::CancelledError(absl::StrCat("sending ", path, ": the reader went away"));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(ReadFileRange(path, offset, size, kFileChunkBytes, send));
  if (first) return send("", size);  // nothing left to send: the size alone
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReceiveCheckpointFile(
    grpc::ServerReaderInterface<CheckpointFileChunk>* reader,
    const std::function<absl::StatusOr<std::string>(const CheckpointFileChunk& first)>& step_dir_for) {
  CheckpointFileChunk chunk;
  if (!reader->Read(&chunk)) return absl::InvalidArgumentError("PutCheckpointFile: an empty stream");
  if (!model::IsCheckpointFileName(chunk.name())) {
    return absl::InvalidArgumentError(absl::StrCat("PutCheckpointFile: '", chunk.name(), "' is not a plain file name"));
  }
  ASSIGN_OR_RETURN(std::string step_dir, step_dir_for(chunk));
  const std::string path = absl::StrCat(step_dir, "/", chunk.name());
  ASSIGN_OR_RETURN(std::unique_ptr<model::IncomingCheckpointFile> file,
                   model::IncomingCheckpointFile::Create(path, chunk.bytes(), chunk.crc32()));
  do {
    RETURN_IF_ERROR(file->Append(chunk.data()));
  } while (reader->Read(&chunk));
  RETURN_IF_ERROR(file->Finish());
  return path;
}

}  // namespace geotrain::comm
