// geotrain-netem as a child process: see process.h.
#include "netem/process.h"

#include <sys/wait.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "netem/strings.h"

namespace geotrain::netem {

std::vector<std::string> EmulatorCommandLine(const EmulatorProcessSpec& spec) {
  std::vector<std::string> argv = {
      spec.binary,     "--topology",    spec.topology_path, "--control-port", std::to_string(spec.control_port),
      "--listen-host", spec.listen_host};
  for (const RouteSpec& route : spec.routes) {
    argv.push_back("--route");
    argv.push_back(FormatRoute(route));
  }
  if (spec.metrics_port >= 0) {
    argv.push_back("--metrics-port");
    argv.push_back(std::to_string(spec.metrics_port));
  }
  if (!spec.ready_file.empty()) {
    argv.push_back("--ready-file");
    argv.push_back(spec.ready_file);
  }
  return argv;
}

absl::StatusOr<ReadyInfo> ParseReadyFile(std::string_view text) {
  ReadyInfo info;
  bool have_control = false;
  for (absl::string_view line : absl::StrSplit(ToAbsl(text), '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto bad = [&] { return absl::DataLossError(absl::StrCat("ready file: malformed line '", line, "'")); };
    if (words.size() == 2 && words[0] == "control_port") {
      if (!absl::SimpleAtoi(words[1], &info.control_port) || info.control_port <= 0 || info.control_port > 65535) {
        return bad();
      }
      have_control = true;
    } else if (words.size() == 2 && words[0] == "metrics_port") {
      if (!absl::SimpleAtoi(words[1], &info.metrics_port) || info.metrics_port <= 0 || info.metrics_port > 65535) {
        return bad();
      }
    } else if (words.size() == 3 && words[0] == "route") {
      absl::StatusOr<RouteSpec> route = ParseRoute(ToStd(words[1]));
      const size_t colon = words[2].rfind(':');
      RouteStatus status;
      if (!route.ok() || colon == absl::string_view::npos ||
          !absl::SimpleAtoi(words[2].substr(colon + 1), &status.bound_port) || status.bound_port <= 0 ||
          status.bound_port > 65535) {
        return bad();
      }
      status.spec = *route;
      info.routes.push_back(std::move(status));
    } else {
      return bad();
    }
  }
  if (!have_control) return absl::DataLossError("ready file: no control_port line");
  return info;
}

absl::StatusOr<ReadyInfo> WaitForReadyFile(const std::string& path, std::chrono::milliseconds timeout, pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      return ParseReadyFile(text.str());  // written by rename: complete when it exists
    }
    if (pid > 0) {
      siginfo_t info{};
      if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) {
        return absl::UnavailableError(
            absl::StrCat("geotrain-netem (pid ", pid, ") exited with status ", info.si_status,
                         " before it was ready; its stderr says why (port in use, unknown site, ...)"));
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("geotrain-netem did not write its ready file '", path,
                                                      "' within ", timeout.count(),
                                                      " ms; check its log, and that the folder is writable"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace geotrain::netem
