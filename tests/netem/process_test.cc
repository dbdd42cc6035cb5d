// geotrain-netem started as a child process through process.h, as `geotrain cluster up` will:
// command line, ready file, stats over the control port, a relayed request, SIGTERM; and a child
// that fails to start (port in use) is reported with its cause.
#include "netem/process.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "netem/control_client.h"
#include "netem/socket_util.h"

extern char** environ;

namespace geotrain::netem {
namespace {

using ::testing::HasSubstr;

pid_t Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  EXPECT_EQ(posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ), 0);
  return pid;
}

TEST(ProcessTest, ParseReadyFile) {
  absl::StatusOr<ReadyInfo> info =
      ParseReadyFile("control_port 4000\nmetrics_port 4002\nroute 0=a>b@127.0.0.1:9000 127.0.0.1:4001\n");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->control_port, 4000);
  EXPECT_EQ(info->metrics_port, 4002);
  ASSERT_EQ(info->routes.size(), 1u);
  EXPECT_EQ(info->routes[0].bound_port, 4001);
  EXPECT_EQ(info->routes[0].spec.dst_site, "b");
  for (const char* bad : {"", "route 0=a>b@h:1 h:2\n", "control_port x\n", "control_port 1\nroute nonsense h:2\n",
                          "control_port 1\nextra\n"}) {
    EXPECT_FALSE(ParseReadyFile(bad).ok()) << bad;
  }
}

TEST(ProcessTest, ChildEmulatorRelaysAndStopsOnSigterm) {
  const std::string dir = ::testing::TempDir() + "/netem_process_test";
  std::filesystem::create_directories(dir);
  const std::string ready = dir + "/netem.ready";
  std::filesystem::remove(ready);
  int target_port = 0;
  const int target = ListenLoopback(0, &target_port);
  ASSERT_GE(target, 0);

  EmulatorProcessSpec spec;
  spec.binary = GEOTRAIN_NETEM_BINARY;
  spec.topology_path = std::string(GEOTRAIN_SOURCE_DIR) + "/deploy/topologies/two-sites-30ms.yaml";
  spec.routes = {RouteSpec{0, "site-a", "site-b", "127.0.0.1", target_port}};
  spec.ready_file = ready;
  spec.metrics_port = 0;
  const pid_t pid = Spawn(EmulatorCommandLine(spec));
  absl::StatusOr<ReadyInfo> info = WaitForReadyFile(ready, std::chrono::seconds(10), pid);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->routes.size(), 1u);

  const int client = ConnectLoopback(info->routes[0].bound_port);
  ASSERT_GE(client, 0);
  const int server = AcceptOne(target);
  ASSERT_GE(server, 0);
  const int64_t start = NowNanos();
  ASSERT_TRUE(WriteAll(client, "hello", 5));
  char got[5];
  ASSERT_TRUE(ReadExact(server, got, 5));
  EXPECT_GE((NowNanos() - start) / 1e6, 29.5);  // 30 ms one way, jitter +-0.5 ms

  // Prometheus metrics: the link's series are there from the start.
  ASSERT_GT(info->metrics_port, 0);
  const int metrics = ConnectLoopback(info->metrics_port);
  ASSERT_GE(metrics, 0);
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  ASSERT_TRUE(WriteAll(metrics, request.data(), request.size()));
  std::string page;
  char buffer[4096];
  while (WaitReadable(metrics, 2000)) {
    const ssize_t n = recv(metrics, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    page.append(buffer, static_cast<size_t>(n));
  }
  CloseFd(metrics);
  EXPECT_THAT(page, HasSubstr("geotrain_netem_latency_seconds{dst_site=\"site-b\",src_site=\"site-a\"} 0.03"));
  EXPECT_THAT(page, HasSubstr("geotrain_netem_bytes_total{dst_site=\"site-a\",src_site=\"site-b\"}"));

  absl::StatusOr<std::vector<LinkDirectionStats>> stats = QueryStats(info->control_port);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->size(), 2u);
  EXPECT_EQ((*stats)[0].src, "site-a");
  EXPECT_EQ((*stats)[0].bytes_in, 5);
  EXPECT_EQ((*stats)[0].connections_active, 1);

  // A second child on the same port fails, and the wait says so instead of timing out.
  EmulatorProcessSpec clash = spec;
  clash.routes[0].listen_port = info->routes[0].bound_port;
  clash.ready_file = dir + "/clash.ready";
  const pid_t clash_pid = Spawn(EmulatorCommandLine(clash));
  absl::StatusOr<ReadyInfo> clash_info = WaitForReadyFile(clash.ready_file, std::chrono::seconds(10), clash_pid);
  ASSERT_FALSE(clash_info.ok());
  EXPECT_THAT(std::string(clash_info.status().message()), HasSubstr("exited with status 1"));
  int status = 0;
  ASSERT_EQ(waitpid(clash_pid, &status, 0), clash_pid);

  ASSERT_EQ(kill(pid, SIGTERM), 0);
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  CloseFd(client);
  CloseFd(server);
  CloseFd(target);
}

}  // namespace
}  // namespace geotrain::netem
