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
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/cluster_isolation.h"
#include "cli/registry.h"
#include "cli/support.h"
#include "common/rpc.h"
#include "common/spec.h"
#include "common/status.h"
#include "netem/control_client.h"
#include "netem/process.h"
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

// Starts argv[0] in its own session with stdout and stderr appended to `log`; returns its pid.
// The child runs only async-signal-safe calls: gRPC threads may hold allocator or stdio locks at fork.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
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
    ::execv(args[0], args.data());
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
  std::vector<std::string> hidden;  // --hide: directories the isolated workers must not see
  bool timed_compute = false;       // every worker's emulated devices on timed compute
  std::string device_profiles;      // their calibration file (worker start --device-profiles)
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

absl::Status ClusterUp(const std::string& topology_path, const std::string& state_dir, const UpOptions& up) {
  if (!up.device_profiles.empty() && !up.timed_compute) {
    return absl::InvalidArgumentError("--device-profiles calibrates --timed-compute; add --timed-compute");
  }
  ASSIGN_OR_RETURN(auto topology, LoadTopologyFile(topology_path));
  if (auto existing = ReadClusterFile(state_dir); existing.ok()) {
    for (const Started& p : existing->processes) {
      if (p.pid > 0 && ::kill(p.pid, 0) == 0 && RunsGeotrain(p.pid)) {
        return absl::AlreadyExistsError(
            absl::StrCat("a cluster is already up (", state_dir, "); stop it first with `geotrain cluster down`"));
      }
    }
  }
  std::filesystem::create_directories(state_dir + "/logs");
  const std::string bin = SelfDirectory();
  const std::string geotrain = bin + "/geotrain";
  const std::string netem_binary = bin + "/geotrain-netem";
  ClusterFile file;
  file.topology = std::filesystem::absolute(topology_path).string();
  auto fail = [&file, &state_dir](absl::Status s) {
    StopProcesses(file.processes);
    if (!file.isolation_prefix.empty()) RemoveIsolatedNetwork(file.isolation_prefix);
    std::filesystem::remove(ClusterFilePath(state_dir));
    return s;
  };
  if (up.isolate) RETURN_IF_ERROR(CheckIsolationAvailable(IsolationPrefix(state_dir)));

  // Links by unordered site pair.
  std::map<std::pair<std::string, std::string>, const TopologyLink*> links;
  for (const TopologyLink& l : topology.links()) {
    links[std::minmax(l.a(), l.b())] = &l;
  }

  // Workers, their ports, and the emulator routes that reach them from other sites.
  struct PlannedWorker {
    std::string id, site;
    int port;
    std::optional<ReservedPort> reservation;  // until the worker starts (not with isolate: its own namespace)
    std::vector<std::string> devices;
    std::map<std::string, size_t> route_index_by_site;
  };
  std::vector<PlannedWorker> workers;
  std::vector<netem::RouteSpec> routes;
  std::vector<std::pair<std::string, std::string>> site_workers;
  for (const TopologySite& site : topology.sites()) {
    for (int i = 0; i < site.workers_size(); ++i)
      site_workers.push_back({site.name(), absl::StrCat(site.name(), "-", i)});
  }
  IsolatedNetwork net;
  if (up.isolate) {
    // Recorded before it is made: a crash in between still lets `cluster down` remove it.
    file.isolation_prefix = IsolationPrefix(state_dir);
    RETURN_IF_ERROR(WriteClusterFile(state_dir, file));
    absl::StatusOr<IsolatedNetwork> made = CreateIsolatedNetwork(file.isolation_prefix, site_workers);
    if (!made.ok()) return fail(made.status());
    net = std::move(*made);
  }
  size_t worker_index = 0;
  for (const TopologySite& site : topology.sites()) {
    for (int i = 0; i < site.workers_size(); ++i) {
      const TopologyWorker& w = site.workers(i);
      PlannedWorker p;
      p.id = absl::StrCat(site.name(), "-", i);
      p.site = site.name();
      if (up.isolate) {
        p.port = kIsolatedWorkerPort;  // its own namespace: the port is free
      } else {
        ASSIGN_OR_RETURN(ReservedPort port, ReservedPort::Pick());
        p.port = port.port();
        p.reservation = std::move(port);
      }
      const std::string host = up.isolate ? net.nodes[worker_index].ip : "127.0.0.1";
      ++worker_index;
      p.devices = TopologyWorkerDevices(w);
      for (const TopologySite& other : topology.sites()) {
        if (other.name() == site.name() || !links.count(std::minmax(other.name(), site.name()))) continue;
        netem::RouteSpec r;
        r.src_site = other.name();
        r.dst_site = site.name();
        r.target_host = host;
        r.target_port = p.port;
        p.route_index_by_site[other.name()] = routes.size();
        routes.push_back(r);
      }
      workers.push_back(std::move(p));
    }
  }

  // The emulator first: workers need its route ports.
  netem::EmulatorProcessSpec netem_spec;
  netem_spec.binary = netem_binary;
  netem_spec.topology_path = file.topology;
  netem_spec.routes = routes;
  netem_spec.ready_file = state_dir + "/netem.ready";
  if (up.isolate) netem_spec.listen_host = "0.0.0.0";  // each site reaches the routes at its bridge's address
  std::vector<std::string> tls_flags;
  if (up.tls) {
    std::vector<std::string> addresses;
    for (const auto& [site, gateway] : net.gateway_by_site) addresses.push_back(gateway);
    for (const IsolatedNode& n : net.nodes) addresses.push_back(n.ip);
    absl::StatusOr<std::vector<std::string>> flags = MakeClusterCertificates(state_dir, addresses);
    if (!flags.ok()) return fail(flags.status());
    tls_flags = *flags;
    file.tls_ca = state_dir + "/certs/ca.pem";
  }
  std::filesystem::remove(netem_spec.ready_file);
  // A topology without links between sites (one site, or sites left unlinked) has no emulated traffic: no emulator.
  netem::ReadyInfo emulator;
  if (!routes.empty()) {
    auto netem_pid = Spawn(netem::EmulatorCommandLine(netem_spec), state_dir + "/logs/netem.log");
    if (!netem_pid.ok()) return fail(netem_pid.status());
    file.processes.push_back({"netem", *netem_pid});
    auto ready = netem::WaitForReadyFile(netem_spec.ready_file, std::chrono::seconds(15), *netem_pid);
    if (!ready.ok()) {
      return fail(absl::UnavailableError(absl::StrCat("the WAN emulator did not start: ", ready.status().message(),
                                                      "; see ", state_dir, "/logs/netem.log")));
    }
    emulator = *std::move(ready);
  }
  file.netem_control_port = emulator.control_port;

  absl::StatusOr<ReservedPort> head_reserved = ReservedPort::Pick();
  absl::StatusOr<ReservedPort> metrics_reserved = ReservedPort::Pick();
  if (!head_reserved.ok() || !metrics_reserved.ok()) return fail(absl::UnavailableError("no free ports"));
  const int head_port = head_reserved->port(), metrics_port = metrics_reserved->port();
  file.head_address = absl::StrCat("127.0.0.1:", head_port);
  std::vector<std::string> head_argv = {geotrain,
                                        "head",
                                        "start",
                                        "--bind",
                                        up.isolate ? "0.0.0.0" : "127.0.0.1",
                                        "--port",
                                        std::to_string(head_port),
                                        "--metrics-port",
                                        std::to_string(metrics_port),
                                        "--metrics-bind",
                                        "127.0.0.1",
                                        "--state-dir",
                                        state_dir + "/head"};
  head_argv.insert(head_argv.end(), tls_flags.begin(), tls_flags.end());
  head_reserved->Release();
  metrics_reserved->Release();
  auto head_pid = Spawn(head_argv, state_dir + "/logs/head.log");
  if (!head_pid.ok()) return fail(head_pid.status());
  file.processes.push_back({"head", *head_pid});
  if (absl::Status s = WriteClusterFile(state_dir, file); !s.ok()) return fail(s);
  const auto head_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (!HeadStatus(file.head_address, file.tls_ca).ok()) {
    if (std::chrono::steady_clock::now() > head_deadline || ::waitpid(*head_pid, nullptr, WNOHANG) != 0) {
      return fail(absl::UnavailableError(absl::StrCat("the head did not start; see ", state_dir, "/logs/head.log")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  // Each worker's own disk: its state dir, and a copy of the token (the head's state dir may be hidden from it).
  auto token = ReadSmallFile(state_dir + "/head/token");
  if (!token.ok()) return fail(WithContext(token.status(), "reading the head's token"));
  std::vector<std::string> hidden = {std::filesystem::absolute(state_dir + "/head").string()};
  for (const std::string& dir : up.hidden) hidden.push_back(std::filesystem::absolute(dir).lexically_normal().string());
  for (const PlannedWorker& w : workers) {
    // Made now: a directory that does not exist when a node starts is not covered in its view.
    std::filesystem::create_directories(absl::StrCat(state_dir, "/nodes/", w.id));
    hidden.push_back(std::filesystem::absolute(absl::StrCat(state_dir, "/nodes/", w.id)).string());
  }
  std::vector<pid_t> worker_pids;  // by index in workers
  for (size_t i = 0; i < workers.size(); ++i) {
    const PlannedWorker& w = workers[i];
    const std::string node_dir = absl::StrCat(state_dir, "/nodes/", w.id);
    std::filesystem::create_directories(node_dir);
    if (absl::Status s = WriteFileAtomically(node_dir + "/token", *token, 0600); !s.ok()) return fail(s);
    const std::string head_address =
        up.isolate ? absl::StrCat(net.nodes[i].gateway, ":", head_port) : file.head_address;
    const std::string own_host = up.isolate ? net.nodes[i].ip : "127.0.0.1";
    std::vector<std::string> argv = {geotrain,
                                     "worker",
                                     "start",
                                     "--head",
                                     head_address,
                                     "--site",
                                     w.site,
                                     "--bind",
                                     up.isolate ? "0.0.0.0" : "127.0.0.1",
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
    argv.insert(argv.end(), tls_flags.begin(), tls_flags.end());
    for (const std::string& d : w.devices) argv.insert(argv.end(), {"--emulate-device", d});
    if (up.timed_compute) argv.push_back("--timed-compute");
    if (!up.device_profiles.empty()) {
      argv.insert(argv.end(), {"--device-profiles", std::filesystem::absolute(up.device_profiles).string()});
    }
    for (const auto& [site, index] : w.route_index_by_site) {
      // Peers at `site` dial the emulator's route at their own side: their bridge, or loopback.
      const std::string route_host = up.isolate ? net.gateway_by_site[site] : "127.0.0.1";
      argv.insert(argv.end(),
                  {"--advertise-for", absl::StrCat(site, "=", route_host, ":", emulator.routes[index].bound_port)});
    }
    if (up.isolate) {
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
      argv = IsolatedCommand(net.nodes[i], others, given, argv);
    }
    workers[i].reservation.reset();
    auto pid = Spawn(argv, absl::StrCat(state_dir, "/logs/worker-", w.id, ".log"));
    if (!pid.ok()) return fail(pid.status());
    file.processes.push_back({"worker " + w.id, *pid});
    worker_pids.push_back(*pid);
  }
  if (absl::Status s = WriteClusterFile(state_dir, file); !s.ok()) return fail(s);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int alive = 0;
  while (true) {
    auto status = HeadStatus(file.head_address, file.tls_ca);
    alive = 0;
    if (status.ok()) {
      for (const v1::Worker& w : status->workers()) alive += w.state() == v1::WORKER_ALIVE;
    }
    if (alive == static_cast<int>(workers.size())) break;
    for (size_t i = 0; i < workers.size(); ++i) {
      // A worker that exits will never join: say why now rather than after the deadline.
      if (::waitpid(worker_pids[i], nullptr, WNOHANG) == 0) continue;
      const std::string log = absl::StrCat(state_dir, "/logs/worker-", workers[i].id, ".log");
      const std::string why = LastLogLine(log);
      return fail(absl::UnavailableError(absl::StrCat("worker ", workers[i].id, " exited before it joined",
                                                      why.empty() ? "" : absl::StrCat(": ", why), "; see ", log)));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return fail(absl::DeadlineExceededError(absl::StrCat("only ", alive, " of ", workers.size(),
                                                           " workers joined within 60 s; see ", state_dir, "/logs/")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::printf("cluster up: head at %s, %zu workers in %d sites, %s\n", file.head_address.c_str(), workers.size(),
              topology.sites_size(),
              routes.empty() ? "no WAN emulator (no links between sites)"
                             : absl::StrCat("WAN emulator with ", routes.size(), " routes (control port ",
                                            file.netem_control_port, ")")
                                   .c_str());
  if (up.timed_compute) {
    std::printf(
        "  timed compute: every worker waits its emulated GPU's time instead of computing; step times are "
        "EMULATED and losses are not real\n");
  }
  for (const TopologyLink& l : topology.links()) {
    std::printf("  link %s <-> %s: %.1f ms one way, %.0f Mbit/s, jitter %.1f ms\n", l.a().c_str(), l.b().c_str(),
                l.latency_ms(), l.bandwidth_mbps(), l.jitter_ms());
  }
  if (up.isolate) {
    std::printf("  isolated nodes (own network and mount namespaces, names %s-*):", file.isolation_prefix.c_str());
    for (const IsolatedNode& n : net.nodes) std::printf(" %s=%s", n.worker_id.c_str(), n.ip.c_str());
    std::printf("\n");
  }
  if (up.tls) std::printf("  mutual TLS on every connection; certificates in %s/certs\n", state_dir.c_str());
  std::printf(
      "state and logs in %s; `geotrain status` and `geotrain job submit` find it; stop it with "
      "`geotrain cluster down`\n",
      state_dir.c_str());
  return absl::OkStatus();
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
  up->add_flag("--timed-compute", up_options->timed_compute,
               "every worker waits its emulated GPU's time instead of computing (EMULATED step times, no real "
               "loss; docs/timed-compute.md)");
  up->add_option("--device-profiles", up_options->device_profiles,
                 "with --timed-compute: measured figures calibrating the emulated devices (JSON lines, e.g. "
                 "tests/gpu/run.sh's bench_gpu_step.json)");
  up->callback([topology, state_dir, up_options, &context] {
    if (absl::Status s = ClusterUp(*topology, *state_dir, *up_options); !s.ok()) context.exit_code = Fail(s);
  });
  CLI::App* down = cluster->add_subcommand("down", "stop everything `cluster up` started");
  down->add_option("--state-dir", *state_dir, "the state dir given to `cluster up`")->capture_default_str();
  down->callback([state_dir, &context] {
    if (absl::Status s = ClusterDown(*state_dir); !s.ok()) context.exit_code = Fail(s);
  });
  CLI::App* status = cluster->add_subcommand("status", "links as configured and as measured, emulator traffic");
  status->add_option("--state-dir", *state_dir, "the state dir given to `cluster up`")->capture_default_str();
  status->callback([state_dir, &context] {
    if (absl::Status s = ClusterShow(*state_dir); !s.ok()) context.exit_code = Fail(s);
  });
}

bool registered = RegisterCommands("cluster", &AddClusterCommands);

}  // namespace
}  // namespace geotrain::cli
