// safetensors reading and writing, atomic file writes and CRC-32 (see safetensors.h).
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace geotrain::model {
namespace {

using Json = nlohmann::ordered_json;  // the header's keys in the order written

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

const NamedTensor* SafetensorsFile::Find(const std::string& name) const {
  for (const NamedTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

absl::Status WriteSafetensorsAtomically(const std::string& path, const std::vector<NamedTensor>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  Json json = Json::object();
  if (!metadata.empty()) json["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& t = tensors[i];
    int64_t count = 1;
    for (int64_t d : t.shape) count *= d;
    if (count != static_cast<int64_t>(t.data.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t.name, " has ", t.data.size(), " floats but its shape holds ", count));
    }
    if (json.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", t.name, "' is used twice; names must be unique"));
    }
    const uint64_t bytes = t.data.size() * sizeof(float);
    json[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  // Names that are not UTF-8 are written with U+FFFD rather than throwing.
  std::string header = json.dump(-1, ' ', false, Json::error_handler_t::replace);
  while (header.size() % 8 != 0) header += ' ';
  std::string out;
  out.reserve(8 + header.size() + offset);
  const uint64_t header_size = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((header_size >> (8 * i)) & 0xff));
  out += header;
  for (const NamedTensor& t : tensors) {
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
  }
  return WriteFileAtomically(path, out);
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  const std::string& b = bytes;
  if (b.size() < 8) {
    return absl::DataLossError(absl::StrCat(path, ": ", b.size(), " bytes is too short for a safetensors file"));
  }
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
  if (header_size > b.size() - 8 || header_size > (100u << 20)) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_size, " exceeds the file (", b.size(),
                                            " bytes); the file is truncated or not safetensors"));
  }
  const nlohmann::json header =
      nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(header_size), nullptr,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": header is not a valid JSON object"));
  }
  const uint64_t data_size = b.size() - 8 - header_size;
  const char* data = b.data() + 8 + header_size;
  SafetensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<std::pair<uint64_t, size_t>> order;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (value.is_object()) {
        for (const auto& [k, v] : value.items()) file.metadata[k] = v.is_string() ? v.get<std::string>() : "";
      }
      continue;
    }
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "': ", why));
    };
    if (!value.is_object()) return bad("entry is not an object");
    auto dtype_it = value.find("dtype"), shape_it = value.find("shape"), offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || shape_it == value.end() || offsets_it == value.end()) {
      return bad("needs dtype, shape and data_offsets");
    }
    const std::string dtype = dtype_it->is_string() ? dtype_it->get<std::string>() : "";
    size_t elem = 0;
    if (dtype == "F32")
      elem = 4;
    else if (dtype == "F16" || dtype == "BF16")
      elem = 2;
    else
      return bad(absl::StrCat("dtype ", dtype, " is not supported (F32, F16, BF16)"));
    NamedTensor t;
    t.name = name;
    uint64_t count = 1;
    if (!shape_it->is_array()) return bad("shape is not a list");
    for (const nlohmann::json& d : *shape_it) {
      if (!d.is_number()) return bad("shape has a bad dimension");
      const double v = d.get<double>();
      if (v < 0 || v != std::floor(v) || v > 1e12) return bad("shape has a bad dimension");
      t.shape.push_back(static_cast<int64_t>(v));
      count *= static_cast<uint64_t>(v);
    }
    const nlohmann::json& offs = *offsets_it;
    if (!offs.is_array() || offs.size() != 2) return bad("data_offsets must have two entries");
    if (!offs[0].is_number() || !offs[1].is_number()) return bad("data_offsets must be numbers");
    const double begin_d = offs[0].get<double>(), end_d = offs[1].get<double>();
    if (begin_d < 0 || end_d < begin_d || end_d > static_cast<double>(data_size)) {
      return bad(absl::StrCat("data_offsets [", begin_d, ", ", end_d, "] lie outside the ", data_size,
                              " data bytes; the file is truncated or corrupt"));
    }
    const uint64_t begin = static_cast<uint64_t>(begin_d), end = static_cast<uint64_t>(end_d);
    if (end - begin != count * elem) {
      return bad(absl::StrCat("shape needs ", count * elem, " bytes but data_offsets give ", end - begin));
    }
    t.data.resize(count);
    if (elem == 4) {
      std::memcpy(t.data.data(), data + begin, count * 4);
    } else {
      for (uint64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, data + begin + 2 * i, 2);
        t.data[i] = dtype == "BF16" ? [&] {
          const uint32_t bits = static_cast<uint32_t>(h) << 16;
          float x;
          std::memcpy(&x, &bits, 4);
          return x;
        }()
                                    : HalfToFloat(h);
      }
    }
    ranges.emplace_back(begin, end);
    order.emplace_back(begin, file.tensors.size());
    file.tensors.push_back(std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::DataLossError(absl::StrCat(path, ": tensors overlap in the data section; the file is corrupt"));
    }
  }
  std::sort(order.begin(), order.end());
  std::vector<NamedTensor> sorted;
  for (const auto& [offset, index] : order) sorted.push_back(std::move(file.tensors[index]));
  file.tensors = std::move(sorted);
  return file;
}

}  // namespace geotrain::model
