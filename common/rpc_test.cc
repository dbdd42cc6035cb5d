// Token resolution order, the cluster record, atomic writes with their mode, the token check, the status
// conversion and how long a channel's connection attempt may take.
#include "common/rpc.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/server_posix.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

using ::testing::HasSubstr;

class RpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("geotrain_rpc_test_" + GenerateToken());
    std::filesystem::create_directories(dir_);
    setenv("GEOTRAIN_HOME", dir_.c_str(), 1);
    unsetenv("GEOTRAIN_HEAD");
    unsetenv("GEOTRAIN_TOKEN");
    unsetenv("GEOTRAIN_TOKEN_FILE");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(RpcTest, AtomicWriteSetsMode) {
  const std::string path = (dir_ / "token").string();
  ASSERT_TRUE(WriteFileAtomically(path, "secret\n", 0600).ok());
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(*ReadSmallFile(path), "secret\n");
}

TEST_F(RpcTest, ResolveHeadOrder) {
  absl::StatusOr<HeadEndpoint> e = ResolveHead("", "");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(e.status().message(), HasSubstr("--head"));

  const std::string token_file = (dir_ / "token").string();
  ASSERT_TRUE(WriteFileAtomically(token_file, "from-file\n", 0600).ok());
  ClusterRecord record;
  record.address = "127.0.0.1:7000";
  record.token_file = token_file;
  record.pid = 42;
  ASSERT_TRUE(WriteClusterRecord(record).ok());
  e = ResolveHead("", "");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->address, "127.0.0.1:7000");
  EXPECT_EQ(e->token, "from-file");

  setenv("GEOTRAIN_HEAD", "10.0.0.1:1", 1);
  setenv("GEOTRAIN_TOKEN", "from-env", 1);
  e = ResolveHead("", "");
  EXPECT_EQ(e->address, "10.0.0.1:1");
  EXPECT_EQ(e->token, "from-env");
  e = ResolveHead("h:2", "from-flag");
  EXPECT_EQ(e->address, "h:2");
  EXPECT_EQ(e->token, "from-flag");

  RemoveClusterRecordIfOwned(41);
  EXPECT_TRUE(ReadClusterRecord().ok());
  RemoveClusterRecordIfOwned(42);
  EXPECT_FALSE(ReadClusterRecord().ok());
}

TEST_F(RpcTest, TokenFromFlagsOrEnvironmentOrder) {
  const std::string flag_file = (dir_ / "flag-token").string();
  const std::string env_file = (dir_ / "env-token").string();
  ASSERT_TRUE(WriteFileAtomically(flag_file, "  from-flag-file \n", 0600).ok());
  ASSERT_TRUE(WriteFileAtomically(env_file, "from-env-file\n", 0600).ok());
  EXPECT_EQ(*TokenFromFlagsOrEnvironment("", ""), "");
  setenv("GEOTRAIN_TOKEN_FILE", env_file.c_str(), 1);
  EXPECT_EQ(*TokenFromFlagsOrEnvironment("", ""), "from-env-file");
  setenv("GEOTRAIN_TOKEN", "from-env", 1);
  EXPECT_EQ(*TokenFromFlagsOrEnvironment("", ""), "from-env");
  EXPECT_EQ(*TokenFromFlagsOrEnvironment("", flag_file), "from-flag-file");
  EXPECT_EQ(*TokenFromFlagsOrEnvironment("from-flag", flag_file), "from-flag");
  // ResolveHead reads GEOTRAIN_TOKEN_FILE too, so every CLI verb takes the token from a file.
  unsetenv("GEOTRAIN_TOKEN");
  absl::StatusOr<HeadEndpoint> e = ResolveHead("h:1", "");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->token, "from-env-file");
}

TEST_F(RpcTest, UnreadableOrEmptyTokenFileIsAnError) {
  const std::string missing = (dir_ / "missing").string();
  absl::StatusOr<std::string> token = TokenFromFlagsOrEnvironment("", missing);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(token.status().message(), HasSubstr(missing));
  EXPECT_THAT(token.status().message(), HasSubstr("<state-dir>/token"));

  const std::string empty = (dir_ / "empty").string();
  ASSERT_TRUE(WriteFileAtomically(empty, "\n", 0600).ok());
  EXPECT_EQ(ReadTokenFile(empty).status().code(), absl::StatusCode::kInvalidArgument);

  // A GEOTRAIN_TOKEN_FILE that cannot be read fails loudly rather than falling back to another token.
  setenv("GEOTRAIN_TOKEN_FILE", missing.c_str(), 1);
  absl::StatusOr<HeadEndpoint> e = ResolveHead("h:1", "");
  EXPECT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("GEOTRAIN_TOKEN_FILE"));
}

TEST_F(RpcTest, TokensAndIdsAreFresh) {
  EXPECT_EQ(GenerateToken().size(), 32u);
  EXPECT_NE(GenerateToken(), GenerateToken());
  EXPECT_THAT(GenerateId("w"), ::testing::StartsWith("w-"));
}

TEST_F(RpcTest, TlsNeedsCertAndKey) {
  TlsFiles tls;
  tls.cert = "/nonexistent.pem";
  EXPECT_FALSE(MakeServerCredentials(tls).ok());
  EXPECT_TRUE(MakeServerCredentials(TlsFiles{}).ok());
}

// A peer that answers the HTTP/2 handshake late (a TLS handshake across a 100 ms link, a head loaded under ASan) is
// connected on the first attempt: the channel never passes through TRANSIENT_FAILURE, where a fail-fast call fails at
// once. The peer here is a listening socket accepted only after kLate, then handed to a real gRPC server. With the
// minimum connect timeout at 200 ms, as it was, the attempt was cut after 200 ms.
TEST(ChannelTest, LateHandshakeConnectsOnTheFirstAttempt) {
  constexpr auto kLate = std::chrono::milliseconds(1500);
  static_assert(kLate < std::chrono::milliseconds(kMinConnectTimeoutMs));
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  const std::unique_ptr<const int, void (*)(const int*)> close_listener(&listener, [](const int* fd) { ::close(*fd); });
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)), TlsFiles{});
  ASSERT_TRUE(channel.ok()) << channel.status();

  // The kernel completes the TCP handshake; the client's HTTP/2 preface waits unanswered until the accept.
  bool saw_failure = false;
  const auto answer_at = std::chrono::system_clock::now() + kLate;
  grpc_connectivity_state state = (*channel)->GetState(/*try_to_connect=*/true);
  while (std::chrono::system_clock::now() < answer_at) {
    saw_failure |= state == GRPC_CHANNEL_TRANSIENT_FAILURE;
    (*channel)->WaitForStateChange(state, answer_at);
    state = (*channel)->GetState(false);
  }
  saw_failure |= state == GRPC_CHANNEL_TRANSIENT_FAILURE;
  EXPECT_FALSE(saw_failure) << "the connection attempt was given up before the peer answered";
  EXPECT_EQ(state, GRPC_CHANNEL_CONNECTING);

  grpc::CallbackGenericService service;  // answers UNIMPLEMENTED; the handshake is what counts
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const int fd = ::accept(listener, nullptr, nullptr);
  ASSERT_GE(fd, 0);
  grpc::AddInsecureChannelFromFd(server.get(), fd);
  EXPECT_TRUE((*channel)->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5)));
  server->Shutdown();
}

// The one token check (TokenAuth and the tensor streams): equal and non-empty, nothing else.
TEST(TokenMatchesTest, OnlyTheSameNonEmptyTokenMatches) {
  EXPECT_TRUE(TokenMatches("abc", "abc"));
  EXPECT_FALSE(TokenMatches("abd", "abc"));
  EXPECT_FALSE(TokenMatches("abcd", "abc"));
  EXPECT_FALSE(TokenMatches("ab", "abc"));
  EXPECT_FALSE(TokenMatches("", "abc"));  // a call without a token
  EXPECT_FALSE(TokenMatches("", ""));     // a server without a token accepts nobody, not even an empty token
  EXPECT_FALSE(TokenMatches("abc", ""));
}

TEST(StatusConversionTest, CodesAndMessagesSurviveBothWays) {
  const absl::Status status = absl::NotFoundError("no such job");
  const grpc::Status converted = ToGrpc(status);
  EXPECT_EQ(converted.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(FromGrpc(converted), status);
  EXPECT_EQ(FromGrpc(converted, "fetch"), absl::NotFoundError("fetch: no such job"));
  EXPECT_TRUE(ToGrpc(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpc(grpc::Status::OK, "fetch").ok());
}

}  // namespace
}  // namespace geotrain
