// Reading and writing safetensors files (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw little-endian tensor bytes. Only F32 tensors are written; F32 is read (F16 and BF16 are
// widened to F32 on read, which covers HF checkpoints).
//
//   std::vector<NamedTensor> tensors = ...;
//   absl::Status s = WriteSafetensorsAtomically("model.safetensors", tensors, {{"step", "100"}});
//   absl::StatusOr<SafetensorsFile> f = ReadSafetensors("model.safetensors");
//
// Everything read is validated before use: header length within the file, JSON well formed, known
// dtype, offsets inside the data section, no overlaps, shape x dtype size == byte range.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/files.h"

namespace geotrain::model {

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  // product(shape) floats
};

struct SafetensorsFile {
  std::vector<NamedTensor> tensors;  // in file (offset) order
  std::map<std::string, std::string> metadata;
  const NamedTensor* Find(const std::string& name) const;
};

// Writes to path + ".tmp", fsyncs, renames over path and fsyncs the directory: a reader sees either the
// old file or the whole new one.
absl::Status WriteSafetensorsAtomically(const std::string& path, const std::vector<NamedTensor>& tensors,
                                        const std::map<std::string, std::string>& metadata);
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// Crash-safe writes and whole-file reads (common/files.h), used here and by checkpoints.
using ::geotrain::ReadFileToString;
using ::geotrain::WriteFileAtomically;

// CRC-32 (IEEE 802.3, as zlib) of a byte range; the checkpoint manifest records it per file.
uint32_t Crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace geotrain::model
