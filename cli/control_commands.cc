// CLI verbs of the control plane: `head start`, `worker start|drain`, `status`, and `job submit|list|status|
// cancel|logs|plan`. Every verb that talks to a head uses the public API (proto/geotrain/v1) and resolves it from --head/--token/--token-file, GEOTRAIN_HEAD/
// GEOTRAIN_TOKEN/GEOTRAIN_TOKEN_FILE, or the record a head on this machine leaves (see common/rpc.h).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cli/flags.h"
#include "cli/registry.h"
#include "cli/support.h"
#include "common/log.h"
#include "common/names.h"
#include "common/rpc.h"
#include "common/spec.h"
#include "head/head_server.h"
#include "head/job_manager.h"
#include "worker/devices.h"
#include "worker/worker_server.h"

namespace geotrain::cli {
namespace {

using head::HeadOptions;
using head::HeadServer;
using worker::CalibrateDeviceProfile;
using worker::DeviceProfile;
using worker::EmulatedDevice;
using worker::ParseDeviceProfile;
using worker::ValidateSlowdown;
using worker::WorkerOptions;
using worker::WorkerServer;

// SIGINT and SIGTERM stop a daemon cleanly. Threads that libraries start before main() (OpenBLAS's
// pool) may receive the signal, so masks are no use: the handler writes the signal number to a pipe,
// and a dedicated thread reads it and runs `on_signal` (a Shutdown) outside signal context.
int g_signal_pipe[2] = {-1, -1};

void OnStopSignal(int sig) {
  const char byte = static_cast<char>(sig);
  ssize_t ignored = ::write(g_signal_pipe[1], &byte, 1);
  (void)ignored;
}

void InstallStopSignals() {
  if (g_signal_pipe[0] < 0 && ::pipe2(g_signal_pipe, O_CLOEXEC) != 0) return;
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

// Reads the next signal from the pipe; 0 when WakeSignalThread() asked the reading thread to end.
int NextSignal() {
  char sig = 0;
  while (::read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
  }
  return sig;
}
void WakeSignalThread() {
  const char zero = 0;
  ssize_t ignored = ::write(g_signal_pipe[1], &zero, 1);
  (void)ignored;
}

// `worker start`'s signals: the first SIGTERM drains the worker (its actors leave at a step boundary, the jobs go on
// elsewhere; WaitForExit returns once they are gone, or after `drain_timeout`); a second SIGTERM, or SIGINT, stops
// it at once. The thread ends after a stop, or when woken (the worker drained by itself).
std::thread DrainOrStopOnSignal(WorkerServer* server, absl::Duration drain_timeout) {
  return std::thread([server, drain_timeout] {
    bool draining = false;
    while (int sig = NextSignal()) {
      if (sig == SIGTERM && !draining) {
        GT_LOG(INFO) << "received SIGTERM; draining (another SIGTERM or SIGINT stops the worker at once)";
        draining = true;
        server->Drain(drain_timeout);
        continue;
      }
      GT_LOG(INFO) << "received signal " << sig << "; shutting down";
      server->Shutdown();
      return;
    }
  });
}

std::thread StopOnSignal(std::function<void()> on_signal) {
  return std::thread([on_signal = std::move(on_signal)] {
    char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
    }
    GT_LOG(INFO) << "received signal " << static_cast<int>(sig) << "; shutting down";
    on_signal();
  });
}

// The public enums mirror the internal ones value for value (head/public_api_test.cc checks it), so their display
// names are common/names.h's.
const char* StateName(v1::JobState state) { return JobStateName(static_cast<JobState>(state)); }
std::string StateName(v1::ActorState state) { return ActorStateName(static_cast<ActorState>(state)); }

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  std::time_t t = unix_ms / 1000;
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

// ---- head start ----
void AddHeadCommands(CLI::App& app, Context& context) {
  CLI::App* head = app.add_subcommand("head", "run the head node");
  head->require_subcommand(1);
  CLI::App* start = head->add_subcommand("start", "start the head in the foreground (stop with Ctrl-C or SIGTERM)");
  auto options = std::make_shared<HeadOptions>();
  options->state_dir = absl::StrCat(GeotrainHome(), "/head");
  start->add_option("--port", options->port, "gRPC port")->capture_default_str();
  AddMetricsPortOption(start, &options->metrics_port);
  AddBindOption(start, &options->bind_host);
  start->add_option("--advertise-host", options->advertise_host, "host the CLI and workers should dial");
  start->add_option("--state-dir", options->state_dir, "where the head persists its state")->capture_default_str();
  auto token_file = std::make_shared<std::string>();
  AddTokenOptions(start, &options->token, token_file.get(),
                  "GEOTRAIN_TOKEN, GEOTRAIN_TOKEN_FILE, the state dir's, or new");
  start->add_option("--heartbeat-interval-ms", options->heartbeat_interval_ms, "worker heartbeat interval")
      ->capture_default_str();
  start
      ->add_option("--unreachable-timeout-ms", options->unreachable_timeout_ms,
                   "Declare a silent worker that cannot be reached (a partition) dead after this long (default 30000)")
      ->check(CLI::Range(int64_t{1000}, int64_t{3600000}));
  start
      ->add_option("--heartbeat-timeout-ms", options->heartbeat_timeout_ms,
                   "silence after which a worker is declared dead")
      ->capture_default_str();
  start->add_option("--metrics-bind", options->metrics_bind,
                    "address /metrics listens on (default: the advertised host, else 127.0.0.1)");
  start->add_option("--dashboard-port", options->dashboard_port,
                    "web dashboard port (default: the metrics port; under TLS, HTTPS on a free port; 0: a free port; "
                    "-1: off); it listens where /metrics does");
  start->add_option("--topology", options->topology_file,
                    "the cluster's topology file: the dashboard shows its links as configured");
  AddNodeTlsOptions(start, &options->tls, "head");
  start->callback([options, token_file, &context] {
    SetLogProcessName("head");
    absl::StatusOr<std::string> token = TokenFromFlagsOrEnvironment(options->token, *token_file);
    if (!token.ok()) {
      context.exit_code = Fail(token.status());
      return;
    }
    options->token = *token;
    if (options->heartbeat_timeout_ms <= options->heartbeat_interval_ms) {
      context.exit_code =
          Fail(absl::InvalidArgumentError("--heartbeat-timeout-ms must be larger than --heartbeat-interval-ms"));
      return;
    }
    InstallStopSignals();
    HeadServer server(*options);
    if (absl::Status s = server.Start(); !s.ok()) {
      context.exit_code = Fail(s);
      return;
    }
    std::printf("geotrain head %s listening on port %d (metrics on %d); token in %s/token\n", server.head_id().c_str(),
                server.port(), server.metrics_port(), options->state_dir.c_str());
    std::printf(
        "join workers with: geotrain worker start --head <this-host>:%d --site NAME --token-file <a copy of "
        "%s/token>\n",
        server.port(), options->state_dir.c_str());
    if (!server.dashboard_url().empty()) {
      std::printf("dashboard: %s (log in with the token in %s/token)\n", server.dashboard_url().c_str(),
                  options->state_dir.c_str());
    }
    std::fflush(stdout);
    std::thread waiter = StopOnSignal([&server] { server.Shutdown(); });
    server.Wait();
    waiter.join();  // Wait() returns only after the signal thread has called Shutdown()
  });
}

// ---- worker drain ID [--wait] ----
// True when the worker has no actor left that trains (or it is gone: dead, or forgotten).
bool WorkerDrained(const v1::ClusterStatus& status, const std::string& worker_id) {
  bool known = false;
  for (const v1::Worker& w : status.workers()) {
    if (w.worker_id() == worker_id) known = w.state() == v1::WORKER_ALIVE;
  }
  if (!known) return true;
  for (const v1::Actor& a : status.actors()) {
    if (a.worker_id() == worker_id && a.state() != v1::ACTOR_DEAD) return false;
  }
  return true;
}

void AddWorkerDrainCommand(CLI::App* worker, Context& context) {
  CLI::App* drain = worker->add_subcommand(
      "drain",
      "the worker leaves on notice: its jobs restart without it from a checkpoint at a step boundary, "
      "nothing lost; the worker exits once its actors are gone");
  auto flags = std::make_shared<HeadFlags>();
  auto worker_id = std::make_shared<std::string>();
  drain->add_option("id", *worker_id, "worker id (`geotrain status` lists them)")->required();
  auto wait = std::make_shared<bool>(false);
  drain->add_flag("--wait", *wait, "wait until the worker has no actor left (at most 15 minutes)");
  flags->Add(drain);
  drain->callback([flags, worker_id, wait, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::DrainWorkerRequest request;
    request.set_worker_id(*worker_id);
    v1::Worker reply;
    if (!RpcSucceeded(client->cluster->DrainWorker(client->Prepare(&ctx), request, &reply), *client, context)) return;
    std::printf("worker %s drains: its actors leave at their next step boundary, its jobs restart without it\n",
                reply.worker_id().c_str());
    std::fflush(stdout);
    if (!*wait) return;
    for (const auto deadline = absl::Now() + absl::Minutes(15); absl::Now() < deadline;) {
      grpc::ClientContext status_ctx;
      v1::ClusterStatus status;
      if (!RpcSucceeded(
              client->cluster->GetClusterStatus(client->Prepare(&status_ctx), v1::GetClusterStatusRequest(), &status),
              *client, context)) {
        return;
      }
      if (WorkerDrained(status, *worker_id)) {
        std::printf("worker %s drained: no actor left\n", worker_id->c_str());
        return;
      }
      absl::SleepFor(absl::Milliseconds(500));
    }
    context.exit_code = Fail(absl::DeadlineExceededError(
        absl::StrCat("worker ", *worker_id, " still has actors after 15 minutes; see `geotrain status`")));
  });
}

// ---- worker start ----
void AddWorkerCommands(CLI::App& app, Context& context) {
  CLI::App* worker = app.add_subcommand("worker", "run a worker node");
  worker->require_subcommand(1);
  CLI::App* start = worker->add_subcommand("start", "start a worker in the foreground and join a head");
  auto options = std::make_shared<WorkerOptions>();
  auto emulate = std::make_shared<std::vector<std::string>>();
  auto head_flag = std::make_shared<std::string>();
  AddHeadOption(start, head_flag.get());
  start->add_option("--site", options->site, "site this worker belongs to")->required();
  start->add_option("--port", options->port, "gRPC port (0: any free port)")->capture_default_str();
  AddBindOption(start, &options->bind_host);
  start->add_option("--advertise-address", options->advertise_address,
                    "HOST[:PORT] the head and peers dial (behind NAT or a proxy)");
  AddMetricsPortOption(start, &options->metrics_port);
  start->add_option("--worker-id", options->worker_id, "stable worker id (default: assigned by the head)");
  auto token_file = std::make_shared<std::string>();
  AddHeadTokenOptions(start, &options->token, token_file.get());
  auto advertise_for = std::make_shared<std::vector<std::string>>();
  start->add_option("--advertise-for", *advertise_for,
                    "SITE=HOST:PORT: the address peers at SITE dial (repeatable; e.g. a WAN emulator route)");
  start
      ->add_option("--probe-interval-ms", options->probe_interval_ms,
                   "how often to measure latency and bandwidth to peers (0: never)")
      ->capture_default_str();
  start
      ->add_option("--finished-actor-retention-ms", options->finished_actor_retention_ms,
                   "how long a finished actor stays listed after the head has its last report; the head keeps "
                   "its final state in the job's record")
      ->check(CLI::Range(int64_t{0}, int64_t{7} * 24 * 3600 * 1000))
      ->capture_default_str();
  start->add_option("--emulate-device", *emulate,
                    "stand in for a GPU: NAME[:TFLOPS:MEM_GB[:BW_GBS]] (repeatable), e.g. T4 or T4:65:16");
  AddTimedComputeFlag(start, &options->timed_compute);
  auto profiles_file = std::make_shared<std::string>();
  AddDeviceProfilesOption(start, profiles_file.get());
  start
      ->add_option("--slowdown", options->slowdown,
                   "slow every CPU device (the CPU, or --emulate-device without --timed-compute) by this factor >= 1: "
                   "sites of unequal speed with real numerics; step times EMULATED (docs/timed-compute.md)")
      ->capture_default_str();
  start->add_option("--metrics-bind", options->metrics_bind,
                    "address /metrics listens on (default: the advertised address's host)");
  start->add_option("--state-dir", options->state_dir,
                    "where the worker keeps its cache and local checkpoint files (default: GEOTRAIN_HOME/worker/ID, by "
                    "--worker-id, else the port)");
  start->add_option("--cache-dir", options->cache_dir,
                    "staged data shards, shared by this worker's jobs (default: STATE_DIR/cache)");
  AddNodeTlsOptions(start, &options->tls, "worker");
  auto drain_timeout_ms = std::make_shared<int64_t>(120000);
  start
      ->add_option("--drain-timeout-ms", *drain_timeout_ms,
                   "on SIGTERM the worker drains (its actors leave at a step boundary, their jobs go on elsewhere) "
                   "and exits once its actors are gone, or after this long; a second SIGTERM exits at once")
      ->check(CLI::Range(int64_t{0}, int64_t{24} * 3600 * 1000))
      ->capture_default_str();
  start->callback([options, emulate, profiles_file, head_flag, token_file, advertise_for, drain_timeout_ms, &context] {
    SetLogProcessName(absl::StrCat("worker ", options->site));
    for (const std::string& pair : *advertise_for) {
      const size_t eq = pair.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == pair.size()) {
        context.exit_code =
            Fail(absl::InvalidArgumentError(absl::StrCat("--advertise-for '", pair, "': expected SITE=HOST:PORT")));
        return;
      }
      options->address_for_site[pair.substr(0, eq)] = pair.substr(eq + 1);
    }
    if (!profiles_file->empty() && !options->timed_compute) {
      context.exit_code = Fail(absl::InvalidArgumentError("--device-profiles calibrates --timed-compute; add it"));
      return;
    }
    if (absl::Status s = ValidateSlowdown(options->slowdown, options->timed_compute); !s.ok()) {
      context.exit_code = Fail(s);
      return;
    }
    for (const std::string& text : *emulate) {
      absl::StatusOr<DeviceProfile> profile = ParseDeviceProfile(text);
      if (profile.ok() && !profiles_file->empty()) {
        absl::StatusOr<bool> calibrated = CalibrateDeviceProfile(*profiles_file, &*profile);
        if (!calibrated.ok()) profile = calibrated.status();
      }
      absl::StatusOr<Device> device = profile.ok() ? EmulatedDevice(*profile) : profile.status();
      if (!device.ok()) {
        context.exit_code = Fail(device.status());
        return;
      }
      options->emulated_devices.push_back(*device);
      options->timed_profiles.push_back(*profile);
    }
    absl::StatusOr<std::string> token = TokenFromFlagsOrEnvironment(options->token, *token_file);
    if (!token.ok()) {
      context.exit_code = Fail(token.status());
      return;
    }
    auto endpoint = ResolveHead(*head_flag, *token);
    if (!endpoint.ok()) {
      context.exit_code = Fail(endpoint.status());
      return;
    }
    options->head_address = endpoint->address;
    options->token = endpoint->token;
    InstallStopSignals();
    WorkerServer server(*options);
    if (absl::Status s = server.Start(); !s.ok()) {
      context.exit_code = Fail(s);
      return;
    }
    std::printf("geotrain worker (site %s) listening on port %d, joining %s\n", options->site.c_str(), server.port(),
                options->head_address.c_str());
    std::fflush(stdout);
    std::thread signals = DrainOrStopOnSignal(&server, absl::Milliseconds(*drain_timeout_ms));
    server.WaitForExit();  // drained, stopped by a signal, or the drain timed out
    server.Shutdown();
    WakeSignalThread();
    signals.join();  // after its Shutdown() returned, if it made one
  });
  AddWorkerDrainCommand(worker, context);
}

// ---- status ----
void PrintStatus(const v1::ClusterStatus& status, const std::string& address) {
  std::printf("head %s at %s, up since %s\n", status.head_id().c_str(), address.c_str(),
              FormatTime(status.head_started_unix_ms()).c_str());
  std::printf("\n%-14s %6s %6s %8s %10s\n", "SITE", "ALIVE", "DEAD", "DEVICES", "TFLOP/S");
  for (const v1::Site& s : status.sites()) {
    std::printf("%-14s %6d %6d %8d %10.1f\n", s.name().c_str(), s.alive_workers(), s.dead_workers(), s.devices(),
                s.tflops());
  }
  std::printf("\n%-12s %-10s %-8s %-22s %-34s %s\n", "WORKER", "SITE", "STATE", "ADDRESS", "DEVICES", "LAST HEARTBEAT");
  for (const v1::Worker& w : status.workers()) {
    std::string devices;
    for (const v1::Device& d : w.devices()) {
      if (!devices.empty()) devices += ", ";
      devices += absl::StrFormat("%s %.1fTF %.0fGB", d.name(), d.tflops(), d.memory_bytes() / 1e9);
    }
    std::printf("%-12s %-10s %-8s %-22s %-34s %s%s\n", w.worker_id().c_str(), w.site().c_str(),
                w.state() != v1::WORKER_ALIVE ? "DEAD"
                : w.draining()                ? "DRAINING"
                                              : "ALIVE",
                w.address().c_str(), devices.c_str(), FormatTime(w.last_heartbeat_unix_ms()).c_str(),
                w.dead_reason().empty() ? "" : absl::StrCat("  (", w.dead_reason(), ")").c_str());
  }
  if (status.site_links_size() > 0) {
    std::printf("\n%-14s %-14s %12s %16s %8s\n", "SITE A", "SITE B", "LATENCY MS", "BANDWIDTH MBIT/S", "SAMPLES");
    for (const v1::SiteLink& l : status.site_links()) {
      std::printf("%-14s %-14s %12.2f %16.0f %8d\n", l.a().c_str(), l.b().c_str(), l.latency_ms(), l.bandwidth_mbps(),
                  l.samples());
    }
  }
  if (status.actors_size() > 0) {
    std::printf("\n%-16s %-12s %-12s %4s %5s %3s %s\n", "ACTOR", "JOB", "WORKER", "REPL", "STAGE", "TP", "STATE");
    for (const v1::Actor& a : status.actors()) {
      std::printf("%-16s %-12s %-12s %4d %5d %3d %s\n", a.actor_id().c_str(), a.job_id().c_str(), a.worker_id().c_str(),
                  a.replica(), a.stage(), a.tp_rank(), StateName(a.state()).c_str());
    }
  }
  std::printf("\njobs:");
  for (const char* state : {"PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"}) {
    auto it = status.jobs_by_state().find(state);
    std::printf(" %s %d", state, it == status.jobs_by_state().end() ? 0 : it->second);
  }
  std::printf("\n");
}

void AddStatusCommand(CLI::App& app, Context& context) {
  CLI::App* cmd = app.add_subcommand("status", "show sites, workers, devices, liveness and actors");
  auto flags = std::make_shared<HeadFlags>();
  auto json = std::make_shared<bool>(false);
  flags->Add(cmd);
  AddJsonFlag(cmd, json.get());
  cmd->callback([flags, json, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::ClusterStatus status;
    if (!RpcSucceeded(client->cluster->GetClusterStatus(client->Prepare(&ctx), v1::GetClusterStatusRequest(), &status),
                      *client, context)) {
      return;
    }
    status.set_head_address(client->endpoint.address);
    // The dashboard's address ("" from a head that serves none, or predates GetClusterInfo).
    grpc::ClientContext info_ctx;
    v1::ClusterInfo info;
    (void)client->cluster->GetClusterInfo(client->Prepare(&info_ctx), v1::GetClusterInfoRequest(), &info);
    if (*json) {
      Json out = {{"dashboard_url", info.dashboard_url()}};
      out.update(Json::parse(ToJson(status, false)));
      std::printf("%s\n", out.dump(1, ' ', false, Json::error_handler_t::replace).c_str());
    } else {
      PrintStatus(status, client->endpoint.address);
      if (!info.dashboard_url().empty()) std::printf("dashboard: %s\n", info.dashboard_url().c_str());
    }
  });
}

// ---- job ... ----
void PrintJob(const v1::Job& job) {
  std::printf("job %s (%s): %s\n", job.job_id().c_str(), job.name().c_str(), StateName(job.state()));
  if (!job.message().empty()) std::printf("  %s\n", job.message().c_str());
  std::printf("  submitted %s, updated %s\n", FormatTime(job.submitted_unix_ms()).c_str(),
              FormatTime(job.updated_unix_ms()).c_str());
  const ParallelSpec& p = job.spec().parallel();
  std::printf("  model %s, global batch %d x seq %d, %d steps; plan %s (dp %d, pp %d, tp %d, %d microbatches, %s)\n",
              job.spec().model().preset().empty() ? "custom" : job.spec().model().preset().c_str(),
              job.spec().train().global_batch(), job.spec().train().seq_len(), job.spec().train().steps(),
              p.plan().c_str(), p.dp(), p.pp(), p.tp(), p.microbatches(), p.schedule().c_str());
  if (job.step() > 0 && job.timed_compute()) {
    std::printf("  step %ld, EMULATED (timed compute: emulated GPUs' time, no real loss), %.0f tokens/s\n",
                static_cast<long>(job.step()), job.tokens_per_second());
  } else if (job.step() > 0) {
    std::printf("  step %ld, loss %.4f, %.0f tokens/s\n", static_cast<long>(job.step()), job.loss(),
                job.tokens_per_second());
  }
  if (!job.precision().empty()) {
    std::printf("  precision %s%s\n", job.precision().c_str(),
                job.precision() == "fp16" ? absl::StrFormat(", loss scale %g, %ld step(s) skipped on overflow",
                                                            job.loss_scale(), static_cast<long>(job.skipped_steps()))
                                                .c_str()
                                          : "");
  }
  if (job.predicted_step_seconds() > 0 || job.measured_step_seconds() > 0) {
    std::printf("  step time: predicted %.3f s, measured %.3f s\n", job.predicted_step_seconds(),
                job.measured_step_seconds());
  }
  if (job.last_checkpoint_step() > 0 || !job.resumed_from().empty()) {
    std::printf("  checkpoints: newest complete at step %ld%s%s\n", static_cast<long>(job.last_checkpoint_step()),
                job.resumed_from().empty() ? "" : "; this run resumed from ", job.resumed_from().c_str());
  }
  if (job.restarts() > 0) std::printf("  restarts: %d (run %ld)\n", job.restarts(), static_cast<long>(job.attempt()));
  if (job.regroups() > 0) {
    std::printf("  replicas: %d of %d training; %d live regroup%s after faults, without a restart\n",
                job.replicas().present(), job.replicas().planned(), job.regroups(), job.regroups() == 1 ? "" : "s");
  }
  if (job.heals() > 0) {
    std::printf("  heals: %d (replicas back with a live replica's state, no restart); the latest %s\n", job.heals(),
                job.heal_seconds() > 0
                    ? absl::StrFormat("trained %.1f s after its fault's detection", job.heal_seconds()).c_str()
                    : "joins now");
  }
  for (const v1::Fault& f : job.faults()) {
    std::printf("  fault at %s, step %ld: %s\n    -> %s, %ld step(s) lost, %s\n",
                FormatTime(f.detected_unix_ms()).c_str(), static_cast<long>(f.step()), f.cause().c_str(),
                f.resumed_from().empty() ? "restarted from the beginning"
                                         : absl::StrCat("resumed from step ", f.resumed_step()).c_str(),
                static_cast<long>(f.steps_lost()),
                f.recovery_seconds() > 0 ? absl::StrFormat("training again after %.1f s", f.recovery_seconds()).c_str()
                                         : "recovering");
  }
  for (const v1::Actor& a : job.actors()) {
    std::printf("  actor %s on %s: replica %d stage %d tp %d %s %s\n", a.actor_id().c_str(), a.worker_id().c_str(),
                a.replica(), a.stage(), a.tp_rank(), StateName(a.state()).c_str(), a.message().c_str());
  }
}

// Redraws one progress line for step events: bar, step, loss, tokens/s and WAN bytes so far.
class ProgressLine {
 public:
  explicit ProgressLine(int total_steps) : total_(std::max(1, total_steps)) {}
  // Returns true when the event was a step event and was drawn.
  bool Draw(const v1::JobEvent& event) {
    if (event.kind() != "step" || !event.has_step()) return false;
    const v1::StepFigures& figures = event.step();
    const long step = static_cast<long>(figures.step());
    wan_total_ += figures.wan_bytes();
    constexpr int kWidth = 28;
    const int filled = static_cast<int>(kWidth * std::min<long>(step, total_) / total_);
    std::string bar(filled, '=');
    if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
    const std::string loss = figures.timed_compute() ? "EMULATED" : absl::StrFormat("loss %.4f", figures.loss());
    // A slowed CPU (worker --slowdown): its times are emulated, its loss real.
    const std::string slowed =
        figures.slowdown() > 1 ? absl::StrFormat(" (EMULATED: slowed %gx)", figures.slowdown()) : "";
    std::fprintf(stdout, "\r[%s] step %ld/%d | %s | %.0f tok/s | %.2f s/step%s | WAN %.1f MB ", bar.c_str(), step,
                 total_, loss.c_str(), figures.tokens_per_second(), figures.step_seconds(), slowed.c_str(),
                 wan_total_ / 1e6);
    std::fflush(stdout);
    drawn_ = true;
    return true;
  }
  void Break() {
    if (drawn_) std::fputc('\n', stdout);
    drawn_ = false;
  }

 private:
  const int total_;
  long wan_total_ = 0;
  bool drawn_ = false;
};

// Streams a job's events; returns the exit code (0 when the job ended well or follow is off). With
// `progress`, step events redraw one progress line instead of printing a line each.
int StreamLogs(const HeadClient& client, const std::string& job_id, bool follow, bool progress = false,
               int total_steps = 0) {
  grpc::ClientContext ctx;
  client.Prepare(&ctx, follow ? 0 : 30000);
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  request.set_follow(follow);
  auto reader = client.jobs->WatchJob(&ctx, request);
  v1::JobEvent event;
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  ProgressLine line(total_steps);
  while (reader->Read(&event)) {
    last = event.state();
    if (progress && line.Draw(event)) continue;
    line.Break();
    std::printf("%s %s\n", FormatTime(event.unix_ms()).c_str(), event.line().c_str());
    std::fflush(stdout);
  }
  line.Break();
  grpc::Status s = reader->Finish();
  if (!s.ok()) return Fail(ExplainRpcFailure(s, client.endpoint.address));
  if (follow && (last == v1::JOB_FAILED || last == v1::JOB_CANCELLED)) return 1;
  return 0;
}

// The positional arguments the job verbs share.
void AddSpecArgument(CLI::App* cmd, std::string* spec_path) {
  cmd->add_option("spec", *spec_path, "job spec file")->required();
}
void AddJobIdArgument(CLI::App* cmd, std::string* job_id) { cmd->add_option("id", *job_id, "job id")->required(); }

// job submit SPEC [--follow [--progress]] [--resume-from DIR]
void AddJobSubmitCommand(CLI::App* job, Context& context) {
  CLI::App* submit = job->add_subcommand("submit", "submit a job spec (YAML or JSON)");
  auto flags = std::make_shared<HeadFlags>();
  auto spec_path = std::make_shared<std::string>();
  auto follow = std::make_shared<bool>(false);
  AddSpecArgument(submit, spec_path.get());
  submit->add_flag("--follow", *follow, "stream the job's log until it ends");
  auto progress = std::make_shared<bool>(false);
  submit->add_flag("--progress", *progress, "with --follow: one progress line for the steps (default on a terminal)");
  auto resume_from = std::make_shared<std::string>();
  submit->add_option("--resume-from", *resume_from,
                     "start from this checkpoint (a step directory, or a checkpoint dir: its newest complete one); "
                     "any plan's checkpoint of the same model (sets checkpoint.resume_from)");
  flags->Add(submit);
  submit->callback([flags, spec_path, follow, progress, resume_from, &context] {
    auto spec = LoadJobSpecFile(*spec_path);
    if (!spec.ok()) {
      context.exit_code = Fail(spec.status());
      return;
    }
    if (!resume_from->empty()) spec->mutable_checkpoint()->set_resume_from(*resume_from);
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::SubmitJobRequest request;
    *request.mutable_spec() = *spec;
    request.set_spec_source(*spec_path);
    request.set_base_dir(std::filesystem::current_path().string());  // workers may run elsewhere: paths go absolute
    v1::Job reply;
    if (!RpcSucceeded(client->jobs->SubmitJob(client->Prepare(&ctx), request, &reply), *client, context)) return;
    std::printf("submitted %s (%s): %s\n", reply.job_id().c_str(), reply.name().c_str(), StateName(reply.state()));
    std::fflush(stdout);
    if (*follow) {
      context.exit_code =
          StreamLogs(*client, reply.job_id(), true, *progress || isatty(STDOUT_FILENO), reply.spec().train().steps());
    }
  });
}

// job list [--json]: the queue, pending jobs in the order the head tries them (submission order).
void AddJobListCommand(CLI::App* job, Context& context) {
  CLI::App* list = job->add_subcommand("list", "list jobs");
  auto flags = std::make_shared<HeadFlags>();
  auto json = std::make_shared<bool>(false);
  AddJsonFlag(list, json.get());
  flags->Add(list);
  list->callback([flags, json, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::ListJobsReply reply;
    if (!RpcSucceeded(client->jobs->ListJobs(client->Prepare(&ctx), v1::ListJobsRequest(), &reply), *client, context)) {
      return;
    }
    if (*json) {
      std::printf("%s\n", ToJson(reply, true).c_str());
      return;
    }
    std::printf("%-12s %-24s %-11s %-6s %-20s %s\n", "JOB", "NAME", "STATE", "QUEUE", "SUBMITTED", "MESSAGE");
    int queued = 0;
    for (const v1::Job& j : reply.jobs()) {
      const std::string queue = j.state() == v1::JOB_PENDING ? absl::StrCat("#", ++queued) : "";
      std::printf("%-12s %-24s %-11s %-6s %-20s %s\n", j.job_id().c_str(), j.name().c_str(), StateName(j.state()),
                  queue.c_str(), FormatTime(j.submitted_unix_ms()).c_str(), j.message().c_str());
    }
  });
}

// job status ID [--json]
void AddJobStatusCommand(CLI::App* job, Context& context) {
  CLI::App* status = job->add_subcommand("status", "show one job, its actors and its progress");
  auto flags = std::make_shared<HeadFlags>();
  auto job_id = std::make_shared<std::string>();
  AddJobIdArgument(status, job_id.get());
  auto json = std::make_shared<bool>(false);
  AddJsonFlag(status, json.get());
  flags->Add(status);
  status->callback([flags, job_id, json, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::GetJobRequest request;
    request.set_job_id(*job_id);
    v1::Job reply;
    if (!RpcSucceeded(client->jobs->GetJob(client->Prepare(&ctx), request, &reply), *client, context)) return;
    if (*json) {
      std::printf("%s\n", ToJson(reply, true).c_str());
    } else {
      PrintJob(reply);
    }
  });
}

// job cancel ID
void AddJobCancelCommand(CLI::App* job, Context& context) {
  CLI::App* cancel = job->add_subcommand("cancel", "cancel a job and stop its actors");
  auto flags = std::make_shared<HeadFlags>();
  auto job_id = std::make_shared<std::string>();
  AddJobIdArgument(cancel, job_id.get());
  flags->Add(cancel);
  cancel->callback([flags, job_id, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::CancelJobRequest request;
    request.set_job_id(*job_id);
    v1::Job reply;
    if (!RpcSucceeded(client->jobs->CancelJob(client->Prepare(&ctx), request, &reply), *client, context)) return;
    std::printf("job %s: %s\n", reply.job_id().c_str(), StateName(reply.state()));
  });
}

// job logs ID [--follow]
void AddJobLogsCommand(CLI::App* job, Context& context) {
  CLI::App* logs = job->add_subcommand("logs", "print a job's log; --follow streams it until the job ends");
  auto flags = std::make_shared<HeadFlags>();
  auto job_id = std::make_shared<std::string>();
  AddJobIdArgument(logs, job_id.get());
  auto follow = std::make_shared<bool>(false);
  logs->add_flag("--follow,-f", *follow, "keep streaming until the job ends");
  flags->Add(logs);
  logs->callback([flags, job_id, follow, &context] {
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    context.exit_code = StreamLogs(*client, *job_id, *follow);
  });
}

// job plan SPEC [--top N] [--json]: the head's planner on the cluster as it is; submits nothing.
void AddJobPlanCommand(CLI::App* job, Context& context) {
  CLI::App* plan = job->add_subcommand(
      "plan",
      "rank plans for a job spec on the cluster as it is (the head's planner, as for `plan: auto`); submits nothing");
  auto flags = std::make_shared<HeadFlags>();
  auto spec_path = std::make_shared<std::string>();
  AddSpecArgument(plan, spec_path.get());
  auto top = std::make_shared<int>(5);
  plan->add_option("--top", *top, "how many ranked plans to show")->capture_default_str()->check(CLI::Range(1, 100));
  auto json = std::make_shared<bool>(false);
  AddJsonFlag(plan, json.get());
  flags->Add(plan);
  plan->callback([flags, spec_path, top, json, &context] {
    auto spec = LoadJobSpecFile(*spec_path);
    if (!spec.ok()) {
      context.exit_code = Fail(spec.status());
      return;
    }
    std::optional<HeadClient> client = ConnectOrFail(*flags, context);
    if (!client) return;
    grpc::ClientContext ctx;
    v1::PlanJobRequest request;
    *request.mutable_spec() = *spec;
    request.set_spec_source(*spec_path);
    request.set_base_dir(std::filesystem::current_path().string());
    request.set_max_plans(*top);
    v1::PlanJobReply reply;
    if (!RpcSucceeded(client->planner->PlanJob(client->Prepare(&ctx, 60000), request, &reply), *client, context)) {
      return;
    }
    if (*json) {
      std::printf("%s\n", ToJson(reply, true).c_str());
      return;
    }
    std::printf("%s on %d alive worker(s), %d device(s): %ld plans simulated in %.2f s\n", spec_path->c_str(),
                reply.alive_workers(), reply.devices(), static_cast<long>(reply.plans_simulated()),
                reply.planning_seconds());
    for (const v1::RankedPlan& p : reply.plans()) std::printf("  %d. %s\n", p.rank(), p.summary().c_str());
    for (const std::string& line : reply.explanation()) std::printf("%s\n", line.c_str());
  });
}

void AddJobCommands(CLI::App& app, Context& context) {
  CLI::App* job = app.add_subcommand("job", "submit and follow training jobs");
  job->require_subcommand(1);
  AddJobSubmitCommand(job, context);
  AddJobListCommand(job, context);
  AddJobStatusCommand(job, context);
  AddJobCancelCommand(job, context);
  AddJobLogsCommand(job, context);
  AddJobPlanCommand(job, context);
}

void AddControlCommands(CLI::App& app, Context& context) {
  AddHeadCommands(app, context);
  AddWorkerCommands(app, context);
  AddStatusCommand(app, context);
  AddJobCommands(app, context);
}

bool registered = RegisterCommands("control", &AddControlCommands);

}  // namespace
}  // namespace geotrain::cli
