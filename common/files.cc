// Whole-file reads and crash-safe writes (see files.h).
#include "common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

absl::Status Errno(int err, const std::string& what, const std::string& path) {
  const std::string message = absl::StrCat(what, " '", path, "': ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(absl::StrCat(message, "; free disk space"));
  if (err == EACCES || err == EPERM || err == EROFS) {
    return absl::PermissionDeniedError(absl::StrCat(message, "; check the directory's permissions"));
  }
  return absl::InternalError(message);
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents, int mode) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", counter++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return Errno(errno, "cannot create", tmp);
  ::fchmod(fd, mode);  // whatever the umask
  auto fail = [&](int err, const char* what) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return Errno(err, what, tmp);
  };
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno, "cannot write");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail(errno, "cannot flush");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Errno(err, "cannot close", tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Errno(err, "cannot rename onto", path);
  }
  // The rename is durable only once the directory is.
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno(errno, "cannot open the directory of", path);
  const bool synced = ::fsync(dfd) == 0;
  const int err = errno;
  ::close(dfd);
  if (!synced) return Errno(err, "cannot flush the directory of", path);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return ss.str();
}

}  // namespace geotrain
