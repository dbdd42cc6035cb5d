// Files in chunks (see file_transfer.h).
#include "comm/file_transfer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/crc32c.h"
#include "common/status.h"

namespace geotrain::comm {
namespace {

// An open file descriptor closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

absl::Status ReadFileRange(const std::string& path, uint64_t offset, uint64_t end, size_t chunk_bytes,
                           const std::function<absl::Status(absl::string_view data, uint64_t offset)>& consume) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  ::posix_fadvise(fd.get(), static_cast<off_t>(offset), 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(std::max<size_t>(chunk_bytes, 1));
  uint64_t at = offset;
  while (at < end) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buffer.size(), end - at));
    const ssize_t n = ::pread(fd.get(), buffer.data(), want, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("reading ", path, " at byte ", at, ": ", std::strerror(errno)));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, " ends at byte ", at, ", before byte ", end,
                                              "; the file was truncated while it was read"));
    }
    RETURN_IF_ERROR(consume(absl::string_view(buffer.data(), static_cast<size_t>(n)), at));
    at += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot stat ", path, ": ", std::strerror(errno)));
  }
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<uint32_t> FileCrc32c(const std::string& path, int64_t bytes) {
  uint64_t end = 0;
  if (bytes < 0) {
    ASSIGN_OR_RETURN(end, FileSize(path));
  } else {
    end = static_cast<uint64_t>(bytes);
  }
  uint32_t crc = 0;
  RETURN_IF_ERROR(ReadFileRange(path, 0, end, size_t{4} << 20, [&crc](absl::string_view data, uint64_t) {
    crc = Crc32c(data.data(), data.size(), crc);
    return absl::OkStatus();
  }));
  return crc;
}

std::string Hex32(uint32_t value) { return absl::StrFormat("%08x", value); }

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

}  // namespace geotrain::comm
