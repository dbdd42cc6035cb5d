#include "common/json.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>

namespace geotrain {
namespace {

Json FromText(double x, const std::string& text) {
  if (!std::isfinite(x)) return nullptr;
  const double rounded = std::strtod(text.c_str(), nullptr);
  if (rounded == std::trunc(rounded) && std::fabs(rounded) < 9.0e15) return static_cast<int64_t>(rounded);
  return rounded;
}

}  // namespace

Json JsonFigure(double x, int significant_digits) {
  return FromText(x, absl::StrFormat("%.*g", significant_digits, x));
}

Json JsonFigure(double x, const absl::FormatSpec<double>& format) { return FromText(x, absl::StrFormat(format, x)); }

std::string DumpJson(const Json& json) { return json.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace geotrain
