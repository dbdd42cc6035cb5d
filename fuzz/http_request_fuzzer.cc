// Fuzzes the HTTP request parsing the head's HTTP server (common/http_server.h) applies to every connection before
// any handler runs (the dashboard's pages, its JSON endpoints, /metrics): whatever a client sends, parsing either
// refuses it or gives a request whose method, target and headers keep the promises handlers rely on, and
// FormParameter decodes any query without reading out of bounds.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/http_server.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view head = geotrain::fuzz::AsText(data, size);
  absl::StatusOr<geotrain::HttpRequest> request = geotrain::ParseHttpRequestHead(head);
  if (!request.ok()) {
    FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument, "a refusal is INVALID_ARGUMENT");
    FUZZ_CHECK(!request.status().message().empty(), "a refusal says what is wrong");
  } else {
    FUZZ_CHECK(!request->method.empty(), "a method");
    for (char c : request->method) FUZZ_CHECK(c >= 'A' && c <= 'Z', "the method is capital letters");
    FUZZ_CHECK(request->target.starts_with("/"), "the target is a path");
    FUZZ_CHECK(request->path.starts_with("/"), "the path starts with /");
    FUZZ_CHECK(request->target.starts_with(request->path), "the path is the target's start");
    for (const auto& [name, value] : request->headers) {
      for (char c : name) FUZZ_CHECK(!(c >= 'A' && c <= 'Z'), "header names are lower case");
    }
    (void)geotrain::FormParameter(request->query, "token");
    (void)request->Header("cookie");
  }
  // The same bytes as a form body (the login page's POST).
  const std::string token = geotrain::FormParameter(head, "token");
  FUZZ_CHECK(token.size() <= head.size(), "a decoded value is never longer than its encoding");
  return 0;
}
