// Talking to a running geotrain-netem from another process (the `geotrain cluster` verbs, scripts,
// tests): send one control command, get its output; read the stats back as structs.
//
//   absl::StatusOr<std::string> out = SendControlCommand(port, "link down utah amsterdam");
//   absl::StatusOr<std::vector<LinkDirectionStats>> stats = QueryStats(port);
//
// The protocol is line based: a command line in, its output lines back, then "ok" or a single
// "error: MESSAGE" line. `nc 127.0.0.1 PORT` works too.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "netem/emulator.h"

namespace geotrain::netem {

// Connects to host:port, sends `command`, returns the output without the final "ok" line. An
// "error: ..." reply becomes an error status carrying the message. Gives up after `timeout`.
absl::StatusOr<std::string> SendControlCommand(int port, std::string_view command,
                                               std::chrono::milliseconds timeout = std::chrono::milliseconds(5000),
                                               const std::string& host = "127.0.0.1");

// Parses the text of `stats` (FormatStatsText) back into structs; rejects malformed lines.
absl::StatusOr<std::vector<LinkDirectionStats>> ParseStatsText(std::string_view text);

// SendControlCommand(port, "stats") + ParseStatsText.
absl::StatusOr<std::vector<LinkDirectionStats>> QueryStats(
    int port, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

}  // namespace geotrain::netem
