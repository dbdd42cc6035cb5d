// Control-port client: see control_client.h.
#include "netem/control_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "netem/strings.h"

namespace geotrain::netem {
namespace {

constexpr size_t kMaxReplyBytes = 1 << 20;

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// True when `reply` holds a complete answer: its last line is "ok" or starts with "error: ".
bool Complete(const std::string& reply) {
  if (reply.empty() || reply.back() != '\n') return false;
  const size_t start = reply.rfind('\n', reply.size() - 2);
  const absl::string_view last = absl::string_view(reply).substr(start == std::string::npos ? 0 : start + 1);
  return last == "ok\n" || absl::StartsWith(last, "error: ");
}

}  // namespace

absl::StatusOr<std::string> SendControlCommand(int port, std::string_view command, std::chrono::milliseconds timeout,
                                               const std::string& host) {
  if (command.find('\n') != std::string_view::npos) {
    return absl::InvalidArgumentError("a control command is one line");
  }
  const std::string where = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve control host '", host, "'"));
  }
  Fd fd(socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int rc = fd.get() < 0 ? -1 : connect(fd.get(), found->ai_addr, found->ai_addrlen);
  const int err = errno;
  freeaddrinfo(found);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot reach the emulator's control port ", where, ": ",
                                               std::strerror(err), "; is geotrain-netem running with --control-port ",
                                               port, "?"));
  }
  const std::string line = absl::StrCat(ToAbsl(command), "\n");
  size_t sent = 0;
  while (sent < line.size()) {
    const ssize_t n = send(fd.get(), line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return absl::UnavailableError(absl::StrCat("control port ", where, ": send failed"));
    sent += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string reply;
  char buffer[4096];
  while (!Complete(reply)) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd.get(), POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      return absl::DeadlineExceededError(absl::StrCat("control port ", where, ": no complete reply to '",
                                                      ToAbsl(command), "' within ", timeout.count(), " ms"));
    }
    const ssize_t n = recv(fd.get(), buffer, sizeof(buffer), 0);
    if (n <= 0) {
      return absl::UnavailableError(absl::StrCat("control port ", where, ": connection closed before the reply ended"));
    }
    reply.append(buffer, static_cast<size_t>(n));
    if (reply.size() > kMaxReplyBytes) {
      return absl::DataLossError(absl::StrCat("control port ", where, ": reply too long"));
    }
  }
  const size_t start = reply.rfind('\n', reply.size() - 2);
  const size_t last = start == std::string::npos ? 0 : start + 1;
  if (absl::StartsWith(absl::string_view(reply).substr(last), "error: ")) {
    return absl::InvalidArgumentError(reply.substr(last + 7, reply.size() - last - 8));  // without "error: " and '\n'
  }
  return reply.substr(0, last);
}

absl::StatusOr<std::vector<LinkDirectionStats>> ParseStatsText(std::string_view text) {
  std::vector<LinkDirectionStats> stats;
  for (absl::string_view line : absl::StrSplit(ToAbsl(text), '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto bad = [&] { return absl::DataLossError(absl::StrCat("malformed stats line '", line, "'")); };
    if (words.size() < 3 || words[0] != "link") return bad();
    std::pair<absl::string_view, absl::string_view> ends = absl::StrSplit(words[1], '>');
    if (ends.first.empty() || ends.second.empty()) return bad();
    LinkDirectionStats s;
    s.src = std::string(ends.first);
    s.dst = std::string(ends.second);
    if (words[2] != "up" && words[2] != "down") return bad();
    s.up = words[2] == "up";
    const std::pair<const char*, double*> doubles[] = {
        {"latency_ms", &s.params.latency_ms}, {"bandwidth_mbps", &s.params.bandwidth_mbps},
        {"jitter_ms", &s.params.jitter_ms},   {"stalled_ms", &s.stalled_ms_left},
        {"measured_mbps", &s.measured_mbps},  {"measured_delay_ms", &s.measured_delay_ms}};
    const std::pair<const char*, int64_t*> integers[] = {
        {"bytes_in", &s.bytes_in},         {"bytes_out", &s.bytes_out},
        {"queued_bytes", &s.queued_bytes}, {"connections", &s.connections_total},
        {"active", &s.connections_active}, {"reset", &s.connections_reset}};
    for (size_t i = 3; i < words.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(words[i], absl::MaxSplits('=', 1));
      bool parsed = true;
      for (const auto& [key, field] : doubles) {
        if (kv.first == key) parsed = absl::SimpleAtod(kv.second, field);
      }
      for (const auto& [key, field] : integers) {
        if (kv.first == key) parsed = absl::SimpleAtoi(kv.second, field);
      }
      if (!parsed) return bad();
      // Unknown keys are skipped so that newer emulators can add fields.
    }
    stats.push_back(std::move(s));
  }
  return stats;
}

absl::StatusOr<std::vector<LinkDirectionStats>> QueryStats(int port, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(std::string text, SendControlCommand(port, "stats", timeout));
  return ParseStatsText(text);
}

}  // namespace geotrain::netem
