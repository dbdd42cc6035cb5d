// The HTTP server of common/http_server.h: request parsing, the poll loop, its handler pool and TLS.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

namespace geotrain {

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return value;
  }
  return "";
}

absl::StatusOr<HttpRequest> ParseHttpRequestHead(std::string_view whole) {
  absl::string_view head(whole.data(), whole.size());
  if (const size_t end = head.find("\r\n\r\n"); end != absl::string_view::npos) head = head.substr(0, end);
  std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
  std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
  if (parts.size() != 3) return absl::InvalidArgumentError("request line is not 'METHOD TARGET VERSION'");
  HttpRequest request;
  if (parts[0].empty() || parts[0].size() > 16 ||
      !std::all_of(parts[0].begin(), parts[0].end(), [](char c) { return c >= 'A' && c <= 'Z'; })) {
    return absl::InvalidArgumentError("method is not a word of capital letters");
  }
  if (!absl::StartsWith(parts[1], "/")) return absl::InvalidArgumentError("target does not start with '/'");
  if (!std::all_of(parts[1].begin(), parts[1].end(), [](char c) { return c > ' ' && c < 127; })) {
    return absl::InvalidArgumentError("target holds a control character, a space or a non-ASCII byte");
  }
  if (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") return absl::InvalidArgumentError("not HTTP/1.0 or 1.1");
  request.method = std::string(parts[0]);
  request.target = std::string(parts[1]);
  const size_t question = request.target.find('?');
  request.path = request.target.substr(0, question);
  if (question != std::string::npos) request.query = request.target.substr(question + 1);
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(absl::StrCat("header line ", i, " is not 'Name: value'"));
    }
    std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
    if (!std::all_of(name.begin(), name.end(), [](char c) { return c > ' ' && c < 127; })) {
      return absl::InvalidArgumentError(absl::StrCat("header line ", i, " has a malformed name"));
    }
    request.headers.emplace_back(std::move(name), std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
  }
  if (const std::string length = request.Header("content-length"); !length.empty()) {
    uint64_t n = 0;
    if (!absl::SimpleAtoi(length, &n)) return absl::InvalidArgumentError("Content-Length is not a number");
  }
  return request;
}

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string FormParameter(std::string_view query, std::string_view name) {
  for (absl::string_view pair : absl::StrSplit(absl::string_view(query.data(), query.size()), '&')) {
    const size_t equals = pair.find('=');
    if (pair.substr(0, equals) != absl::string_view(name.data(), name.size())) continue;
    if (equals == absl::string_view::npos) return "";
    std::string out;
    const absl::string_view value = pair.substr(equals + 1);
    for (size_t i = 0; i < value.size(); ++i) {
      if (value[i] == '+') {
        out.push_back(' ');
      } else if (value[i] == '%') {
        if (i + 2 >= value.size()) return "";
        const int hi = HexDigit(value[i + 1]);
        const int lo = HexDigit(value[i + 2]);
        if (hi < 0 || lo < 0) return "";
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
      } else {
        out.push_back(value[i]);
      }
    }
    return out;
  }
  return "";
}

std::string_view HttpReasonPhrase(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 204:
      return "No Content";
    case 303:
      return "See Other";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 409:
      return "Conflict";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 415:
      return "Unsupported Media Type";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return "Unknown";
  }
}

std::string SerializeHttpResponse(const HttpResponse& response) {
  const std::string_view reason = HttpReasonPhrase(response.status);
  std::string out = absl::StrCat("HTTP/1.1 ", response.status, " ", absl::string_view(reason.data(), reason.size()),
                                 "\r\nContent-Type: ", response.content_type, "\r\n");
  for (const auto& [name, value] : response.headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  absl::StrAppend(&out, "Content-Length: ", response.body.size(), "\r\nConnection: close\r\n\r\n", response.body);
  return out;
}

namespace {

using SteadyClock = std::chrono::steady_clock;

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  if (code == 0) return "unknown OpenSSL error";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  ERR_clear_error();
  return text;
}

absl::StatusOr<SSL_CTX*> MakeTlsContext(const HttpServerTls& tls) {
  if (tls.cert.empty() || tls.key.empty()) {
    return absl::InvalidArgumentError("HTTPS needs both a certificate and its key (--tls-cert, --tls-key)");
  }
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("TLS context: ", OpenSslError()));
  auto fail = [ctx](const std::string& what) {
    const std::string error = OpenSslError();
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", error));
  };
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx, tls.cert.c_str()) != 1) return fail("TLS certificate " + tls.cert);
  if (SSL_CTX_use_PrivateKey_file(ctx, tls.key.c_str(), SSL_FILETYPE_PEM) != 1) return fail("TLS key " + tls.key);
  if (SSL_CTX_check_private_key(ctx) != 1) return fail("TLS key " + tls.key + " does not match " + tls.cert);
  if (tls.require_client_cert) {
    if (SSL_CTX_load_verify_locations(ctx, tls.ca.c_str(), nullptr) != 1) return fail("TLS CA " + tls.ca);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    // Verified sessions are resumed only within this context: without one, OpenSSL fails every TLS 1.2
    // resumption (each answer closes its connection, so a browser resumes on every request).
    static constexpr unsigned char kSessionContext[] = "geotrain-http";
    SSL_CTX_set_session_id_context(ctx, kSessionContext, sizeof(kSessionContext) - 1);
  }
  return ctx;
}

std::string PeerName(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "unknown peer";
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  } else {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  }
  return absl::StrCat(host, ":", port);
}

// What a read or a write on a connection came to.
enum class Io { kProgress, kWaitRead, kWaitWrite, kEnd, kError };

}  // namespace

// One open connection, owned by the serving thread.
struct HttpConnection {
  enum class Phase { kHead, kBody, kHandling, kWriting, kDraining };
  uint64_t id = 0;
  int fd = -1;
  SSL* ssl = nullptr;
  std::string peer;
  SteadyClock::time_point deadline;
  Phase phase = Phase::kHead;
  bool wait_write = false;  // the last read or write is blocked on the socket becoming writable
  std::string input;        // the head (and the start of the body) as read
  std::string raw_head;
  HttpRequest request;
  bool parsed = false;
  size_t body_length = 0;
  std::string response;
  size_t sent = 0;

  ~HttpConnection() {
    if (ssl != nullptr) SSL_free(ssl);
    if (fd >= 0) ::close(fd);
  }
};

struct HttpServer::State {
  HttpServerOptions options;
  HttpHandler handler;
  SSL_CTX* tls = nullptr;
  int listen_fd = -1;
  int wake_fds[2] = {-1, -1};  // written by the pool (a response is ready) and the destructor
  std::atomic<bool> stopping{false};
  std::thread serving;
  std::vector<std::thread> pool;

  struct Job {
    uint64_t id;
    HttpRequest request;
    std::string raw_head;
  };
  absl::Mutex mu;
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);
  std::vector<std::pair<uint64_t, std::string>> done ABSL_GUARDED_BY(mu);
  bool pool_stopping ABSL_GUARDED_BY(mu) = false;

  std::map<uint64_t, std::unique_ptr<HttpConnection>> connections;  // the serving thread's
  uint64_t next_id = 1;

  ~State() {
    if (tls != nullptr) SSL_CTX_free(tls);
    for (int fd : {listen_fd, wake_fds[0], wake_fds[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return pool_stopping || !jobs.empty(); }
  void Wake() { (void)!::write(wake_fds[1], "x", 1); }
  void ServeLoop();
  void PoolLoop();
  void AcceptAll();
  // Reads, writes or drains what `c` is ready for; false once the connection is done (to be closed).
  bool Progress(HttpConnection* c);
  bool ReadRequest(HttpConnection* c);
  void Dispatch(HttpConnection* c);
  Io Read(HttpConnection* c, char* buf, size_t size, size_t* got);
  Io Write(HttpConnection* c, const char* data, size_t size, size_t* put);
};

HttpServer::HttpServer() = default;

HttpServer::~HttpServer() {
  if (state_ == nullptr) return;
  state_->stopping = true;
  if (state_->wake_fds[1] >= 0) state_->Wake();
  if (state_->serving.joinable()) state_->serving.join();
  {
    absl::MutexLock lock(&state_->mu);
    state_->pool_stopping = true;
  }
  for (std::thread& t : state_->pool) t.join();
  state_->connections.clear();
}

bool HttpServer::tls() const { return state_ != nullptr && state_->tls != nullptr; }

absl::Status HttpServer::Start(const std::string& bind_address, const HttpServerOptions& options, HttpHandler handler) {
  const size_t colon = bind_address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP address '", bind_address, "' is not HOST:PORT"));
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->options.handler_threads = std::max(1, options.handler_threads);
  state->handler = std::move(handler);
  if (options.tls.enabled()) {
    absl::StatusOr<SSL_CTX*> ctx = MakeTlsContext(options.tls);
    if (!ctx.ok()) return ctx.status();
    state->tls = *ctx;
  }
  std::string host = bind_address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = bind_address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP address '", bind_address, "': ", gai_strerror(rc)));
  }
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = fd >= 0 && ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 && ::listen(fd, 128) == 0;
  const std::string error = std::strerror(errno);
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", bind_address, ": ", error));
  }
  state->listen_fd = fd;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (::pipe2(state->wake_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("HTTP server: pipe: ", std::strerror(errno)));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  State* s = state.get();
  for (int i = 0; i < s->options.handler_threads; ++i) s->pool.emplace_back([s] { s->PoolLoop(); });
  s->serving = std::thread([s] { s->ServeLoop(); });
  state_ = std::move(state);
  return absl::OkStatus();
}

void HttpServer::State::PoolLoop() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(this, &State::HasWork));
      if (pool_stopping) return;
      job = std::move(jobs.front());
      jobs.pop_front();
    }
    std::string response;
    try {
      response = handler(job.request, job.raw_head);
    } catch (const std::exception& e) {
      response = SerializeHttpResponse({.status = 500, .body = "internal error\n"});
    }
    {
      absl::MutexLock lock(&mu);
      done.emplace_back(job.id, std::move(response));
    }
    Wake();
  }
}

void HttpServer::State::AcceptAll() {
  while (true) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN: nothing more pending (or a transient error: poll reports it again)
    if (connections.size() >= static_cast<size_t>(options.max_connections)) {
      // Plaintext clients get a word; on a TLS port nothing is said in plaintext.
      static constexpr std::string_view kBusy =
          "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      if (tls == nullptr) (void)::send(fd, kBusy.data(), kBusy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    auto c = std::make_unique<HttpConnection>();
    c->id = next_id++;
    c->fd = fd;
    c->peer = PeerName(fd);
    c->deadline = SteadyClock::now() + std::chrono::milliseconds(options.connection_timeout_ms);
    if (tls != nullptr) {
      c->ssl = SSL_new(tls);
      if (c->ssl == nullptr || SSL_set_fd(c->ssl, fd) != 1) continue;  // c's destructor closes fd
      SSL_set_accept_state(c->ssl);
    }
    connections.emplace(c->id, std::move(c));
  }
}

Io HttpServer::State::Read(HttpConnection* c, char* buf, size_t size, size_t* got) {
  *got = 0;
  if (c->ssl == nullptr) {
    while (true) {
      const ssize_t n = ::recv(c->fd, buf, size, 0);
      if (n > 0) {
        *got = static_cast<size_t>(n);
        return Io::kProgress;
      }
      if (n == 0) return Io::kEnd;
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? Io::kWaitRead : Io::kError;
    }
  }
  ERR_clear_error();
  const int n = SSL_read(c->ssl, buf, static_cast<int>(size));
  if (n > 0) {
    *got = static_cast<size_t>(n);
    return Io::kProgress;
  }
  switch (SSL_get_error(c->ssl, n)) {
    case SSL_ERROR_WANT_READ:
      return Io::kWaitRead;
    case SSL_ERROR_WANT_WRITE:
      return Io::kWaitWrite;
    case SSL_ERROR_ZERO_RETURN:
      return Io::kEnd;
    default:
      ERR_clear_error();
      return Io::kError;  // a failed handshake (a plaintext client), a reset
  }
}

Io HttpServer::State::Write(HttpConnection* c, const char* data, size_t size, size_t* put) {
  *put = 0;
  if (c->ssl == nullptr) {
    while (true) {
      const ssize_t n = ::send(c->fd, data, size, MSG_NOSIGNAL);
      if (n > 0) {
        *put = static_cast<size_t>(n);
        return Io::kProgress;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? Io::kWaitWrite : Io::kError;
    }
  }
  ERR_clear_error();
  const int n = SSL_write(c->ssl, data, static_cast<int>(std::min<size_t>(size, 1 << 20)));
  if (n > 0) {
    *put = static_cast<size_t>(n);
    return Io::kProgress;
  }
  switch (SSL_get_error(c->ssl, n)) {
    case SSL_ERROR_WANT_READ:
      return Io::kWaitRead;
    case SSL_ERROR_WANT_WRITE:
      return Io::kWaitWrite;
    default:
      ERR_clear_error();
      return Io::kError;
  }
}

void HttpServer::State::Dispatch(HttpConnection* c) {
  c->phase = HttpConnection::Phase::kHandling;
  c->input.clear();
  Job job{c->id, c->parsed ? std::move(c->request) : HttpRequest{}, std::move(c->raw_head)};
  job.request.peer = c->peer;
  job.request.tls = c->ssl != nullptr;
  absl::MutexLock lock(&mu);
  jobs.push_back(std::move(job));
}

bool HttpServer::State::ReadRequest(HttpConnection* c) {
  char buf[4096];
  while (c->phase == HttpConnection::Phase::kHead || c->phase == HttpConnection::Phase::kBody) {
    size_t got = 0;
    const Io io = Read(c, buf, sizeof(buf), &got);
    if (io == Io::kWaitRead || io == Io::kWaitWrite) {
      c->wait_write = io == Io::kWaitWrite;
      return true;
    }
    if (io == Io::kError) return false;
    if (c->phase == HttpConnection::Phase::kBody) {
      if (io == Io::kEnd) return false;  // a body cut short is not a request
      c->request.body.append(buf, std::min(got, c->body_length - c->request.body.size()));
      if (c->request.body.size() == c->body_length) Dispatch(c);
      continue;
    }
    // The head: answered once complete, once the client stopped sending, or once it reached its bound.
    c->input.append(buf, got);
    const size_t end = c->input.find("\r\n\r\n");
    if (io != Io::kEnd && end == std::string::npos && c->input.size() < options.max_head_bytes) continue;
    const size_t head_size = end == std::string::npos ? std::min(c->input.size(), options.max_head_bytes) : end + 4;
    c->raw_head = c->input.substr(0, head_size);
    absl::StatusOr<HttpRequest> parsed = end == std::string::npos && io != Io::kEnd
                                             ? absl::StatusOr<HttpRequest>(absl::InvalidArgumentError("too large"))
                                             : ParseHttpRequestHead(c->raw_head);
    c->parsed = parsed.ok();
    uint64_t length = 0;
    if (parsed.ok()) {
      c->request = *std::move(parsed);
      (void)absl::SimpleAtoi(c->request.Header("content-length"), &length);
    }
    if (length == 0 || options.max_body_bytes == 0 || end == std::string::npos) {
      Dispatch(c);
    } else if (length > options.max_body_bytes) {
      c->request.body_too_large = true;
      Dispatch(c);
    } else {
      c->body_length = static_cast<size_t>(length);
      c->request.body = c->input.substr(end + 4, c->body_length);
      c->phase = HttpConnection::Phase::kBody;
      if (c->request.body.size() == c->body_length) Dispatch(c);
    }
  }
  return true;
}

bool HttpServer::State::Progress(HttpConnection* c) {
  c->wait_write = false;
  if (c->phase == HttpConnection::Phase::kHead || c->phase == HttpConnection::Phase::kBody) return ReadRequest(c);
  while (c->phase == HttpConnection::Phase::kWriting) {
    size_t put = 0;
    const Io io = Write(c, c->response.data() + c->sent, c->response.size() - c->sent, &put);
    if (io == Io::kWaitRead || io == Io::kWaitWrite) {
      c->wait_write = io == Io::kWaitWrite;
      return true;
    }
    if (io != Io::kProgress) return false;
    c->sent += put;
    if (c->sent == c->response.size()) {
      if (c->ssl != nullptr) SSL_shutdown(c->ssl);  // close_notify, best effort
      ::shutdown(c->fd, SHUT_WR);
      c->phase = HttpConnection::Phase::kDraining;
    }
  }
  // Answered: what the client still sends is read and dropped until it closes (or the deadline), since closing
  // with unread bytes would reset the connection and could lose the response on its way.
  char buf[4096];
  while (true) {
    const ssize_t n = ::recv(c->fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;
  }
}

void HttpServer::State::ServeLoop() {
  // SSL_write writes with write(2): a client gone away must not raise SIGPIPE in the process.
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  std::vector<pollfd> polled;
  std::vector<uint64_t> polled_ids;
  while (!stopping) {
    polled.clear();
    polled_ids.clear();
    polled.push_back({wake_fds[0], POLLIN, 0});
    polled.push_back({listen_fd, POLLIN, 0});
    auto now = SteadyClock::now();
    auto next_deadline = now + std::chrono::hours(1);
    for (const auto& [id, c] : connections) {
      if (c->phase == HttpConnection::Phase::kHandling) continue;  // its handler's time does not count
      const bool writing = c->wait_write || (c->phase == HttpConnection::Phase::kWriting && c->ssl == nullptr);
      polled.push_back({c->fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
      polled_ids.push_back(id);
      next_deadline = std::min(next_deadline, c->deadline);
    }
    const int timeout_ms =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1);
    if (::poll(polled.data(), polled.size(), std::max(timeout_ms, 0)) < 0 && errno != EINTR) break;
    if (stopping) break;
    now = SteadyClock::now();
    if (polled[0].revents != 0) {
      char drain[256];
      while (::read(wake_fds[0], drain, sizeof(drain)) > 0) {
      }
      std::vector<std::pair<uint64_t, std::string>> answered;
      {
        absl::MutexLock lock(&mu);
        answered.swap(done);
      }
      for (auto& [id, response] : answered) {
        auto it = connections.find(id);
        if (it == connections.end()) continue;
        it->second->response = std::move(response);
        it->second->phase = HttpConnection::Phase::kWriting;
        it->second->deadline = now + std::chrono::milliseconds(options.connection_timeout_ms);
        if (!Progress(it->second.get())) connections.erase(it);
      }
    }
    for (size_t i = 0; i < polled_ids.size(); ++i) {
      auto it = connections.find(polled_ids[i]);
      if (it == connections.end()) continue;
      HttpConnection* c = it->second.get();
      bool open = now < c->deadline || c->phase == HttpConnection::Phase::kHandling;
      if (open && polled[i + 2].revents != 0) open = Progress(c);
      if (!open) connections.erase(it);
    }
    if (polled[1].revents & (POLLHUP | POLLERR | POLLNVAL)) break;
    if (polled[1].revents & POLLIN) AcceptAll();
  }
  connections.clear();
}

}  // namespace geotrain
