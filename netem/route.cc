// Route parsing: see route.h.
#include "netem/route.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "netem/strings.h"

namespace geotrain::netem {
namespace {

constexpr char kForm[] =
    "expected LISTEN_PORT=SRC_SITE>DST_SITE@TARGET_HOST:TARGET_PORT, e.g. "
    "7001=utah>amsterdam@127.0.0.1:9000";

absl::Status RouteError(absl::string_view text, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("route '", text, "': ", problem, "; ", kForm));
}

bool ParsePort(absl::string_view s, bool allow_zero, int* port) {
  int value = 0;
  if (!absl::SimpleAtoi(s, &value)) return false;
  if (value < (allow_zero ? 0 : 1) || value > 65535) return false;
  *port = value;
  return true;
}

}  // namespace

absl::StatusOr<RouteSpec> ParseRoute(std::string_view original) {
  const absl::string_view text = ToAbsl(original);
  absl::string_view t = absl::StripAsciiWhitespace(text);
  RouteSpec route;
  const size_t eq = t.find('=');
  if (eq == absl::string_view::npos) return RouteError(text, "no '=' after the listen port");
  if (!ParsePort(t.substr(0, eq), /*allow_zero=*/true, &route.listen_port)) {
    return RouteError(text, "the listen port must be a number from 0 to 65535");
  }
  absl::string_view rest = t.substr(eq + 1);
  const size_t at = rest.find('@');
  if (at == absl::string_view::npos) return RouteError(text, "no '@' before the target address");
  absl::string_view sites = rest.substr(0, at);
  absl::string_view target = rest.substr(at + 1);
  const size_t gt = sites.find('>');
  if (gt == absl::string_view::npos) return RouteError(text, "no '>' between the two sites");
  route.src_site = std::string(absl::StripAsciiWhitespace(sites.substr(0, gt)));
  route.dst_site = std::string(absl::StripAsciiWhitespace(sites.substr(gt + 1)));
  if (route.src_site.empty() || route.dst_site.empty()) return RouteError(text, "a site name is empty");
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos) return RouteError(text, "the target has no ':PORT'");
  route.target_host = std::string(target.substr(0, colon));
  if (route.target_host.size() >= 2 && route.target_host.front() == '[' && route.target_host.back() == ']') {
    route.target_host = route.target_host.substr(1, route.target_host.size() - 2);
  }
  if (route.target_host.empty()) return RouteError(text, "the target host is empty");
  if (!ParsePort(target.substr(colon + 1), /*allow_zero=*/false, &route.target_port)) {
    return RouteError(text, "the target port must be a number from 1 to 65535");
  }
  return route;
}

std::string FormatRoute(const RouteSpec& route) {
  const bool v6 = route.target_host.find(':') != std::string::npos;
  return absl::StrCat(route.listen_port, "=", route.src_site, ">", route.dst_site, "@", v6 ? "[" : "",
                      route.target_host, v6 ? "]" : "", ":", route.target_port);
}

absl::StatusOr<std::vector<RouteSpec>> LoadRoutesFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("routes file '", path, "' cannot be read; check the path and its permissions"));
  }
  std::vector<RouteSpec> routes;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.size() > 4096) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": line too long"));
    }
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l.front() == '#') continue;
    absl::StatusOr<RouteSpec> route = ParseRoute(ToStd(l));
    if (!route.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", route.status().message()));
    }
    routes.push_back(*std::move(route));
  }
  return routes;
}

}  // namespace geotrain::netem
