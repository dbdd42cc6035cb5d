// TCP reachability probes of silent workers (see liveness_probe.h).
#include "head/liveness_probe.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/time/clock.h"

namespace geotrain::head {
namespace {

// Splits "host:port" or "[v6]:port"; false when malformed.
bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return !host->empty();
}

// Starts a non-blocking connect; returns the socket (-1 when the address does not resolve or the
// connection failed at once, with *result set).
int StartConnect(const std::string& address, Reachability* result) {
  *result = Reachability::kUnreachable;
  std::string host, port;
  if (!SplitHostPort(address, &host, &port)) return -1;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &info) != 0 || info == nullptr) return -1;
  const int fd = socket(info->ai_family, info->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, info->ai_protocol);
  if (fd < 0) {
    freeaddrinfo(info);
    return -1;
  }
  const int rc = connect(fd, info->ai_addr, info->ai_addrlen);
  const int err = errno;
  freeaddrinfo(info);
  if (rc == 0) {
    *result = Reachability::kListening;
    close(fd);
    return -1;
  }
  if (err == EINPROGRESS) return fd;
  *result = err == ECONNREFUSED ? Reachability::kRefused : Reachability::kUnreachable;
  close(fd);
  return -1;
}

}  // namespace

const char* ReachabilityName(Reachability r) {
  switch (r) {
    case Reachability::kRefused:
      return "refused";
    case Reachability::kListening:
      return "listening";
    case Reachability::kUnreachable:
      return "unreachable";
  }
  return "unknown";
}

std::vector<Reachability> ProbeTcp(const std::vector<std::string>& addresses, absl::Duration timeout) {
  std::vector<Reachability> out(addresses.size(), Reachability::kUnreachable);
  std::vector<pollfd> fds;
  std::vector<size_t> index;
  for (size_t i = 0; i < addresses.size(); ++i) {
    const int fd = StartConnect(addresses[i], &out[i]);
    if (fd < 0) continue;
    fds.push_back({fd, POLLOUT, 0});
    index.push_back(i);
  }
  const absl::Time deadline = absl::Now() + timeout;
  size_t open = fds.size();
  while (open > 0) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) break;
    const int n = poll(fds.data(), fds.size(), static_cast<int>(left_ms));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].fd < 0 || fds[k].revents == 0) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      out[index[k]] = err == 0 ? Reachability::kListening
                               : (err == ECONNREFUSED ? Reachability::kRefused : Reachability::kUnreachable);
      close(fds[k].fd);
      fds[k].fd = -1;  // poll ignores negative descriptors
      --open;
    }
  }
  for (pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  return out;
}

}  // namespace geotrain::head
