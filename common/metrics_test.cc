// The metrics server with real sockets on loopback: several clients at once, a silent client does not hold
// the others, the connection cap answers 503 and frees up, oversized and garbage requests are answered.
#include "common/metrics.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A connected client socket whose reads give up after 3 s (shorter than the server's 5 s connection timeout,
// so an answer that only came once a silent client timed out fails the test).
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

// Sends `request` on a new connection and reads the whole answer (until the server closes).
std::string Ask(int port, const std::string& request) {
  const int fd = Connect(port);
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return answer;
}

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.Start("127.0.0.1:0").ok());
    server_.Gauges("geotrain_test_gauge", "A gauge for the test").Add({}).Set(7);
  }
  MetricsServer server_;
};

TEST_F(MetricsServerTest, ServesTheRegistry) {
  const std::string answer = Ask(server_.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200 OK"));
  EXPECT_THAT(answer, HasSubstr("geotrain_test_gauge 7"));
  EXPECT_THAT(answer, HasSubstr("process_open_fds"));
}

TEST_F(MetricsServerTest, SilentClientsDoNotHoldOthers) {
  // Connections that never send a byte (or half a request line) stay open; scrapes go on meanwhile.
  std::vector<int> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(Connect(server_.port()));
  ASSERT_EQ(::send(silent[0], "GET /met", 8, MSG_NOSIGNAL), 8);
  for (int i = 0; i < 5; ++i) {
    EXPECT_THAT(Ask(server_.port(), "GET /metrics HTTP/1.0\r\n\r\n"), HasSubstr("geotrain_test_gauge 7"));
  }
  for (int fd : silent) ::close(fd);
}

TEST_F(MetricsServerTest, ConnectionCapAnswers503ThenFreesUp) {
  std::vector<int> held;
  for (int i = 0; i < kMetricsMaxConnections; ++i) held.push_back(Connect(server_.port()));
  // The server accepts asynchronously: once the cap is reached, a new connection is answered 503.
  std::string answer;
  for (int attempt = 0; attempt < 50 && !answer.starts_with("HTTP/1.1 503"); ++attempt) {
    answer = Ask(server_.port(), "GET /metrics HTTP/1.1\r\n\r\n");
  }
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 503"));
  for (int fd : held) ::close(fd);
  // Closed connections are noticed and their slots freed.
  for (int attempt = 0; attempt < 50 && !answer.starts_with("HTTP/1.1 200"); ++attempt) {
    answer = Ask(server_.port(), "GET /metrics HTTP/1.1\r\n\r\n");
    if (!answer.starts_with("HTTP/1.1 200")) ::usleep(20000);
  }
  EXPECT_THAT(answer, StartsWith("HTTP/1.1 200"));
}

TEST_F(MetricsServerTest, OversizedAndGarbageRequestsAreAnswered) {
  // A head without its blank line is read up to the bound, then answered by its request line.
  EXPECT_THAT(Ask(server_.port(), "GET /metrics " + std::string(3 * kMetricsMaxRequestBytes, 'a')),
              StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(Ask(server_.port(), std::string(100, '\0') + "\r\n\r\n"), StartsWith("HTTP/1.1 405"));
  EXPECT_THAT(Ask(server_.port(), "GET /other HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404"));
  // A client that closes before sending anything gets nothing, and the server goes on.
  ::close(Connect(server_.port()));
  EXPECT_THAT(Ask(server_.port(), "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 200"));
}

}  // namespace
}  // namespace geotrain
