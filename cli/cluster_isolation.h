// Nodes on one machine that share nothing but the kernel (`geotrain cluster up --isolate`): every worker runs in
// its own network namespace with its own IP address, behind a veth pair on its site's bridge, and in its own mount
// namespace in which the directories that only the head should see (its state dir, the jobs' data and checkpoint
// dirs, the other workers' dirs) are covered by an empty tmpfs.
//
// Addresses: site s (0-based) is 10.N.(s+1).0/24 with N picked so that no address of this machine is in 10.N/16;
// the bridge of site s holds 10.N.(s+1).1 (in the root namespace, where the head and the WAN emulator run), worker
// i of the site 10.N.(s+1).(10+i). Forwarding between the bridges is not enabled, so a worker reaches another site
// only through the WAN emulator's routes (which listen on every bridge address) and reaches the head at its own
// bridge's address.
//
//   ASSIGN_OR_RETURN(IsolatedNetwork net, CreateIsolatedNetwork(prefix, sites));  // after CheckIsolationAvailable
//   argv = IsolatedCommand(net.nodes[0], hidden_dirs, argv);                      // runs argv inside the node
//   RemoveIsolatedNetwork(prefix);                                                 // cluster down, or a failed up
//
// Every namespace, bridge and veth is named with `prefix` (e.g. "gt3fa2"), so removal finds them all even after a
// crash. Mounts live and die with the node's processes. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip`.
// Not thread-safe: one `cluster up` or `down` at a time per prefix.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain::cli {

struct IsolatedNode {
  std::string worker_id;
  std::string site;
  std::string netns;    // the network namespace (ip netns NAME)
  std::string ip;       // its address
  std::string gateway;  // its site bridge's address: the head and the emulator's routes, seen from the node
};

struct IsolatedNetwork {
  std::string prefix;
  std::map<std::string, std::string> gateway_by_site;  // site -> its bridge's address
  std::vector<IsolatedNode> nodes;                     // in the order asked for
};

// A name prefix for `state_dir`'s cluster: "gt" and 4 hex digits (interface names are limited to 15 characters).
std::string IsolationPrefix(const std::string& state_dir);

// OK when network namespaces, bridges and mounts can be made here; otherwise one line saying why and how to run
// without --isolate.
absl::Status CheckIsolationAvailable(const std::string& prefix);

// Makes the bridges, namespaces and veth pairs for `workers` (site and worker id, grouped by site in order).
// On error, removes what it made.
absl::StatusOr<IsolatedNetwork> CreateIsolatedNetwork(const std::string& prefix,
                                                      const std::vector<std::pair<std::string, std::string>>& workers);

// Removes every namespace and link named with `prefix`; returns how many it removed.
int RemoveIsolatedNetwork(const std::string& prefix);

// Where users keep their own files: an isolated node sees none of it but what it is given (its own disk, its
// binary and the files its command line names), whatever --hide says. The system's files stay visible read-only
// as they are (the node runs the machine's programs and libraries).
inline constexpr const char* kPrivateRoots[] = {"/tmp", "/home", "/root", "/srv", "/var/lib/geotrain"};

// argv that runs `argv` inside `node`: its network namespace, and a mount namespace of its own in which each of
// kPrivateRoots is replaced by an empty read-only tmpfs holding only the `given` paths under it (bound back from
// the real files, writable as they were), and each of `hidden` (directories that exist elsewhere) is covered by an
// empty read-only tmpfs. `argv[0]` and every path are absolute.
std::vector<std::string> IsolatedCommand(const IsolatedNode& node, const std::vector<std::string>& hidden,
                                         const std::vector<std::string>& given, const std::vector<std::string>& argv);

// The absolute path of the `ip` tool ("" when not found).
std::string IpTool();

}  // namespace geotrain::cli
