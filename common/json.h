// The one way geotrain writes JSON (the CLI's --json, the planner's output, the WAN emulator's stats, the dashboard):
// nlohmann's ordered_json, so keys stay in the order written, with figures rounded as the text output rounds them.
//
//   Json out;
//   out["step_seconds"] = JsonFigure(0.1234567, 6);     // 0.123457
//   out["bytes"] = JsonFigure(4096.0, "%.1f");          // 4096 (whole figures are integers)
//   std::cout << DumpJson(out) << "\n";                 // compact, and never throws on bad UTF-8
//
// Thread-safety: the functions keep no state.
#pragma once

#include <string>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace geotrain {

using Json = nlohmann::ordered_json;  // keys in the order written

// `x` rounded to `significant_digits` as a JSON number: an integer when the rounded figure is whole, null when x is
// not finite (JSON has no NaN or infinity).
Json JsonFigure(double x, int significant_digits);
// `x` as printf's `format` ("%.3f", "%g": one double) writes it, as a JSON number (integer when whole, null when not
// finite): the JSON says what the text output says.
Json JsonFigure(double x, const absl::FormatSpec<double>& format);

// Compact JSON; bytes that are not UTF-8 (a site or device name) become U+FFFD instead of an exception.
std::string DumpJson(const Json& json);

}  // namespace geotrain
