// The flags several verbs share (see flags.h).
#include "cli/flags.h"

#include "absl/strings/str_cat.h"

namespace geotrain::cli {

void AddHeadOption(CLI::App* cmd, std::string* head) {
  cmd->add_option("--head", *head, "head address HOST:PORT (default: GEOTRAIN_HEAD or this machine's head)");
}

void AddTokenOptions(CLI::App* cmd, std::string* token, std::string* token_file, const std::string& fallback) {
  CLI::Option* token_option =
      cmd->add_option("--token", *token, absl::StrCat("cluster token (default: ", fallback, ")"));
  cmd->add_option("--token-file", *token_file, "file holding the cluster token (default: GEOTRAIN_TOKEN_FILE)")
      ->excludes(token_option);
}

void AddHeadTokenOptions(CLI::App* cmd, std::string* token, std::string* token_file) {
  AddTokenOptions(cmd, token, token_file, "GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE or this machine's head");
}

void AddNodeTlsOptions(CLI::App* cmd, TlsFiles* tls, const std::string& role) {
  cmd->add_option("--tls-cert", tls->cert, absl::StrCat("this ", role, "'s certificate (PEM): enables TLS"));
  cmd->add_option("--tls-key", tls->key, absl::StrCat("this ", role, "'s private key (PEM)"));
  cmd->add_option("--tls-ca", tls->ca, "CA (PEM) that signed every node's certificate");
  cmd->add_flag("--tls-require-client-cert", tls->require_client_cert,
                "mutual TLS: refuse clients without a certificate the CA signed");
}

void AddClientTlsOptions(CLI::App* cmd, TlsFiles* tls) {
  cmd->add_option("--tls-ca", tls->ca, "CA certificate (PEM) to verify a TLS head (default: GEOTRAIN_TLS_CA)");
  cmd->add_option("--tls-cert", tls->cert, "client certificate (PEM) for mutual TLS (default: GEOTRAIN_TLS_CERT)");
  cmd->add_option("--tls-key", tls->key, "client private key (PEM) for mutual TLS (default: GEOTRAIN_TLS_KEY)");
}

void HeadFlags::Add(CLI::App* cmd) {
  AddHeadOption(cmd, &head);
  AddHeadTokenOptions(cmd, &token, &token_file);
  AddClientTlsOptions(cmd, &tls);
}

void AddJsonFlag(CLI::App* cmd, bool* json) { cmd->add_flag("--json", *json, "print JSON"); }

void AddTimedComputeFlag(CLI::App* cmd, bool* timed_compute) {
  cmd->add_flag("--timed-compute", *timed_compute,
                "run the emulated devices on timed compute: every op waits the device's time instead of computing "
                "(EMULATED step times, no real loss; docs/timed-compute.md)");
}

void AddDeviceProfilesOption(CLI::App* cmd, std::string* path) {
  cmd->add_option("--device-profiles", *path,
                  "measured figures (JSON lines, e.g. tests/gpu/run.sh's bench_gpu_step.json; docs/timed-compute.md) "
                  "that calibrate the emulated devices' achieved FLOP/s and bandwidth for timed compute");
}

void AddMetricsPortOption(CLI::App* cmd, int* port) {
  cmd->add_option("--metrics-port", *port, "Prometheus metrics port (0: any free, -1: off)")->capture_default_str();
}

void AddBindOption(CLI::App* cmd, std::string* host) {
  cmd->add_option("--bind", *host, "address to listen on")->capture_default_str();
}

}  // namespace geotrain::cli
