// Flags that more than one `geotrain` verb takes, each declared here once with one help text, so that the
// same flag means the same thing, and reads the same in --help, on every verb:
//
//   auto flags = std::make_shared<HeadFlags>();
//   flags->Add(cmd);                      // --head, --token/--token-file, the client's TLS files
//   AddJsonFlag(cmd, json.get());
//
// Each function adds its options to `cmd` and binds them to the given variables, which must outlive the
// parse (a verb keeps them in a shared_ptr its callback holds). Not thread-safe: called while the CLI is built.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "common/rpc.h"

namespace geotrain::cli {

// --head HOST:PORT: the head a worker joins or the CLI calls (default: GEOTRAIN_HEAD or this machine's head).
void AddHeadOption(CLI::App* cmd, std::string* head);

// --token and --token-file, one or the other: a file keeps the token out of `ps` and shell histories.
// `fallback` says where the token comes from when neither is given.
void AddTokenOptions(CLI::App* cmd, std::string* token, std::string* token_file, const std::string& fallback);

// --token and --token-file of a process that calls the head (a worker, the CLI): their fallback is
// GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE, then the token of this machine's head (common/rpc.h ResolveHead).
void AddHeadTokenOptions(CLI::App* cmd, std::string* token, std::string* token_file);

// A node's TLS flags (`role`: head or worker): its certificate and key (served, and presented as a client with
// mutual TLS), the CA of the others, and whether its server requires client certificates.
void AddNodeTlsOptions(CLI::App* cmd, TlsFiles* tls, const std::string& role);

// The CLI's TLS flags as a client of the head: --tls-ca, --tls-cert, --tls-key (defaults: GEOTRAIN_TLS_*).
void AddClientTlsOptions(CLI::App* cmd, TlsFiles* tls);

// How a verb reaches the head: --head, --token/--token-file and the client's TLS flags (support.h ConnectOrFail).
struct HeadFlags {
  std::string head;
  std::string token;
  std::string token_file;
  TlsFiles tls;
  void Add(CLI::App* cmd);
};

// --json: print JSON instead of text.
void AddJsonFlag(CLI::App* cmd, bool* json);

// --timed-compute: emulated devices wait each op's time instead of computing (docs/timed-compute.md).
void AddTimedComputeFlag(CLI::App* cmd, bool* timed_compute);

// --device-profiles FILE: measured figures that calibrate the emulated devices (worker/devices.h).
void AddDeviceProfilesOption(CLI::App* cmd, std::string* path);

// --metrics-port of a node's Prometheus endpoint (0: any free, -1: off); its default shows in --help.
void AddMetricsPortOption(CLI::App* cmd, int* port);

// --bind: the address a node's gRPC server listens on; its default shows in --help.
void AddBindOption(CLI::App* cmd, std::string* host);

}  // namespace geotrain::cli
