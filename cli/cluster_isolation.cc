// Network and mount namespaces for `cluster up --isolate` (see cluster_isolation.h).
#include "cli/cluster_isolation.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace geotrain::cli {
namespace {

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Runs a command and returns its output (stdout and stderr); an error carries the output.
absl::StatusOr<std::string> RunTool(const std::vector<std::string>& argv) {
  std::vector<std::string> quoted;
  for (const std::string& a : argv) quoted.push_back(ShellQuote(a));
  const std::string command = absl::StrCat(absl::StrJoin(quoted, " "), " 2>&1");
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError(absl::StrCat("cannot run ", argv[0]));
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  const int rc = ::pclose(pipe);
  if (rc != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` failed: ", absl::StripTrailingAsciiWhitespace(output)));
  }
  return output;
}

absl::Status Ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {IpTool()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunTool(argv).status();
}

// The second octet of a 10.N/16 range no address of this machine is in.
absl::StatusOr<int> FreeSubnet() {
  ASSIGN_OR_RETURN(std::string addresses, RunTool({IpTool(), "-o", "-4", "addr", "show"}));
  ASSIGN_OR_RETURN(std::string routes, RunTool({IpTool(), "-4", "route", "show"}));
  for (int n = 177; n < 250; ++n) {
    const std::string range = absl::StrCat(" 10.", n, ".");
    if (addresses.find(range) == std::string::npos && routes.find(absl::StrCat("10.", n, ".")) == std::string::npos) {
      return n;
    }
  }
  return absl::ResourceExhaustedError("no free 10.N.0.0/16 range for the isolated nodes' addresses");
}

}  // namespace

std::string IpTool() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return "";
}

std::string IsolationPrefix(const std::string& state_dir) {
  uint32_t hash = 2166136261u;  // FNV-1a
  for (unsigned char c : state_dir) hash = (hash ^ c) * 16777619u;
  return absl::StrFormat("gt%04x", hash & 0xffff);
}

absl::Status CheckIsolationAvailable(const std::string& prefix) {
  auto unavailable = [](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--isolate needs network and mount namespaces (root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, and the `ip` tool): ",
        why, "; run `geotrain cluster up TOPOLOGY` without --isolate (every node on 127.0.0.1)"));
  };
  if (IpTool().empty()) return unavailable("no `ip` tool (install iproute2)");
  const std::string probe = absl::StrCat(prefix, "-probe");
  (void)Ip({"netns", "del", probe});
  if (absl::Status s = Ip({"netns", "add", probe}); !s.ok()) return unavailable(std::string(s.message()));
  absl::StatusOr<std::string> mounted =
      RunTool({IpTool(), "netns", "exec", probe, "sh", "-c", "mount -t tmpfs geotrain-probe /mnt && umount /mnt"});
  (void)Ip({"netns", "del", probe});
  if (!mounted.ok()) return unavailable(std::string(mounted.status().message()));
  return absl::OkStatus();
}

absl::StatusOr<IsolatedNetwork> CreateIsolatedNetwork(const std::string& prefix,
                                                      const std::vector<std::pair<std::string, std::string>>& workers) {
  RemoveIsolatedNetwork(prefix);  // leftovers of a crashed run with the same state dir
  ASSIGN_OR_RETURN(int octet, FreeSubnet());
  IsolatedNetwork net;
  net.prefix = prefix;
  auto fail = [&prefix](absl::Status s) {
    RemoveIsolatedNetwork(prefix);
    return WithContext(s, "making the isolated nodes' network");
  };
  std::map<std::string, int> site_index;
  std::map<std::string, int> next_host;
  for (const auto& [site, worker_id] : workers) {
    if (!site_index.count(site)) {
      const int s = static_cast<int>(site_index.size());
      site_index[site] = s;
      const std::string bridge = absl::StrCat(prefix, "-b", s);
      const std::string gateway = absl::StrCat("10.", octet, ".", s + 1, ".1");
      for (const std::vector<std::string>& args :
           std::vector<std::vector<std::string>>{{"link", "add", bridge, "type", "bridge"},
                                                 {"addr", "add", gateway + "/24", "dev", bridge},
                                                 {"link", "set", bridge, "up"}}) {
        if (absl::Status st = Ip(args); !st.ok()) return fail(st);
      }
      net.gateway_by_site[site] = gateway;
    }
    const int s = site_index[site];
    const int host = 10 + next_host[site]++;
    IsolatedNode node;
    node.worker_id = worker_id;
    node.site = site;
    node.netns = absl::StrCat(prefix, "-", worker_id);
    node.ip = absl::StrCat("10.", octet, ".", s + 1, ".", host);
    node.gateway = net.gateway_by_site[site];
    const std::string veth = absl::StrCat(prefix, "v", s, "x", host);
    for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
             {"netns", "add", node.netns},
             {"link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns},
             {"link", "set", veth, "master", absl::StrCat(prefix, "-b", s), "up"},
             {"-n", node.netns, "link", "set", "lo", "up"},
             {"-n", node.netns, "addr", "add", node.ip + "/24", "dev", "eth0"},
             {"-n", node.netns, "link", "set", "eth0", "up"},
             {"-n", node.netns, "route", "add", "default", "via", node.gateway}}) {
      if (absl::Status st = Ip(args); !st.ok()) return fail(st);
    }
    net.nodes.push_back(std::move(node));
  }
  return net;
}

int RemoveIsolatedNetwork(const std::string& prefix) {
  if (IpTool().empty() || prefix.size() < 4) return 0;
  int removed = 0;
  if (absl::StatusOr<std::string> names = RunTool({IpTool(), "netns", "list"}); names.ok()) {
    for (absl::string_view line : absl::StrSplit(*names, '\n', absl::SkipEmpty())) {
      const std::string name(line.substr(0, line.find(' ')));
      if (absl::StartsWith(name, prefix + "-")) removed += Ip({"netns", "del", name}).ok();
    }
  }
  // Deleting a namespace deletes its end of each veth pair, and with it the other end; bridges go by name.
  if (absl::StatusOr<std::string> links = RunTool({IpTool(), "-o", "link", "show"}); links.ok()) {
    for (absl::string_view line : absl::StrSplit(*links, '\n', absl::SkipEmpty())) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() < 2) continue;
      std::string name = fields[1];
      name = name.substr(0, name.find_first_of(":@"));
      if (absl::StartsWith(name, prefix)) removed += Ip({"link", "del", name}).ok();
    }
  }
  return removed;
}

namespace {

bool Under(const std::string& path, const std::string& root) {
  return path == root || absl::StartsWith(path, absl::StrCat(root, "/"));
}

}  // namespace

std::vector<std::string> IsolatedCommand(const IsolatedNode& node, const std::vector<std::string>& hidden,
                                         const std::vector<std::string>& given, const std::vector<std::string>& argv) {
  // `ip netns exec` gives the command a mount namespace of its own (mounts do not propagate back). The script binds
  // each given path under a private root to a staging tmpfs on /mnt (private to the namespace too), replaces the
  // private roots by empty tmpfs, binds the given paths back at their places (mount points made in the new tmpfs),
  // makes the roots read-only, covers the hidden directories, then becomes the command (same pid, so `cluster down`
  // finds it). Any step that fails ends the node with that mount's error rather than run it half-hidden.
  std::vector<std::string> kept;
  for (const std::string& g : given) {
    for (const char* root : kPrivateRoots) {
      if (Under(g, root) && g != root) kept.push_back(g);
    }
  }
  std::string script = "set -e; keep=/mnt; mount -t tmpfs -o size=64k,mode=0700 geotrain-keep \"$keep\"; ";
  for (size_t i = 0; i < kept.size(); ++i) {
    const std::string g = ShellQuote(kept[i]);
    absl::StrAppend(&script, "if [ -d ", g, " ]; then mkdir \"$keep/", i, "\"; else touch \"$keep/", i, "\"; fi; ",
                    "mount --bind ", g, " \"$keep/", i, "\"; ");
  }
  std::vector<std::string> roots;
  for (const char* root : kPrivateRoots) {
    if (std::filesystem::is_directory(root) && !std::filesystem::is_symlink(root)) roots.push_back(root);
  }
  for (const std::string& r : roots)
    absl::StrAppend(&script, "mount -t tmpfs -o size=1m,mode=0755 geotrain-private ", r, "; ");
  for (size_t i = 0; i < kept.size(); ++i) {
    const std::string g = ShellQuote(kept[i]);
    absl::StrAppend(&script, "if [ -d \"$keep/", i, "\" ]; then mkdir -p ", g, "; else mkdir -p \"$(dirname ", g,
                    ")\"; touch ", g, "; fi; mount --bind \"$keep/", i, "\" ", g, "; ");
  }
  // Source and target both given: mount does not look the target up in the host's fstab (whose options for it,
  // e.g. a btrfs subvol, tmpfs would refuse).
  for (const std::string& r : roots)
    absl::StrAppend(&script, "mount -t tmpfs -o remount,ro geotrain-private ", r, "; ");
  absl::StrAppend(&script, "umount -l \"$keep\"; ");
  for (const std::string& h : hidden) {
    const std::string q = ShellQuote(h);
    absl::StrAppend(&script, "if [ -d ", q, " ]; then mount -t tmpfs -o ro,size=4k,mode=0555 geotrain-hidden ", q,
                    "; fi; ");
  }
  absl::StrAppend(&script, "exec \"$@\"");
  std::vector<std::string> out = {IpTool(), "netns", "exec", node.netns, "/bin/sh", "-c", script, "geotrain-node"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

}  // namespace geotrain::cli
