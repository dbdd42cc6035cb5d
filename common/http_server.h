// geotrain's own small HTTP/1.1 server: the metrics scrape (common/metrics.h) and the head's web dashboard
// (head/dashboard.h) are served by it. One thread serves every connection with non-blocking sockets and poll, so a
// slow or silent client holds only its own connection; handlers run on a small pool of threads, so a slow handler
// (a plan) never stalls the others' reads and writes. One request per connection (every answer says Connection:
// close). Optional TLS (OpenSSL), in which case a client that does not complete a TLS handshake is served nothing.
//
//   HttpServer server;
//   HttpServerOptions options;  options.max_body_bytes = 1 << 20;
//   absl::Status s = server.Start("127.0.0.1:0", options, [](const HttpRequest& r) {
//     return SerializeHttpResponse(HttpResponse{.status = 200, .body = "hello"});
//   });
//   server.port();  // the port it bound
//
// Limits (HttpServerOptions): at most max_connections open connections (one more is answered 503 and closed);
// each is closed connection_timeout_ms after it was accepted while it reads or writes (its handler's time does
// not count); a request head is read up to max_head_bytes and then handed over as it is; a body is read only when
// max_body_bytes > 0 and the head's Content-Length is within it (beyond it the handler gets body_too_large).
//
// Threads: Start and the destructor from one thread; the handler is called on the pool's threads, several at once.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain {

// One request as the server read it.
struct HttpRequest {
  std::string method;                                        // "GET", "POST", ...
  std::string target;                                        // as sent: "/job?id=job-000001"
  std::string path;                                          // the target before '?'
  std::string query;                                         // the target after '?' ("" when none)
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case, values trimmed
  std::string body;
  bool body_too_large = false;  // Content-Length was over the server's max_body_bytes: the body was not read
  std::string peer;             // the client's address, for logs
  bool tls = false;             // it came over TLS

  // The first value of header `name` (lower case), or "".
  std::string Header(std::string_view name) const;
};

// Parses a request head (request line and header lines up to the blank line, which may be missing when the head
// was cut short): INVALID_ARGUMENT naming what is malformed. Only what the server relies on is checked: a method of
// capital letters, a target that starts with '/', HTTP/1.x, "Name: value" lines, a numeric Content-Length. Pure.
absl::StatusOr<HttpRequest> ParseHttpRequestHead(std::string_view head);

// The value of parameter `name` in a query string or an application/x-www-form-urlencoded body ("a=1&b=x%20y"),
// decoded ('+' is a space, %XX a byte); "" when absent or malformed.
std::string FormParameter(std::string_view query, std::string_view name);

// An answer; SerializeHttpResponse adds Content-Type, Content-Length and Connection: close.
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
};
std::string SerializeHttpResponse(const HttpResponse& response);
// "OK", "Not Found", ... for the codes geotrain answers ("Unknown" otherwise).
std::string_view HttpReasonPhrase(int status);

// The whole answer to one request (the bytes written back). A request whose head does not parse reaches the
// handler with an empty method and `raw_head` set, so that a server can answer garbage as it sees fit.
using HttpHandler = std::function<std::string(const HttpRequest& request, std::string_view raw_head)>;

struct HttpServerTls {
  std::string cert;  // PEM certificate chain served to clients
  std::string key;   // its private key
  std::string ca;    // with require_client_cert: the CA that signed the clients' certificates
  bool require_client_cert = false;
  bool enabled() const { return !cert.empty() || !key.empty(); }
};

struct HttpServerOptions {
  int max_connections = 64;
  size_t max_head_bytes = 16 * 1024;
  int connection_timeout_ms = 5000;
  size_t max_body_bytes = 0;  // 0: bodies are never read
  int handler_threads = 2;
  HttpServerTls tls;  // TLS when cert and key are set
};

class HttpServer {
 public:
  HttpServer();
  ~HttpServer();  // stops serving; waits for running handlers
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds `bind_address` (host:port; port 0 picks a free one) and starts serving. Errors name the address and the
  // cause (a port in use, an unreadable certificate or key).
  absl::Status Start(const std::string& bind_address, const HttpServerOptions& options, HttpHandler handler);
  int port() const { return port_; }
  bool tls() const;

 private:
  struct State;  // the serving thread's connections, the pool and its queues, the TLS context
  std::unique_ptr<State> state_;
  int port_ = 0;
};

}  // namespace geotrain
