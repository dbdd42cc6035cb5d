// Routes: which local port the emulator listens on, which link direction the traffic crosses, and
// where it goes. A route is written LISTEN_PORT=SRC_SITE>DST_SITE@TARGET_HOST:TARGET_PORT:
//
//   7001=utah>amsterdam@127.0.0.1:9000
//
// means: a process at site utah connects to 127.0.0.1:7001 to reach the server at 127.0.0.1:9000 in
// site amsterdam; its bytes cross link utah>amsterdam and the replies cross amsterdam>utah.
// LISTEN_PORT 0 asks for a free port (see Emulator::Routes() for the one it got).
// A routes file holds one route per line; blank lines and lines starting with '#' are skipped.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain::netem {

struct RouteSpec {
  int listen_port = 0;
  std::string src_site;
  std::string dst_site;
  std::string target_host;
  int target_port = 0;

  bool operator==(const RouteSpec&) const = default;
};

// Parses "LISTEN_PORT=SRC>DST@HOST:PORT"; errors quote the text and show the expected form.
absl::StatusOr<RouteSpec> ParseRoute(std::string_view text);
// The inverse of ParseRoute.
std::string FormatRoute(const RouteSpec& route);
// Reads a routes file (one route per line, '#' comments); errors name the file and the line.
absl::StatusOr<std::vector<RouteSpec>> LoadRoutesFile(const std::string& path);

}  // namespace geotrain::netem
