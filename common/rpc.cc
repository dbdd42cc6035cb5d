// Token checks, TLS credentials, status conversion and the cluster record.
#include "common/rpc.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "yaml-cpp/yaml.h"

namespace geotrain {
namespace {

std::string RandomHex(int bytes) {
  std::string raw(bytes, '\0');
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  if (!urandom.read(raw.data(), bytes)) {
    std::random_device rd;
    for (char& c : raw) c = static_cast<char>(rd());
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

}  // namespace

bool TokenMatches(std::string_view presented, std::string_view expected) {
  if (expected.empty()) return false;  // a server without a token accepts nobody
  // Length is not secret; content is. The loop runs over the expected token whatever is presented.
  unsigned diff = presented.size() == expected.size() ? 0u : 1u;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff |= p ^ static_cast<unsigned char>(expected[i]);
  }
  return diff == 0;
}

grpc::Status TokenAuth::CheckMetadata(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                      const std::string& peer) const {
  auto it = metadata.find(kTokenMetadataKey);
  if (it == metadata.end()) {
    GT_LOG(WARNING) << "refused a call from " << peer << ": no cluster token";
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "no cluster token; pass --token or set GEOTRAIN_TOKEN (the head's token file "
                        "is <state-dir>/token)");
  }
  if (!TokenMatches(std::string_view(it->second.data(), it->second.size()), token_)) {
    GT_LOG(WARNING) << "refused a call from " << peer << ": wrong cluster token";
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "wrong cluster token; use the token in the head's <state-dir>/token file");
  }
  return grpc::Status::OK;
}

grpc::Status TokenAuth::Check(grpc::ServerContext* context) const {
  return CheckMetadata(context->client_metadata(), context->peer());
}
grpc::Status TokenAuth::Check(grpc::CallbackServerContext* context) const {
  return CheckMetadata(context->client_metadata(), context->peer());
}

void AttachToken(grpc::ClientContext* context, const std::string& token) {
  context->AddMetadata(kTokenMetadataKey, token);
}

void SetDeadlineMillis(grpc::ClientContext* context, int64_t millis) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(millis));
}

std::string GenerateToken() { return RandomHex(16); }
std::string GenerateId(const std::string& prefix) { return absl::StrCat(prefix, "-", RandomHex(4)); }

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "': ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert.empty() || tls.key.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  ASSIGN_OR_RETURN(auto cert, ReadSmallFile(tls.cert));
  ASSIGN_OR_RETURN(auto key, ReadSmallFile(tls.key));
  if (tls.require_client_cert && tls.ca.empty()) {
    return absl::InvalidArgumentError("mutual TLS needs --tls-ca: the CA that signed the clients' certificates");
  }
  grpc::SslServerCredentialsOptions options(tls.require_client_cert
                                                ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!tls.ca.empty()) {
    ASSIGN_OR_RETURN(auto ca, ReadSmallFile(tls.ca));
    options.pem_root_certs = ca;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  if (!tls.ca.empty()) {
    ASSIGN_OR_RETURN(auto ca, ReadSmallFile(tls.ca));
    options.pem_root_certs = ca;
  }
  if (!tls.cert.empty() && !tls.key.empty()) {
    ASSIGN_OR_RETURN(auto cert, ReadSmallFile(tls.cert));
    ASSIGN_OR_RETURN(auto key, ReadSmallFile(tls.key));
    options.pem_cert_chain = cert;
    options.pem_private_key = key;
  }
  return grpc::SslCredentials(options);
}

absl::Status ValidateNodeTls(const TlsFiles& tls, const std::string& role) {
  if (!tls.enabled()) {
    if (tls.require_client_cert) {
      return absl::InvalidArgumentError(absl::StrCat(
          role, ": mutual TLS needs --tls-cert, --tls-key and --tls-ca (deploy/make-certs.sh makes them)"));
    }
    return absl::OkStatus();
  }
  std::vector<std::string> missing;
  if (tls.cert.empty()) missing.push_back("--tls-cert");
  if (tls.key.empty()) missing.push_back("--tls-key");
  if (tls.ca.empty()) missing.push_back("--tls-ca");
  if (missing.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(role, ": TLS needs ", absl::StrJoin(missing, " and "), " too: a ", role,
                   " both serves (its certificate and key) and dials the other nodes (the CA that signed theirs); "
                   "`deploy/make-certs.sh DIR --node NAME=ADDRESS,...` makes a CA and a certificate per node"));
}

TlsFiles TlsFromFlagsOrEnvironment(const TlsFiles& flags) {
  if (flags.enabled()) return flags;
  TlsFiles tls = flags;
  auto env = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value != nullptr ? value : "");
  };
  tls.ca = env("GEOTRAIN_TLS_CA");
  tls.cert = env("GEOTRAIN_TLS_CERT");
  tls.key = env("GEOTRAIN_TLS_KEY");
  if (tls.enabled()) return tls;
  if (auto record = ReadClusterRecord(); record.ok() && record->tls.enabled()) return record->tls;
  return flags;
}

void SetReconnectBackoff(grpc::ChannelArguments* args, int initial_backoff_ms, int max_backoff_ms) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, initial_backoff_ms);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address, const TlsFiles& tls) {
  ASSIGN_OR_RETURN(auto creds, MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  SetReconnectBackoff(&args, /*initial_backoff_ms=*/200, /*max_backoff_ms=*/2000);
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(address, creds, args);
}

std::string TlsMismatchHint(absl::string_view error_message) {
  const std::string lower = absl::AsciiStrToLower(error_message);
  if (absl::StrContains(lower, "wrong version number") || absl::StrContains(lower, "wrong_version_number") ||
      absl::StrContains(lower, "http_request")) {
    return "; the peer speaks plaintext and this side TLS: give every node of the cluster the same TLS flags "
           "(--tls-cert, --tls-key, --tls-ca), or none";
  }
  if (absl::StrContains(lower, "socket closed") || absl::StrContains(lower, "connection reset")) {
    return "; if the peer serves TLS, this side needs it too: --tls-ca (or GEOTRAIN_TLS_CA), and with mutual TLS "
           "--tls-cert and --tls-key";
  }
  if (absl::StrContains(lower, "certificate") && absl::StrContains(lower, "required")) {
    return "; the peer requires a client certificate (mutual TLS): pass --tls-cert and --tls-key";
  }
  return "";
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) message += TlsMismatchHint(message);
  const absl::Status converted(static_cast<absl::StatusCode>(status.error_code()), message);
  return context.empty() ? converted : WithContext(converted, context);
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::string GeotrainHome() {
  if (const char* home = std::getenv("GEOTRAIN_HOME"); home != nullptr && *home) return home;
  const char* user_home = std::getenv("HOME");
  return absl::StrCat(user_home ? user_home : "/tmp", "/.geotrain");
}

absl::Status WriteClusterRecord(const ClusterRecord& record) {
  const std::string dir = GeotrainHome();
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create '", dir, "': ", std::strerror(errno),
                                                    "; set GEOTRAIN_HOME to a writable directory"));
  }
  YAML::Emitter out;
  out << YAML::DoubleQuoted << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "address" << YAML::Value << record.address;
  out << YAML::Key << "token_file" << YAML::Value << record.token_file;
  out << YAML::Key << "metrics_address" << YAML::Value << record.metrics_address;
  out << YAML::Key << "state_dir" << YAML::Value << record.state_dir;
  out << YAML::Key << "pid" << YAML::Value << std::to_string(record.pid);
  out << YAML::Key << "tls_ca" << YAML::Value << record.tls.ca;
  out << YAML::Key << "tls_cert" << YAML::Value << record.tls.cert;
  out << YAML::Key << "tls_key" << YAML::Value << record.tls.key;
  out << YAML::EndMap;
  return WriteFileAtomically(absl::StrCat(dir, "/current_cluster.json"), std::string(out.c_str()) + "\n", 0600);
}

absl::StatusOr<ClusterRecord> ReadClusterRecord() {
  const std::string path = absl::StrCat(GeotrainHome(), "/current_cluster.json");
  ASSIGN_OR_RETURN(auto text, ReadSmallFile(path));
  try {
    YAML::Node node = YAML::Load(text);
    ClusterRecord r;
    r.address = node["address"].as<std::string>("");
    r.token_file = node["token_file"].as<std::string>("");
    r.metrics_address = node["metrics_address"].as<std::string>("");
    r.state_dir = node["state_dir"].as<std::string>("");
    r.pid = std::atoll(node["pid"].as<std::string>("0").c_str());
    r.tls.ca = node["tls_ca"].as<std::string>("");
    r.tls.cert = node["tls_cert"].as<std::string>("");
    r.tls.key = node["tls_key"].as<std::string>("");
    if (r.address.empty()) return absl::DataLossError(absl::StrCat(path, ": no address"));
    return r;
  } catch (const YAML::Exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": ", e.what()));
  }
}

void RemoveClusterRecordIfOwned(int64_t pid) {
  auto record = ReadClusterRecord();
  if (record.ok() && record->pid == pid) {
    ::unlink(absl::StrCat(GeotrainHome(), "/current_cluster.json").c_str());
  }
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("token file: ", text.status().message(),
                                     "; copy the head's <state-dir>/token there (mode 0600), or fix the path"));
  }
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file '", path, "' is empty; copy the head's <state-dir>/token there"));
  }
  return token;
}

absl::StatusOr<std::string> TokenFromFlagsOrEnvironment(const std::string& token_flag,
                                                        const std::string& token_file_flag) {
  if (!token_flag.empty()) return token_flag;
  if (!token_file_flag.empty()) return ReadTokenFile(token_file_flag);
  if (const char* env = std::getenv("GEOTRAIN_TOKEN"); env != nullptr && *env) return std::string(env);
  if (const char* env = std::getenv("GEOTRAIN_TOKEN_FILE"); env != nullptr && *env) {
    absl::StatusOr<std::string> token = ReadTokenFile(env);
    if (!token.ok()) return WithContext(token.status(), "GEOTRAIN_TOKEN_FILE");
    return token;
  }
  return std::string();
}

absl::StatusOr<HeadEndpoint> ResolveHead(const std::string& head_flag, const std::string& token_flag) {
  HeadEndpoint endpoint;
  endpoint.address = head_flag;
  ASSIGN_OR_RETURN(endpoint.token, TokenFromFlagsOrEnvironment(token_flag, ""));
  if (endpoint.address.empty()) {
    if (const char* env = std::getenv("GEOTRAIN_HEAD"); env != nullptr) endpoint.address = env;
  }
  if (endpoint.address.empty() || endpoint.token.empty()) {
    auto record = ReadClusterRecord();
    if (record.ok()) {
      if (endpoint.address.empty()) endpoint.address = record->address;
      if (endpoint.token.empty()) {
        if (auto token = ReadTokenFile(record->token_file); token.ok()) endpoint.token = *token;
      }
    }
  }
  if (endpoint.address.empty()) {
    return absl::NotFoundError(
        "no head to talk to: pass --head HOST:PORT or set GEOTRAIN_HEAD (no head was started on this "
        "machine; start one with `geotrain head start`)");
  }
  if (endpoint.token.empty()) {
    return absl::UnauthenticatedError(
        "no cluster token: pass --token-file FILE or set GEOTRAIN_TOKEN_FILE (a copy of the head's "
        "<state-dir>/token, mode 0600), or pass --token / set GEOTRAIN_TOKEN");
  }
  return endpoint;
}

}  // namespace geotrain
