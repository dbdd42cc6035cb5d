// The HTTP server with real sockets on loopback: request heads parse (and malformed ones do not), form parameters
// decode, bodies are read within their bound and refused beyond it, a slow handler does not hold the others, and a
// TLS server answers TLS clients and serves nothing to plaintext ones.
#include "common/http_server.h"

#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval timeout{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

// Sends `request` in plaintext on a new connection and reads the whole answer (until the server closes).
std::string Ask(int port, const std::string& request) {
  const int fd = Connect(port);
  (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string answer;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return answer;
}

// Echoes what the server read: method, path, the body's size, whether it was too large, and the `a` parameter.
std::string Echo(const HttpRequest& r, std::string_view raw_head) {
  if (r.method.empty()) return SerializeHttpResponse({.status = 400, .body = "malformed"});
  return SerializeHttpResponse(
      {.body = absl::StrCat(r.method, " ", r.path, " body=", r.body.size(), r.body_too_large ? " too-large" : "",
                            " a=", FormParameter(r.query, "a"), " head=", raw_head.size())});
}

TEST(HttpRequestTest, ParsesRequestLineAndHeaders) {
  absl::StatusOr<HttpRequest> r =
      ParseHttpRequestHead("POST /api/plan?x=1&y=2 HTTP/1.1\r\nHost: h:1\r\nContent-Length:  12 \r\n\r\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->method, "POST");
  EXPECT_EQ(r->path, "/api/plan");
  EXPECT_EQ(r->query, "x=1&y=2");
  EXPECT_EQ(r->Header("host"), "h:1");
  EXPECT_EQ(r->Header("content-length"), "12");
  EXPECT_EQ(r->Header("cookie"), "");
}

TEST(HttpRequestTest, RefusesMalformedHeads) {
  for (const char* head :
       {"", "GET", "get / HTTP/1.1", "GET nothing HTTP/1.1", "GET / HTTP/2", "GET /a b HTTP/1.1",
        "GET / HTTP/1.1\r\nno colon", "GET / HTTP/1.1\r\nContent-Length: -3", "GET /\x01 HTTP/1.1"}) {
    EXPECT_FALSE(ParseHttpRequestHead(head).ok()) << head;
  }
}

TEST(HttpRequestTest, FormParametersDecode) {
  EXPECT_EQ(FormParameter("token=ab%2Fc+d&x=1", "token"), "ab/c d");
  EXPECT_EQ(FormParameter("x=1&token=", "token"), "");
  EXPECT_EQ(FormParameter("tokens=1", "token"), "");
  EXPECT_EQ(FormParameter("token=%zz", "token"), "");
  EXPECT_EQ(FormParameter("token=%4", "token"), "");
}

TEST(HttpServerTest, ReadsBodiesWithinTheirBound) {
  HttpServer server;
  HttpServerOptions options;
  options.max_body_bytes = 100;
  ASSERT_TRUE(server.Start("127.0.0.1:0", options, Echo).ok());
  EXPECT_THAT(Ask(server.port(), "POST /p?a=x%20y HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"),
              HasSubstr("POST /p body=5 a=x y"));
  EXPECT_THAT(Ask(server.port(), "POST /p HTTP/1.1\r\nContent-Length: 101\r\n\r\n" + std::string(101, 'x')),
              HasSubstr("body=0 too-large"));
  EXPECT_THAT(Ask(server.port(), "BAD REQUEST\r\n\r\n"), StartsWith("HTTP/1.1 400"));
  // A head over the bound is handed over cut at the bound, and does not parse.
  EXPECT_THAT(Ask(server.port(), "GET /" + std::string(40000, 'a') + " HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 400"));
}

TEST(HttpServerTest, ASlowHandlerDoesNotHoldTheOthers) {
  absl::Notification release;
  HttpServer server;
  HttpServerOptions options;
  options.handler_threads = 2;
  ASSERT_TRUE(server
                  .Start("127.0.0.1:0", options,
                         [&release](const HttpRequest& r, std::string_view raw) {
                           if (r.path == "/slow") release.WaitForNotificationWithTimeout(absl::Seconds(10));
                           return Echo(r, raw);
                         })
                  .ok());
  std::thread slow([&] { EXPECT_THAT(Ask(server.port(), "GET /slow HTTP/1.1\r\n\r\n"), HasSubstr("GET /slow")); });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(Ask(server.port(), "GET /fast HTTP/1.1\r\n\r\n"), HasSubstr("GET /fast"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  release.Notify();
  slow.join();
}

// A self-signed certificate for 127.0.0.1 and its key, written as PEM files into `dir`.
void WriteSelfSignedCertificate(const std::string& dir) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  ASSERT_NE(key, nullptr);
  X509* cert = X509_new();
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), -60);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("127.0.0.1"), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  ASSERT_GT(X509_sign(cert, key, EVP_sha256()), 0);
  FILE* f = std::fopen((dir + "/cert.pem").c_str(), "w");
  PEM_write_X509(f, cert);
  std::fclose(f);
  f = std::fopen((dir + "/key.pem").c_str(), "w");
  PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  X509_free(cert);
  EVP_PKEY_free(key);
}

// Sends `request` over TLS (without verifying the server) and reads the whole answer.
std::string AskTls(int port, const std::string& request) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL* ssl = SSL_new(ctx);
  const int fd = Connect(port);
  SSL_set_fd(ssl, fd);
  std::string answer;
  if (SSL_connect(ssl) == 1) {
    SSL_write(ssl, request.data(), static_cast<int>(request.size()));
    char buf[4096];
    int n;
    while ((n = SSL_read(ssl, buf, sizeof(buf))) > 0) answer.append(buf, static_cast<size_t>(n));
  }
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  ::close(fd);
  return answer;
}

TEST(HttpServerTest, TlsServesTlsClientsAndNothingToPlaintextOnes) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("geotrain_https_", ::getpid())).string();
  std::filesystem::create_directories(dir);
  WriteSelfSignedCertificate(dir);
  HttpServer server;
  HttpServerOptions options;
  options.tls = {.cert = dir + "/cert.pem", .key = dir + "/key.pem"};
  ASSERT_TRUE(server.Start("127.0.0.1:0", options, Echo).ok());
  EXPECT_TRUE(server.tls());
  EXPECT_THAT(AskTls(server.port(), "GET /secure?a=1 HTTP/1.1\r\n\r\n"), HasSubstr("GET /secure body=0 a=1"));
  EXPECT_EQ(Ask(server.port(), "GET /secure HTTP/1.1\r\n\r\n"), "");

  HttpServer missing;
  options.tls.key = dir + "/absent.pem";
  absl::Status s = missing.Start("127.0.0.1:0", options, Echo);
  EXPECT_THAT(s.message(), HasSubstr("absent.pem"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace geotrain
