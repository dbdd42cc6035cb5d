// Whole-file reads and crash-safe writes, for every file geotrain writes that must survive a crash: the
// head's token and records, checkpoints, manifests.
//
//   RETURN_IF_ERROR(WriteFileAtomically("ckpt/latest", "step_00000100\n"));
//   ASSIGN_OR_RETURN(std::string text, ReadFileToString("ckpt/latest"));
//
// WriteFileAtomically writes a temporary file beside `path`, fsyncs it, renames it over `path` and fsyncs the
// directory, so that after a crash or power loss a reader finds either the old file or the whole new one,
// and the rename itself is durable. Errors name the file and the cause: RESOURCE_EXHAUSTED for a full disk
// (ENOSPC, EDQUOT), PERMISSION_DENIED, else INTERNAL; nothing is left under `path` or the temporary name.
// Thread-safety: safe from any thread (temporary names carry the process id and a counter).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain {

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents, int mode = 0644);
// NOT_FOUND when the file cannot be opened; DATA_LOSS when reading fails part-way.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace geotrain
