// Metrics server, RPC metrics and a /proc-based process collector.
#include "common/metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/clock.h"

namespace geotrain {
namespace {

// Process basics in the names Prometheus' own client libraries use.
class ProcessCollector : public prometheus::Collectable {
 public:
  ProcessCollector() : start_unix_seconds_(RealClock::Get()->UnixMillis() / 1000.0) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&out](const char* name, const char* help, prometheus::MetricType type, double v) {
      prometheus::MetricFamily f;
      f.name = name;
      f.help = help;
      f.type = type;
      prometheus::ClientMetric m;
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = v;
      } else {
        m.gauge.value = v;
      }
      f.metric.push_back(m);
      out.push_back(std::move(f));
    };
    const long ticks = sysconf(_SC_CLK_TCK);
    const long page = sysconf(_SC_PAGESIZE);
    std::ifstream stat("/proc/self/stat");
    std::string line;
    std::getline(stat, line);
    // Fields after the command name (which is in parentheses and may hold spaces).
    const size_t close = line.rfind(')');
    if (close != std::string::npos) {
      std::istringstream rest(line.substr(close + 2));
      std::vector<std::string> f;
      std::string tok;
      while (rest >> tok) f.push_back(tok);
      // f[0] is field 3 (state): utime is field 14, stime 15, rss 24.
      if (f.size() > 21) {
        const double cpu = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(ticks);
        gauge("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
              prometheus::MetricType::Counter, cpu);
        gauge("process_resident_memory_bytes", "Resident memory size in bytes.", prometheus::MetricType::Gauge,
              std::stod(f[21]) * static_cast<double>(page));
        gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", prometheus::MetricType::Gauge,
              std::stod(f[20]));
      }
    }
    gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
          prometheus::MetricType::Gauge, start_unix_seconds_);
    int fds = 0;
    if (DIR* dir = opendir("/proc/self/fd"); dir != nullptr) {
      while (readdir(dir) != nullptr) ++fds;
      closedir(dir);
      fds -= 2;  // . and ..
    }
    gauge("process_open_fds", "Number of open file descriptors.", prometheus::MetricType::Gauge, fds);
    return out;
  }

 private:
  double start_unix_seconds_;
};

}  // namespace

RpcMetrics::RpcMetrics(prometheus::Registry& registry)
    : duration_(prometheus::BuildHistogram()
                    .Name("geotrain_rpc_duration_seconds")
                    .Help("Time spent serving an RPC, by method")
                    .Register(registry)),
      total_(prometheus::BuildCounter()
                 .Name("geotrain_rpc_total")
                 .Help("RPCs served, by method and gRPC status code")
                 .Register(registry)) {}

void RpcMetrics::Observe(const std::string& method, int grpc_code, double seconds) {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  duration_.Add({{"method", method}}, kBuckets).Observe(seconds);
  total_.Add({{"method", method}, {"code", std::to_string(grpc_code)}}).Increment();
}

RpcTimer::~RpcTimer() {
  if (metrics_ == nullptr) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  metrics_->Observe(method_, code_, seconds);
}

MetricsServer::MetricsServer()
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(std::make_shared<ProcessCollector>()),
      rpc_(*registry_) {}

MetricsServer::~MetricsServer() {
  if (wake_fds_[1] >= 0) (void)!::write(wake_fds_[1], "x", 1);
  if (server_thread_.joinable()) server_thread_.join();
  for (int fd : {listen_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

absl::Status MetricsServer::Start(const std::string& bind_address) {
  const size_t colon = bind_address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", bind_address, "' is not HOST:PORT"));
  }
  const std::string host = bind_address.substr(0, colon);
  const std::string port = bind_address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", bind_address, "': ", gai_strerror(rc)));
  }
  int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = fd >= 0 && ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 && ::listen(fd, 128) == 0;
  const std::string error = std::strerror(errno);
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", bind_address, ": ", error,
                                               "; choose another port with --metrics-port"));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (::pipe2(wake_fds_, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", std::strerror(errno)));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  listen_fd_ = fd;
  server_thread_ = std::thread([this] { ServeLoop(); });
  return absl::OkStatus();
}

std::string MetricsServer::Scrape() {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> process = process_->Collect();
  families.insert(families.end(), process.begin(), process.end());
  return prometheus::TextSerializer().Serialize(families);
}

std::string MetricsHttpResponse(std::string_view request, const std::function<std::string()>& scrape) {
  std::string status = "200 OK", body;
  if (request.starts_with("GET /metrics") || request.starts_with("GET / ")) {
    body = scrape();
  } else if (request.starts_with("GET ")) {
    status = "404 Not Found";
    body = "geotrain serves metrics at /metrics\n";
  } else {
    status = "405 Method Not Allowed";
    body = "only GET /metrics\n";
  }
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n",
                      "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

// One open connection: reading its request head, then writing the response.
struct MetricsServer::Connection {
  int fd = -1;
  std::chrono::steady_clock::time_point deadline;
  std::string request;
  std::string response;  // non-empty once the request was answered
  size_t sent = 0;       // bytes of `response` sent; once all are, the rest of the request is drained
};

namespace {

void SendAndClose(int fd, std::string_view bytes) {
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort, never blocks
  ::close(fd);
}

}  // namespace

void MetricsServer::AcceptAll(std::vector<Connection>* connections) {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN: nothing more pending (or a transient error: poll reports it again)
    if (connections->size() >= static_cast<size_t>(kMetricsMaxConnections)) {
      static constexpr std::string_view kBusy =
          "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      SendAndClose(fd, kBusy);
      continue;
    }
    Connection c;
    c.fd = fd;
    c.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kMetricsConnectionTimeoutMs);
    connections->push_back(std::move(c));
  }
}

bool MetricsServer::Progress(Connection* c) {
  if (c->response.empty()) {
    char buf[4096];
    while (true) {
      const ssize_t n = ::recv(c->fd, buf, sizeof(buf), 0);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // wait for more
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return false;
      if (n > 0) c->request.append(buf, std::min<size_t>(n, kMetricsMaxRequestBytes - c->request.size()));
      // Only the request line matters: answer once the head is complete, the client stopped sending, or the
      // head reached its bound.
      if (n == 0 || c->request.find("\r\n\r\n") != std::string::npos || c->request.size() >= kMetricsMaxRequestBytes) {
        c->response = MetricsHttpResponse(c->request, [this] { return Scrape(); });
        c->request.clear();
        break;
      }
    }
  }
  while (c->sent < c->response.size()) {
    const ssize_t n = ::send(c->fd, c->response.data() + c->sent, c->response.size() - c->sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    c->sent += static_cast<size_t>(n);
    if (c->sent == c->response.size()) ::shutdown(c->fd, SHUT_WR);
  }
  // Answered: what the client still sends is read and dropped until it closes (or the deadline), since
  // closing with unread bytes would reset the connection and could lose the response on its way.
  char buf[4096];
  while (true) {
    const ssize_t n = ::recv(c->fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;
  }
}

void MetricsServer::ServeLoop() {
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  while (true) {
    polled.clear();
    polled.push_back({wake_fds_[0], POLLIN, 0});
    polled.push_back({listen_fd_, POLLIN, 0});
    auto now = std::chrono::steady_clock::now();
    auto next_deadline = now + std::chrono::hours(1);
    for (const Connection& c : connections) {
      const bool writing = !c.response.empty() && c.sent < c.response.size();
      polled.push_back({c.fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
      next_deadline = std::min(next_deadline, c.deadline);
    }
    const int timeout_ms =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1);
    if (::poll(polled.data(), polled.size(), std::max(timeout_ms, 0)) < 0 && errno != EINTR) break;
    if (polled[0].revents != 0) break;  // the destructor
    now = std::chrono::steady_clock::now();
    // Connections first (their pollfds are in the same order), then new ones.
    std::vector<Connection> kept;
    kept.reserve(connections.size());
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      bool open = now < c.deadline;
      if (open && polled[i + 2].revents != 0) open = Progress(&c);
      if (open) {
        kept.push_back(std::move(c));
      } else {
        ::close(c.fd);
      }
    }
    connections = std::move(kept);
    if (polled[1].revents & (POLLHUP | POLLERR | POLLNVAL)) break;
    if (polled[1].revents & POLLIN) AcceptAll(&connections);
  }
  for (const Connection& c : connections) ::close(c.fd);
}

prometheus::Family<prometheus::Gauge>& MetricsServer::Gauges(const std::string& name, const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
}

prometheus::Family<prometheus::Counter>& MetricsServer::Counters(const std::string& name, const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
}

}  // namespace geotrain
