// Fuzzes the /metrics server's handling of a request head (common/metrics.h MetricsHttpResponse): whatever a
// client sends, the answer is one well-formed HTTP/1.1 response whose Content-Length is its body's.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "common/metrics.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view request = geotrain::fuzz::AsText(data, size);
  bool scraped = false;
  const std::string response = geotrain::MetricsHttpResponse(request, [&] {
    scraped = true;
    return std::string("geotrain_up 1\n");
  });
  FUZZ_CHECK(response.starts_with("HTTP/1.1 "), "status line");
  const size_t end = response.find("\r\n\r\n");
  FUZZ_CHECK(end != std::string::npos, "end of the response head");
  const size_t at = response.find("Content-Length: ");
  FUZZ_CHECK(at != std::string::npos && at < end, "Content-Length header");
  const size_t value = at + std::string_view("Content-Length: ").size();
  size_t length = 0;
  FUZZ_CHECK(absl::SimpleAtoi(response.substr(value, response.find("\r\n", value) - value), &length), "length");
  FUZZ_CHECK(length == response.size() - end - 4, "Content-Length matches the body");
  FUZZ_CHECK(scraped == response.starts_with("HTTP/1.1 200 "), "only a 200 answer scrapes");
  FUZZ_CHECK(!scraped || request.starts_with("GET /"), "only GET / and GET /metrics scrape");
  return 0;
}
