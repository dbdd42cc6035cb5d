// What every verb shares (see support.h).
#include "cli/support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace geotrain::cli {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "geotrain: %s\n", std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kUnauthenticated ? 3 : 1;
}

grpc::ClientContext* HeadClient::Prepare(grpc::ClientContext* ctx, int64_t deadline_ms) const {
  AttachToken(ctx, endpoint.token);
  if (deadline_ms > 0) SetDeadlineMillis(ctx, deadline_ms);
  return ctx;
}

absl::StatusOr<HeadClient> ConnectToHead(const std::string& head, const std::string& token, const TlsFiles& tls) {
  ASSIGN_OR_RETURN(HeadEndpoint endpoint, ResolveHead(head, token));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(endpoint.address, tls));
  return HeadClient{v1::Jobs::NewStub(channel), v1::Cluster::NewStub(channel), v1::Planner::NewStub(channel),
                    std::move(endpoint)};
}

absl::Status ExplainRpcFailure(const grpc::Status& status, const std::string& address) {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return absl::UnavailableError(
          absl::StrCat("cannot reach the head at ", address, " (", status.error_message(),
                       "); is it running? start it with `geotrain head start`, or pass --head HOST:PORT",
                       TlsMismatchHint(status.error_message())));
    case grpc::StatusCode::UNAUTHENTICATED:
      return absl::UnauthenticatedError(
          absl::StrCat("the head at ", address, " refused the call: ", status.error_message()));
    default:
      return FromGrpc(status);
  }
}

std::optional<HeadClient> ConnectOrFail(const HeadFlags& flags, Context& context) {
  absl::StatusOr<std::string> token = TokenFromFlagsOrEnvironment(flags.token, flags.token_file);
  absl::StatusOr<HeadClient> client =
      token.ok() ? ConnectToHead(flags.head, *token, TlsFromFlagsOrEnvironment(flags.tls)) : token.status();
  if (!client.ok()) {
    context.exit_code = Fail(client.status());
    return std::nullopt;
  }
  return *std::move(client);
}

bool RpcSucceeded(const grpc::Status& status, const HeadClient& client, Context& context) {
  if (status.ok()) return true;
  context.exit_code = Fail(ExplainRpcFailure(status, client.endpoint.address));
  return false;
}

std::vector<std::string> TopologyWorkerDevices(const TopologyWorker& worker) {
  std::vector<std::string> devices;
  for (int d = 0; d < std::max(1, worker.count()); ++d) {
    devices.push_back(
        absl::StrCat(worker.device().empty() ? "GPU" : worker.device(), ":", worker.tflops(), ":", worker.mem_gb()));
  }
  return devices;
}

}  // namespace geotrain::cli
