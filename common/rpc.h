// RPC plumbing shared by every geotrain service and client: the cluster token, TLS credentials,
// Status conversion, and where the CLI finds a head started on this machine.
//
//   Server side, first lines of every handler (common/rpc_call.h: times the call, checks the token):
//     RpcCall call(metrics, auth, context, "Method");
//     if (!call.authorized()) return call.status();
//   Client side:
//     grpc::ClientContext ctx; AttachToken(&ctx, token); SetDeadline(&ctx, 5000);
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/files.h"  // WriteFileAtomically
#include "common/token.h"  // kTokenMetadataKey, TokenMatches

namespace geotrain {

// Checks the token of incoming calls (TokenMatches). Thread-safe (immutable after construction).
class TokenAuth {
 public:
  explicit TokenAuth(std::string token) : token_(std::move(token)) {}
  // OK when the call carries the cluster token; UNAUTHENTICATED (and a log line naming the peer and
  // the method) otherwise. The comparison takes the same time wherever the strings differ.
  grpc::Status Check(grpc::ServerContext* context) const;
  grpc::Status Check(grpc::CallbackServerContext* context) const;
  const std::string& token() const { return token_; }

 private:
  grpc::Status CheckMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                             const std::string& peer) const;
  std::string token_;
};

void AttachToken(grpc::ClientContext* context, const std::string& token);
void SetDeadlineMillis(grpc::ClientContext* context, int64_t millis);

// A fresh random token (32 hex characters from the OS's random source).
std::string GenerateToken();
// A fresh random id with a prefix ("h-3f2a91c0").
std::string GenerateId(const std::string& prefix);

// One TLS configuration for every connection of a cluster: CLI -> head, head -> worker, worker -> head and the
// tensor streams and staging fetches between workers. With all files empty, connections are plaintext.
// A node (head or worker) serves and dials, so it needs all three files (ValidateNodeTls); the CLI needs the CA,
// and with mutual TLS a certificate and key of its own. deploy/make-certs.sh makes them.
struct TlsFiles {
  std::string cert;  // PEM certificate of this process: served by a server, presented by a client (mutual TLS)
  std::string key;   // PEM private key of `cert`
  std::string ca;    // PEM CA that signed the peers' certificates (the server's; with mutual TLS, the clients')
  // Mutual TLS: servers refuse clients without a certificate signed by `ca`.
  bool require_client_cert = false;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
// A server's credentials: plaintext when TLS is off; with require_client_cert, clients must present a
// certificate that `ca` signed. Errors name the file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& tls);
// A client's credentials: verifies the server against `ca`, and presents cert/key when both are given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& tls);
// A head or worker both serves and dials: with TLS on, it needs a certificate, its key and the CA. An error names
// the missing flag (`role` is "head" or "worker") and how to make the files.
absl::Status ValidateNodeTls(const TlsFiles& tls, const std::string& role);
// TLS settings for the CLI: the flags, else GEOTRAIN_TLS_CA / GEOTRAIN_TLS_CERT / GEOTRAIN_TLS_KEY, else the
// files recorded by a head on this machine (or by `cluster up --tls`).
TlsFiles TlsFromFlagsOrEnvironment(const TlsFiles& flags);
// A channel to `address` with keepalive settings suited to long-lived control streams.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address, const TlsFiles& tls);

// How long one connection attempt (TCP connect, TLS handshake, HTTP/2 SETTINGS) may take. gRPC takes it from
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS (doc/connection-backoff.md: an attempt gets max(backoff, this)), so a small
// "min backoff" also cuts every handshake short: at 200 ms a TLS connection across a 100 ms link, or to a loaded
// head under ASan, timed out before its SETTINGS frame, and a fail-fast call then failed at once.
inline constexpr int kMinConnectTimeoutMs = 5000;
// Reconnects quickly after a peer restarts or a link comes back (gRPC's default backoff grows to two minutes):
// the first retry after initial_backoff_ms, later ones at most max_backoff_ms apart, and each attempt allowed
// kMinConnectTimeoutMs. A refused or reset connection fails at once, so this bounds only silent peers.
void SetReconnectBackoff(grpc::ChannelArguments* args, int initial_backoff_ms, int max_backoff_ms);

// The one conversion between gRPC and absl statuses (their codes are the same numbers). FromGrpc prefixes
// the message with `context` when one is given ("context: message").
absl::Status FromGrpc(const grpc::Status& status, absl::string_view context = {});
// For a connection that failed because one side speaks TLS and the other plaintext (or a client certificate is
// missing): "; <what to change>", else "". FromGrpc appends it to UNAVAILABLE errors.
std::string TlsMismatchHint(absl::string_view error_message);
grpc::Status ToGrpc(const absl::Status& status);

// Reads a whole file (for PEM files and token files).
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);

// Where a head started on this machine records itself, like `ray start --head`:
// $GEOTRAIN_HOME (default ~/.geotrain)/current_cluster.json holds {"address", "token_file", ...}.
std::string GeotrainHome();
struct ClusterRecord {
  std::string address;     // host:port of the head's gRPC service
  std::string token_file;  // mode 0600 file with the token
  std::string metrics_address;
  std::string state_dir;
  int64_t pid = 0;
  TlsFiles tls;  // what the local CLI uses to reach the head (its CA; with mutual TLS, a certificate and key)
};
absl::Status WriteClusterRecord(const ClusterRecord& record);
absl::StatusOr<ClusterRecord> ReadClusterRecord();
void RemoveClusterRecordIfOwned(int64_t pid);

// Reads a cluster token from a file (the head's <state-dir>/token, or one an operator installed, mode 0600):
// its contents without surrounding whitespace. An unreadable or empty file is an error naming the file.
// Token files keep the token off command lines, where `ps` and shell histories would show it.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The token a process was given: --token, else --token-file, else $GEOTRAIN_TOKEN, else the file named
// by $GEOTRAIN_TOKEN_FILE; "" when none is set. A named file that cannot be read is an error.
absl::StatusOr<std::string> TokenFromFlagsOrEnvironment(const std::string& token_flag,
                                                        const std::string& token_file_flag);

// Resolves the head's address and the token for a CLI call: flags first, then GEOTRAIN_HEAD and
// GEOTRAIN_TOKEN (or GEOTRAIN_TOKEN_FILE), then the cluster record. Errors say which flag or variable to set.
struct HeadEndpoint {
  std::string address;
  std::string token;
};
absl::StatusOr<HeadEndpoint> ResolveHead(const std::string& head_flag, const std::string& token_flag);

}  // namespace geotrain
