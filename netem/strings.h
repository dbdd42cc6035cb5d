// Debian's Abseil keeps its own absl::string_view (not an alias of std::string_view); geotrain's
// public headers use std::string_view. These two helpers cross between them without copying.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace geotrain::netem {

inline absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }
inline std::string_view ToStd(absl::string_view s) { return std::string_view(s.data(), s.size()); }

}  // namespace geotrain::netem
