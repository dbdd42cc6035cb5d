// `geotrain cluster up TOPOLOGY | down | status`: a whole multi-site cluster on this machine — a head,
// the WAN emulator (geotrain-netem) and every site's workers — with all cross-site traffic, and only
// that, going through the emulator. Each worker listens on its own port; for every other site linked to
// its own, the emulator gets a route (OTHER>SITE) to that port, and the worker advertises that route's
// port to peers at the other site (--advertise-for). Peers at its own site dial it directly.
//
// `up` records what it started in <state-dir>/cluster.json; `down` stops exactly those processes
// (checking each pid still runs a geotrain binary) and leaves nothing running.
//
// Every worker has a state dir of its own (<state-dir>/nodes/<id>: its shard cache and checkpoint files), as on
// separate machines. `--isolate` also gives each worker its own network namespace and address, and a filesystem
// view without the head's state dir, the other workers' dirs, anything under /tmp, /home, /root, /srv and
// /var/lib/geotrain it was not given (the jobs' data and checkpoint dirs too), and the directories given with
// --hide: cli/cluster_isolation.h. `--tls` makes certificates (deploy/make-certs.sh) and runs every
// connection with TLS. `down` also removes every namespace and link `up --isolate` made.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/cluster_isolation.h"
#include "cli/flags.h"
#include "cli/registry.h"
#include "cli/support.h"
#include "common/rpc.h"
#include "common/spec.h"
#include "common/status.h"
#include "netem/control_client.h"
#include "netem/process.h"
#include "worker/devices.h"
#include "yaml-cpp/yaml.h"

namespace geotrain::cli {
namespace {

constexpr int kIsolatedWorkerPort = 7300;  // a worker's port in its own network namespace

std::string SelfDirectory() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

// A port on 127.0.0.1 held by a bound socket until Release(), just before the process that listens on it starts.
// While held, the kernel hands it out to no later pick, ours or the WAN emulator's. Picked and closed at once, one
// cluster's ports could repeat: on 2026-12-05 two workers of a 6-worker `cluster up` got port 33667, and the second
// could not listen.
class ReservedPort {
 public:
  static absl::StatusOr<ReservedPort> Pick() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      if (fd >= 0) ::close(fd);
      return absl::UnavailableError("cannot find a free port on 127.0.0.1");
    }
    return ReservedPort(fd, ntohs(addr.sin_port));
  }
  ReservedPort(ReservedPort&& other) noexcept : fd_(std::exchange(other.fd_, -1)), port_(other.port_) {}
  ReservedPort& operator=(ReservedPort&& other) noexcept {
    if (this != &other) {
      Release();
      fd_ = std::exchange(other.fd_, -1);
      port_ = other.port_;
    }
    return *this;
  }
  ~ReservedPort() { Release(); }

  int port() const { return port_; }
  void Release() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  ReservedPort(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

// The last non-empty line of a log file, or "" when it cannot be read.
std::string LastLogLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

// Starts argv[0] in its own session with stdout and stderr appended to `log`, and OMP_WAIT_POLICY=PASSIVE unless the
// environment sets a policy; returns its pid.
// The child runs only async-signal-safe calls: gRPC threads may hold allocator or stdio locks at fork.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The cluster's processes share this machine: their OpenMP threads sleep at barriers rather than spin against each
  // other's (a spinning team takes the cores another worker needs), unless the caller chose a policy.
  static char kPassive[] = "OMP_WAIT_POLICY=PASSIVE";
  std::vector<char*> env;
  bool policy_set = false;
  for (char** e = environ; *e != nullptr; ++e) {
    env.push_back(*e);
    policy_set = policy_set || std::string_view(*e).starts_with("OMP_WAIT_POLICY=");
  }
  if (!policy_set) env.push_back(kPassive);
  env.push_back(nullptr);
  const char* log_path = log.c_str();
  static constexpr char kExecFailed[] = "geotrain cluster: cannot execute the binary\n";
  const pid_t pid = ::fork();
  if (pid < 0) return absl::ResourceExhaustedError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::setsid();
    const int fd = ::open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ::execve(args[0], args.data(), env.data());
    ssize_t ignored = ::write(STDERR_FILENO, kExecFailed, sizeof(kExecFailed) - 1);
    (void)ignored;
    ::_exit(127);
  }
  return pid;
}

// True when `pid` runs one of geotrain's binaries (geotrain, geotrain-netem): a recorded pid that was
// reused by another program is left alone.
bool RunsGeotrain(pid_t pid) {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink(absl::StrCat("/proc/", pid, "/exe"), ec);
  if (ec) return false;
  std::string name = exe.filename().string();
  // A binary replaced by a rebuild while it runs shows as "geotrain (deleted)".
  if (const size_t cut = name.find(" (deleted)"); cut != std::string::npos) name.resize(cut);
  return name == "geotrain" || name == "geotrain-netem";
}

struct Started {
  std::string name;
  pid_t pid;
};

struct ClusterFile {
  std::string topology;
  std::string head_address;
  int netem_control_port = 0;
  std::vector<Started> processes;
  std::string isolation_prefix;  // --isolate: the names of its namespaces and links
  std::string tls_ca;            // --tls: the cluster's CA
};

// Options of `cluster up`.
struct UpOptions {
  bool isolate = false;
  bool tls = false;
  std::vector<std::string> hidden;     // --hide: directories the isolated workers must not see
  bool timed_compute = false;          // every worker's emulated devices on timed compute
  std::string device_profiles;         // their calibration file (worker start --device-profiles)
  std::vector<std::string> slowdowns;  // --slowdown NAME=F: workers started slowed (worker start --slowdown F)
};

std::string ClusterFilePath(const std::string& state_dir) { return state_dir + "/cluster.json"; }

absl::Status WriteClusterFile(const std::string& state_dir, const ClusterFile& file) {
  YAML::Emitter out;
  out << YAML::DoubleQuoted << YAML::BeginMap;
  out << YAML::Key << "topology" << YAML::Value << file.topology;
  out << YAML::Key << "head_address" << YAML::Value << file.head_address;
  out << YAML::Key << "netem_control_port" << YAML::Value << std::to_string(file.netem_control_port);
  out << YAML::Key << "isolation_prefix" << YAML::Value << file.isolation_prefix;
  out << YAML::Key << "tls_ca" << YAML::Value << file.tls_ca;
  out << YAML::Key << "processes" << YAML::Value << YAML::BeginSeq;
  for (const Started& p : file.processes) {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "name" << YAML::Value << p.name << YAML::Key << "pid"
        << YAML::Value << std::to_string(p.pid) << YAML::EndMap;
  }
  out << YAML::EndSeq << YAML::EndMap;
  return WriteFileAtomically(ClusterFilePath(state_dir), std::string(out.c_str()) + "\n", 0600);
}

absl::StatusOr<ClusterFile> ReadClusterFile(const std::string& state_dir) {
  const std::string path = ClusterFilePath(state_dir);
  auto text = ReadSmallFile(path);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat("no cluster is up in ", state_dir,
                                            " (no cluster.json); start one with `geotrain cluster up TOPOLOGY`"));
  }
  try {
    YAML::Node node = YAML::Load(*text);
    ClusterFile file;
    file.topology = node["topology"].as<std::string>("");
    file.head_address = node["head_address"].as<std::string>("");
    file.netem_control_port = std::stoi(node["netem_control_port"].as<std::string>("0"));
    file.isolation_prefix = node["isolation_prefix"].as<std::string>("");
    file.tls_ca = node["tls_ca"].as<std::string>("");
    for (const auto& p : node["processes"]) {
      file.processes.push_back(
          {p["name"].as<std::string>(""), static_cast<pid_t>(std::stol(p["pid"].as<std::string>("0")))});
    }
    return file;
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": ", e.what(), "; stop stray processes by hand"));
  }
}

// Stops the processes (SIGTERM, then SIGKILL after 5 s); returns how many were running.
int StopProcesses(const std::vector<Started>& processes) {
  int running = 0;
  for (auto it = processes.rbegin(); it != processes.rend(); ++it) {  // workers first, the head last
    if (it->pid > 0 && ::kill(it->pid, 0) == 0 && RunsGeotrain(it->pid)) {
      ++running;
      ::kill(it->pid, SIGTERM);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const Started& p : processes) {
    while (p.pid > 0 && ::kill(p.pid, 0) == 0 && RunsGeotrain(p.pid)) {
      ::waitpid(p.pid, nullptr, WNOHANG);  // reap it if it is our child
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(p.pid, SIGKILL);
        ::waitpid(p.pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return running;
}

absl::StatusOr<v1::ClusterStatus> HeadStatus(const std::string& address, const std::string& tls_ca) {
  TlsFiles tls;
  if (!tls_ca.empty()) {  // --tls: mutual TLS; the CLI presents the nodes' certificate (valid for clients too)
    const std::string dir = std::filesystem::path(tls_ca).parent_path().string();
    tls = TlsFiles{.cert = dir + "/server.pem", .key = dir + "/server.key", .ca = tls_ca};
  }
  ASSIGN_OR_RETURN(const HeadClient client, ConnectToHead(address, "", tls));
  grpc::ClientContext ctx;
  v1::ClusterStatus status;
  grpc::Status s = client.cluster->GetClusterStatus(client.Prepare(&ctx, 3000), v1::GetClusterStatusRequest(), &status);
  if (!s.ok()) return FromGrpc(s);
  return status;
}

// `text` with every byte but unreserved ones (RFC 3986: letters, digits, -._~) percent-encoded, for a query value.
std::string UrlEncode(const std::string& text) {
  std::string out;
  for (const unsigned char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out;
}

// The head's dashboard as a link that logs in at once (`<url>?token=TOKEN`), or the reason there is none.
absl::StatusOr<std::string> DashboardLink(const std::string& address, const std::string& tls_ca,
                                          const std::string& token_file) {
  TlsFiles tls;
  if (!tls_ca.empty()) {
    const std::string dir = std::filesystem::path(tls_ca).parent_path().string();
    tls = TlsFiles{.cert = dir + "/server.pem", .key = dir + "/server.key", .ca = tls_ca};
  }
  ASSIGN_OR_RETURN(const std::string token, ReadTokenFile(token_file));
  ASSIGN_OR_RETURN(HeadClient client, ConnectToHead(address, token, tls));
  grpc::ClientContext ctx;
  v1::ClusterInfo info;
  if (grpc::Status s = client.cluster->GetClusterInfo(client.Prepare(&ctx, 3000), v1::GetClusterInfoRequest(), &info);
      !s.ok()) {
    return FromGrpc(s);
  }
  if (info.dashboard_url().empty()) return absl::NotFoundError("the head serves no dashboard (--dashboard-port -1)");
  return absl::StrCat(info.dashboard_url(), "?token=", UrlEncode(token));
}

// deploy/make-certs.sh: installed beside the binary's prefix, or in the source tree of a build.
std::string MakeCertsScript() {
  for (const std::string& candidate : {SelfDirectory() + "/../share/geotrain/make-certs.sh",
                                       std::string(GEOTRAIN_SOURCE_DIR_STR "/deploy/make-certs.sh")}) {
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Certificates for every node's addresses in <state_dir>/certs; returns the TLS flags every node gets (mutual TLS:
// each node's certificate is valid as a client's too).
absl::StatusOr<std::vector<std::string>> MakeClusterCertificates(const std::string& state_dir,
                                                                 const std::vector<std::string>& addresses) {
  const std::string script = MakeCertsScript();
  if (script.empty()) {
    return absl::NotFoundError("--tls: cannot find make-certs.sh (share/geotrain/ of the install, or deploy/)");
  }
  const std::string dir = state_dir + "/certs";
  std::vector<std::string> argv = {"/bin/bash", script, dir};
  argv.insert(argv.end(), addresses.begin(), addresses.end());
  ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, state_dir + "/logs/make-certs.log"));
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("--tls: ", script, " failed; see ", state_dir, "/logs/make-certs.log"));
  }
  return std::vector<std::string>{
      "--tls-cert",    dir + "/server.pem",        "--tls-key", dir + "/server.key", "--tls-ca",
      dir + "/ca.pem", "--tls-require-client-cert"};
}

// A worker `cluster up` starts: its id (SITE-INDEX), its port and devices, and the emulator routes that reach it
// from other sites.
struct PlannedWorker {
  std::string id, site;
  int port;
  std::optional<ReservedPort> reservation;  // until the worker starts (not with isolate: its own namespace)
  std::vector<std::string> devices;
  double slowdown = 1;                                // worker start --slowdown (1: not slowed)
  std::map<std::string, size_t> route_index_by_site;  // other site -> its route in the emulator's list
};

// Every topology worker as (site, SITE-INDEX), grouped by site in the topology's order.
std::vector<std::pair<std::string, std::string>> SiteWorkerIds(const Topology& topology) {
  std::vector<std::pair<std::string, std::string>> site_workers;
  for (const TopologySite& site : topology.sites()) {
    for (int i = 0; i < site.workers_size(); ++i) {
      site_workers.push_back({site.name(), absl::StrCat(site.name(), "-", i)});
    }
  }
  return site_workers;
}

// The factor each worker of `topology` is slowed by, by worker id (absent: not slowed), from `cluster up --slowdown`
// entries NAME=F: NAME a site (each of its workers) or a worker id (SITE-INDEX; it wins over its site's entry).
// Errors name the entry and the fix.
absl::StatusOr<std::map<std::string, double>> SlowdownByWorker(const std::vector<std::string>& entries,
                                                               const Topology& topology, bool timed_compute) {
  std::map<std::string, double> by_site, by_worker;
  for (const std::string& entry : entries) {
    const size_t eq = entry.find('=');
    double factor = 0;
    if (eq == std::string::npos || eq == 0 || !absl::SimpleAtod(entry.substr(eq + 1), &factor)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--slowdown '", entry, "': expected SITE=FACTOR or WORKER=FACTOR, e.g. amsterdam=2"));
    }
    RETURN_IF_ERROR(WithContext(worker::ValidateSlowdown(factor, timed_compute), "cluster up"));
    const std::string name = entry.substr(0, eq);
    bool known = false;
    for (const auto& [site, id] : SiteWorkerIds(topology)) {
      if (site == name) by_site[site] = factor;
      if (id == name) by_worker[id] = factor;
      known = known || site == name || id == name;
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("--slowdown '", entry, "': the topology has no site or worker ",
                                                     name, "; name a site, or a worker as SITE-INDEX (e.g. ",
                                                     topology.sites(0).name(), "-0)"));
    }
  }
  for (const auto& [site, id] : SiteWorkerIds(topology)) {
    if (!by_worker.count(id) && by_site.count(site)) by_worker[id] = by_site[site];
  }
  return by_worker;
}

// An error when the processes a cluster.json in `state_dir` records still run.
absl::Status CheckNoClusterUp(const std::string& state_dir) {
  absl::StatusOr<ClusterFile> existing = ReadClusterFile(state_dir);
  if (!existing.ok()) return absl::OkStatus();
  for (const Started& p : existing->processes) {
    if (p.pid > 0 && ::kill(p.pid, 0) == 0 && RunsGeotrain(p.pid)) {
      return absl::AlreadyExistsError(
          absl::StrCat("a cluster is already up (", state_dir, "); stop it first with `geotrain cluster down`"));
    }
  }
  return absl::OkStatus();
}

// One `cluster up` as it goes: what it planned and what it started so far (recorded in cluster.json as it starts
// each process), so that a failure stops exactly that. Used once, by one thread.
class ClusterLaunch {
 public:
  ClusterLaunch(std::string state_dir, const UpOptions& up, Topology topology, std::string topology_path,
                std::map<std::string, double> slowdown_by_worker)
      : state_dir_(std::move(state_dir)),
        up_(up),
        topology_(std::move(topology)),
        slowdown_by_worker_(std::move(slowdown_by_worker)),
        geotrain_(SelfDirectory() + "/geotrain"),
        netem_binary_(SelfDirectory() + "/geotrain-netem") {
    file_.topology = std::move(topology_path);
  }

  // Starts the emulator, the head and the workers, waits for every worker to join and prints what runs. On an
  // error after the network is made, stops what it started, removes the network and cluster.json.
  absl::Status Run() {
    if (up_.isolate) {
      RETURN_IF_ERROR(CheckIsolationAvailable(IsolationPrefix(state_dir_)));
      RETURN_IF_ERROR(MakeIsolatedNetwork());
    }
    RETURN_IF_ERROR(PlanWorkers());  // fails only picking ports, before anything runs (not with --isolate)
    if (absl::Status s = StartEverything(); !s.ok()) {
      StopStarted();
      return s;
    }
    PrintSummary();
    return absl::OkStatus();
  }

 private:
  absl::Status MakeIsolatedNetwork() {
    // Recorded before it is made: a crash in between still lets `cluster down` remove it.
    file_.isolation_prefix = IsolationPrefix(state_dir_);
    RETURN_IF_ERROR(WriteClusterFile(state_dir_, file_));
    absl::StatusOr<IsolatedNetwork> made = CreateIsolatedNetwork(file_.isolation_prefix, SiteWorkerIds(topology_));
    if (!made.ok()) {
      StopStarted();
      return made.status();
    }
    net_ = std::move(*made);
    return absl::OkStatus();
  }

  // Workers, their ports, and the emulator routes that reach them from other sites (a route per linked site).
  absl::Status PlanWorkers() {
    std::map<std::pair<std::string, std::string>, const TopologyLink*> links;  // by unordered site pair
    for (const TopologyLink& l : topology_.links()) links[std::minmax(l.a(), l.b())] = &l;
    size_t worker_index = 0;
    for (const TopologySite& site : topology_.sites()) {
      for (int i = 0; i < site.workers_size(); ++i) {
        PlannedWorker p;
        p.id = absl::StrCat(site.name(), "-", i);
        p.site = site.name();
        if (up_.isolate) {
          p.port = kIsolatedWorkerPort;  // its own namespace: the port is free
        } else {
          ASSIGN_OR_RETURN(ReservedPort port, ReservedPort::Pick());
          p.port = port.port();
          p.reservation = std::move(port);
        }
        const std::string host = up_.isolate ? net_.nodes[worker_index].ip : "127.0.0.1";
        ++worker_index;
        p.devices = TopologyWorkerDevices(site.workers(i));
        if (auto slowed = slowdown_by_worker_.find(p.id); slowed != slowdown_by_worker_.end()) {
          p.slowdown = slowed->second;
        }
        for (const TopologySite& other : topology_.sites()) {
          if (other.name() == site.name() || !links.count(std::minmax(other.name(), site.name()))) continue;
          netem::RouteSpec r;
          r.src_site = other.name();
          r.dst_site = site.name();
          r.target_host = host;
          r.target_port = p.port;
          p.route_index_by_site[other.name()] = routes_.size();
          routes_.push_back(r);
        }
        workers_.push_back(std::move(p));
      }
    }
    return absl::OkStatus();
  }

  // The emulator first (workers need its route ports), then the head, then the workers.
  absl::Status StartEverything() {
    RETURN_IF_ERROR(MakeCertificates());
    RETURN_IF_ERROR(StartEmulator());
    RETURN_IF_ERROR(StartHead());
    RETURN_IF_ERROR(StartWorkers());
    return WaitForWorkers();
  }

  // --tls: certificates for every address a node has, and the TLS flags every node gets.
  absl::Status MakeCertificates() {
    if (!up_.tls) return absl::OkStatus();
    std::vector<std::string> addresses;
    for (const auto& [site, gateway] : net_.gateway_by_site) addresses.push_back(gateway);
    for (const IsolatedNode& n : net_.nodes) addresses.push_back(n.ip);
    ASSIGN_OR_RETURN(tls_flags_, MakeClusterCertificates(state_dir_, addresses));
    file_.tls_ca = state_dir_ + "/certs/ca.pem";
    return absl::OkStatus();
  }

  absl::Status StartEmulator() {
    netem::EmulatorProcessSpec spec;
    spec.binary = netem_binary_;
    spec.topology_path = file_.topology;
    spec.routes = routes_;
    spec.ready_file = state_dir_ + "/netem.ready";
    if (up_.isolate) spec.listen_host = "0.0.0.0";  // each site reaches the routes at its bridge's address
    std::filesystem::remove(spec.ready_file);
    // A topology without links between sites (one site, or sites left unlinked) has no emulated traffic: no emulator.
    if (!routes_.empty()) {
      ASSIGN_OR_RETURN(pid_t pid, Spawn(netem::EmulatorCommandLine(spec), state_dir_ + "/logs/netem.log"));
      file_.processes.push_back({"netem", pid});
      absl::StatusOr<netem::ReadyInfo> ready = netem::WaitForReadyFile(spec.ready_file, std::chrono::seconds(15), pid);
      if (!ready.ok()) {
        return absl::UnavailableError(absl::StrCat("the WAN emulator did not start: ", ready.status().message(),
                                                   "; see ", state_dir_, "/logs/netem.log"));
      }
      emulator_ = *std::move(ready);
    }
    file_.netem_control_port = emulator_.control_port;
    return absl::OkStatus();
  }

  // Starts the head on free ports and waits (15 s at most) until it answers.
  absl::Status StartHead() {
    absl::StatusOr<ReservedPort> head_reserved = ReservedPort::Pick();
    absl::StatusOr<ReservedPort> metrics_reserved = ReservedPort::Pick();
    if (!head_reserved.ok() || !metrics_reserved.ok()) return absl::UnavailableError("no free ports");
    head_port_ = head_reserved->port();
    const int metrics_port = metrics_reserved->port();
    file_.head_address = absl::StrCat("127.0.0.1:", head_port_);
    std::vector<std::string> argv = {geotrain_,
                                     "head",
                                     "start",
                                     "--bind",
                                     up_.isolate ? "0.0.0.0" : "127.0.0.1",
                                     "--port",
                                     std::to_string(head_port_),
                                     "--metrics-port",
                                     std::to_string(metrics_port),
                                     "--metrics-bind",
                                     "127.0.0.1",
                                     "--topology",
                                     std::filesystem::absolute(file_.topology).string(),
                                     "--state-dir",
                                     state_dir_ + "/head"};
    argv.insert(argv.end(), tls_flags_.begin(), tls_flags_.end());
    head_reserved->Release();
    metrics_reserved->Release();
    ASSIGN_OR_RETURN(pid_t head_pid, Spawn(argv, state_dir_ + "/logs/head.log"));
    file_.processes.push_back({"head", head_pid});
    RETURN_IF_ERROR(WriteClusterFile(state_dir_, file_));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (!HeadStatus(file_.head_address, file_.tls_ca).ok()) {
      if (std::chrono::steady_clock::now() > deadline || ::waitpid(head_pid, nullptr, WNOHANG) != 0) {
        return absl::UnavailableError(absl::StrCat("the head did not start; see ", state_dir_, "/logs/head.log"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return absl::OkStatus();
  }

  absl::Status StartWorkers() {
    // Each worker's own disk: its state dir, and a copy of the token (the head's state dir may be hidden from it).
    absl::StatusOr<std::string> token = ReadSmallFile(state_dir_ + "/head/token");
    if (!token.ok()) return WithContext(token.status(), "reading the head's token");
    std::vector<std::string> hidden = {std::filesystem::absolute(state_dir_ + "/head").string()};
    for (const std::string& dir : up_.hidden) {
      hidden.push_back(std::filesystem::absolute(dir).lexically_normal().string());
    }
    for (const PlannedWorker& w : workers_) {
      // Made now: a directory that does not exist when a node starts is not covered in its view.
      std::filesystem::create_directories(absl::StrCat(state_dir_, "/nodes/", w.id));
      hidden.push_back(std::filesystem::absolute(absl::StrCat(state_dir_, "/nodes/", w.id)).string());
    }
    for (size_t i = 0; i < workers_.size(); ++i) {
      const std::string node_dir = absl::StrCat(state_dir_, "/nodes/", workers_[i].id);
      std::filesystem::create_directories(node_dir);
      RETURN_IF_ERROR(WriteFileAtomically(node_dir + "/token", *token, 0600));
      const std::vector<std::string> argv = WorkerCommandLine(i, node_dir, hidden);
      workers_[i].reservation.reset();
      ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, absl::StrCat(state_dir_, "/logs/worker-", workers_[i].id, ".log")));
      file_.processes.push_back({"worker " + workers_[i].id, pid});
      worker_pids_.push_back(pid);
    }
    return WriteClusterFile(state_dir_, file_);
  }

  // `geotrain worker start` for workers_[i], inside its isolated node with --isolate.
  std::vector<std::string> WorkerCommandLine(size_t i, const std::string& node_dir,
                                             const std::vector<std::string>& hidden) const {
    const PlannedWorker& w = workers_[i];
    const std::string head_address =
        up_.isolate ? absl::StrCat(net_.nodes[i].gateway, ":", head_port_) : file_.head_address;
    const std::string own_host = up_.isolate ? net_.nodes[i].ip : "127.0.0.1";
    std::vector<std::string> argv = {geotrain_,
                                     "worker",
                                     "start",
                                     "--head",
                                     head_address,
                                     "--site",
                                     w.site,
                                     "--bind",
                                     up_.isolate ? "0.0.0.0" : "127.0.0.1",
                                     "--port",
                                     std::to_string(w.port),
                                     "--advertise-address",
                                     absl::StrCat(own_host, ":", w.port),
                                     "--worker-id",
                                     w.id,
                                     "--metrics-port",
                                     "0",
                                     "--state-dir",
                                     node_dir,
                                     "--token-file",
                                     node_dir + "/token"};
    argv.insert(argv.end(), tls_flags_.begin(), tls_flags_.end());
    for (const std::string& d : w.devices) argv.insert(argv.end(), {"--emulate-device", d});
    if (up_.timed_compute) argv.push_back("--timed-compute");
    if (!up_.device_profiles.empty()) {
      argv.insert(argv.end(), {"--device-profiles", std::filesystem::absolute(up_.device_profiles).string()});
    }
    if (w.slowdown > 1) argv.insert(argv.end(), {"--slowdown", absl::StrCat(w.slowdown)});
    for (const auto& [site, index] : w.route_index_by_site) {
      // Peers at `site` dial the emulator's route at their own side: their bridge, or loopback.
      const auto gateway = net_.gateway_by_site.find(site);
      const std::string route_host = !up_.isolate                            ? "127.0.0.1"
                                     : gateway == net_.gateway_by_site.end() ? ""
                                                                             : gateway->second;
      argv.insert(argv.end(),
                  {"--advertise-for", absl::StrCat(site, "=", route_host, ":", emulator_.routes[index].bound_port)});
    }
    if (!up_.isolate) return argv;
    std::vector<std::string> others;
    const std::string own = std::filesystem::absolute(node_dir).string();
    for (const std::string& dir : hidden) {
      if (dir != own) others.push_back(dir);
    }
    // What the node is given: its own disk, and the files its command line names (the binary, TLS files, device
    // profiles); nothing else of /tmp, /home, /root, /srv or /var/lib/geotrain.
    std::vector<std::string> given = {own};
    for (const std::string& arg : argv) {
      if (absl::StartsWith(arg, "/") && std::filesystem::exists(arg)) given.push_back(arg);
    }
    return IsolatedCommand(net_.nodes[i], others, given, argv);
  }

  // Waits (60 s at most) until the head counts every worker alive; a worker that exits first fails it at once.
  absl::Status WaitForWorkers() const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (true) {
      absl::StatusOr<v1::ClusterStatus> status = HeadStatus(file_.head_address, file_.tls_ca);
      int alive = 0;
      if (status.ok()) {
        for (const v1::Worker& w : status->workers()) alive += w.state() == v1::WORKER_ALIVE;
      }
      if (alive == static_cast<int>(workers_.size())) return absl::OkStatus();
      for (size_t i = 0; i < workers_.size(); ++i) {
        // A worker that exits will never join: say why now rather than after the deadline.
        if (::waitpid(worker_pids_[i], nullptr, WNOHANG) == 0) continue;
        const std::string log = absl::StrCat(state_dir_, "/logs/worker-", workers_[i].id, ".log");
        const std::string why = LastLogLine(log);
        return absl::UnavailableError(absl::StrCat("worker ", workers_[i].id, " exited before it joined",
                                                   why.empty() ? "" : absl::StrCat(": ", why), "; see ", log));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("only ", alive, " of ", workers_.size(),
                                                        " workers joined within 60 s; see ", state_dir_, "/logs/"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  void PrintSummary() const {
    std::printf("cluster up: head at %s, %zu workers in %d sites, %s\n", file_.head_address.c_str(), workers_.size(),
                topology_.sites_size(),
                routes_.empty() ? "no WAN emulator (no links between sites)"
                                : absl::StrCat("WAN emulator with ", routes_.size(), " routes (control port ",
                                               file_.netem_control_port, ")")
                                      .c_str());
    if (up_.timed_compute) {
      std::printf(
          "  timed compute: every worker waits its emulated GPU's time instead of computing; step times are "
          "EMULATED and losses are not real\n");
    }
    std::string slowed;
    for (const PlannedWorker& w : workers_) {
      if (w.slowdown > 1) absl::StrAppend(&slowed, slowed.empty() ? "" : ", ", w.id, " ", w.slowdown, "x");
    }
    if (!slowed.empty()) {
      std::printf("  slowed CPUs (--slowdown): %s; their step times are EMULATED, their losses real\n", slowed.c_str());
    }
    for (const TopologyLink& l : topology_.links()) {
      std::printf("  link %s <-> %s: %.1f ms one way, %.0f Mbit/s, jitter %.1f ms\n", l.a().c_str(), l.b().c_str(),
                  l.latency_ms(), l.bandwidth_mbps(), l.jitter_ms());
    }
    if (up_.isolate) {
      std::printf("  isolated nodes (own network and mount namespaces, names %s-*):", file_.isolation_prefix.c_str());
      for (const IsolatedNode& n : net_.nodes) std::printf(" %s=%s", n.worker_id.c_str(), n.ip.c_str());
      std::printf("\n");
    }
    if (up_.tls) std::printf("  mutual TLS on every connection; certificates in %s/certs\n", state_dir_.c_str());
    std::printf(
        "state and logs in %s; `geotrain status` and `geotrain job submit` find it; stop it with "
        "`geotrain cluster down`\n",
        state_dir_.c_str());
    absl::StatusOr<std::string> link = DashboardLink(file_.head_address, file_.tls_ca, state_dir_ + "/head/token");
    if (!link.ok()) {
      std::printf("dashboard: no link (%s); `geotrain status` gives its address\n",
                  std::string(link.status().message()).c_str());
    } else {
      std::printf("dashboard (logs in with the cluster token): %s\n", link->c_str());
      if (up_.tls) {
        std::printf(
            "  mutual TLS: the browser must present a client certificate the cluster's CA signed (import %s"
            "/certs/client.pem and client.key into it)\n",
            state_dir_.c_str());
      }
    }
  }

  // After a failure: stops what started, removes the isolated network and cluster.json.
  void StopStarted() {
    StopProcesses(file_.processes);
    if (!file_.isolation_prefix.empty()) RemoveIsolatedNetwork(file_.isolation_prefix);
    std::filesystem::remove(ClusterFilePath(state_dir_));
  }

  const std::string state_dir_;
  const UpOptions& up_;
  const Topology topology_;
  const std::map<std::string, double> slowdown_by_worker_;  // --slowdown, by worker id
  const std::string geotrain_;                              // the binaries, beside this one
  const std::string netem_binary_;
  ClusterFile file_;     // what cluster.json records
  IsolatedNetwork net_;  // --isolate
  std::vector<PlannedWorker> workers_;
  std::vector<netem::RouteSpec> routes_;
  std::vector<std::string> tls_flags_;  // --tls: what every node is started with
  netem::ReadyInfo emulator_;           // its route ports (none without links between sites)
  int head_port_ = 0;
  std::vector<pid_t> worker_pids_;  // by index in workers_
};

absl::Status ClusterUp(const std::string& topology_path, const std::string& state_dir, const UpOptions& up) {
  if (!up.device_profiles.empty() && !up.timed_compute) {
    return absl::InvalidArgumentError("--device-profiles calibrates --timed-compute; add --timed-compute");
  }
  ASSIGN_OR_RETURN(Topology topology, LoadTopologyFile(topology_path));
  ASSIGN_OR_RETURN(auto slowdown_by_worker, SlowdownByWorker(up.slowdowns, topology, up.timed_compute));
  RETURN_IF_ERROR(CheckNoClusterUp(state_dir));
  std::filesystem::create_directories(state_dir + "/logs");
  ClusterLaunch launch(state_dir, up, std::move(topology), std::filesystem::absolute(topology_path).string(),
                       std::move(slowdown_by_worker));
  return launch.Run();
}

absl::Status ClusterDown(const std::string& state_dir) {
  ASSIGN_OR_RETURN(auto file, ReadClusterFile(state_dir));
  const int stopped = StopProcesses(file.processes);
  const int removed = file.isolation_prefix.empty() ? 0 : RemoveIsolatedNetwork(file.isolation_prefix);
  std::filesystem::remove(ClusterFilePath(state_dir));
  std::filesystem::remove(state_dir + "/netem.ready");
  std::printf("cluster down: stopped %d process(es) of %zu started", stopped, file.processes.size());
  if (!file.isolation_prefix.empty()) std::printf("; removed %d namespace(s) and link(s)", removed);
  std::printf("\n");
  return absl::OkStatus();
}

absl::Status ClusterShow(const std::string& state_dir) {
  ASSIGN_OR_RETURN(auto file, ReadClusterFile(state_dir));
  ASSIGN_OR_RETURN(auto topology, LoadTopologyFile(file.topology));
  ASSIGN_OR_RETURN(auto status, HeadStatus(file.head_address, file.tls_ca));
  std::map<std::pair<std::string, std::string>, v1::SiteLink> measured;
  for (const v1::SiteLink& l : status.site_links()) measured[{l.a(), l.b()}] = l;
  if (file.netem_control_port > 0) {
    std::printf("head %s; WAN emulator control port %d\n\n", file.head_address.c_str(), file.netem_control_port);
  } else {
    std::printf("head %s; no WAN emulator (no links between sites)\n\n", file.head_address.c_str());
  }
  std::printf("%-12s %-12s %10s %10s %12s %12s\n", "SITE A", "SITE B", "CONF MS", "MEAS MS", "CONF MBIT/S",
              "MEAS MBIT/S");
  for (const TopologyLink& l : topology.links()) {
    auto key = std::minmax(l.a(), l.b());
    auto it = measured.find({key.first, key.second});
    std::printf("%-12s %-12s %10.2f %10s %12.0f %12s\n", l.a().c_str(), l.b().c_str(), l.latency_ms(),
                it == measured.end() ? "-" : absl::StrCat(it->second.latency_ms()).substr(0, 6).c_str(),
                l.bandwidth_mbps(),
                it == measured.end() ? "-" : std::to_string(static_cast<int>(it->second.bandwidth_mbps())).c_str());
  }
  auto stats = file.netem_control_port > 0
                   ? netem::QueryStats(file.netem_control_port)
                   : absl::StatusOr<std::vector<netem::LinkDirectionStats>>(absl::NotFoundError("no emulator"));
  if (stats.ok()) {
    std::printf("\n%-24s %14s %8s\n", "EMULATED LINK", "BYTES", "CONNS");
    for (const netem::LinkDirectionStats& s : *stats) {
      std::printf("%-24s %14ld %8ld%s\n", absl::StrCat(s.src, " > ", s.dst).c_str(), static_cast<long>(s.bytes_out),
                  static_cast<long>(s.connections_active), s.up ? "" : "  (down)");
    }
  }
  int alive = 0;
  for (const v1::Worker& w : status.workers()) alive += w.state() == v1::WORKER_ALIVE;
  std::printf("\n%d of %d workers alive\n", alive, status.workers_size());
  return absl::OkStatus();
}

// --state-dir of the verbs that act on a cluster `cluster up` started.
void AddStateDirOfUp(CLI::App* cmd, std::string* state_dir) {
  cmd->add_option("--state-dir", *state_dir, "the state dir given to `cluster up`")->capture_default_str();
}

void AddClusterCommands(CLI::App& app, Context& context) {
  CLI::App* cluster = app.add_subcommand("cluster", "a whole multi-site cluster on this machine, WAN emulated");
  cluster->require_subcommand(1);
  auto state_dir = std::make_shared<std::string>(GeotrainHome() + "/cluster");
  auto topology = std::make_shared<std::string>();
  CLI::App* up = cluster->add_subcommand("up", "start a head, the WAN emulator and every site's workers");
  up->add_option("topology", *topology, "topology file (see deploy/topologies/)")->required();
  up->add_option("--state-dir", *state_dir, "where the cluster keeps its state and logs")->capture_default_str();
  auto up_options = std::make_shared<UpOptions>();
  up->add_flag("--isolate", up_options->isolate,
               "every worker in its own network namespace (own address) and mount namespace (own disk; needs root)");
  up->add_flag("--tls", up_options->tls, "make certificates and run every connection with mutual TLS");
  up->add_option("--hide", up_options->hidden,
                 "with --isolate: a directory the workers must not see besides those always hidden (the head's state "
                 "dir, the other workers' dirs, and everything under /tmp, /home, /root, /srv and /var/lib/geotrain "
                 "that a worker is not given); repeatable");
  AddTimedComputeFlag(up, &up_options->timed_compute);
  AddDeviceProfilesOption(up, &up_options->device_profiles);
  up->add_option("--slowdown", up_options->slowdowns,
                 "SITE=F or WORKER=F (SITE-INDEX): start that site's workers, or that worker, with `worker start "
                 "--slowdown F`, their CPUs F times slower, for sites of unequal speed with real numerics (repeatable; "
                 "docs/timed-compute.md)");
  up->callback([topology, state_dir, up_options, &context] {
    if (absl::Status s = ClusterUp(*topology, *state_dir, *up_options); !s.ok()) context.exit_code = Fail(s);
  });
  CLI::App* down = cluster->add_subcommand("down", "stop everything `cluster up` started");
  AddStateDirOfUp(down, state_dir.get());
  down->callback([state_dir, &context] {
    if (absl::Status s = ClusterDown(*state_dir); !s.ok()) context.exit_code = Fail(s);
  });
  CLI::App* status = cluster->add_subcommand("status", "links as configured and as measured, emulator traffic");
  AddStateDirOfUp(status, state_dir.get());
  status->callback([state_dir, &context] {
    if (absl::Status s = ClusterShow(*state_dir); !s.ok()) context.exit_code = Fail(s);
  });
}

bool registered = RegisterCommands("cluster", &AddClusterCommands);

}  // namespace
}  // namespace geotrain::cli
