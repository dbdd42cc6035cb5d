// Early returns on absl::Status and absl::StatusOr, the one error type of geotrain.
//
//   absl::Status Load(const std::string& path) {
//     RETURN_IF_ERROR(CheckPath(path));
//     ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
//     RETURN_IF_ERROR(WithContext(Parse(text), path));  // "path: what was wrong"
//     ...
//   }
//
// RETURN_IF_ERROR(expr): evaluates expr (an absl::Status, or anything with a .status()); returns it from
// the enclosing function when it is not OK. ASSIGN_OR_RETURN(lhs, expr): evaluates expr (an
// absl::StatusOr<T>); returns its status when not OK, else moves the value into lhs, which may be a
// declaration (`auto x`, `std::string s`) or an existing variable. The enclosing function must return
// absl::Status or an absl::StatusOr<U>. Context is added by the callee (errors name what failed and the
// fix), or with WithContext below; there is no stream syntax.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace geotrain {
namespace status_internal {

inline const absl::Status& AsStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace status_internal

// The status with `context` prepended to its message ("context: message"); OK stays OK.
inline absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace geotrain

#define GEOTRAIN_STATUS_CONCAT_INNER(a, b) a##b
#define GEOTRAIN_STATUS_CONCAT(a, b) GEOTRAIN_STATUS_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                                                                                      \
  do {                                                                                                             \
    if (const absl::Status geotrain_status = ::geotrain::status_internal::AsStatus(expr); !geotrain_status.ok()) { \
      return geotrain_status;                                                                                      \
    }                                                                                                              \
  } while (false)

#define GEOTRAIN_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  GEOTRAIN_ASSIGN_OR_RETURN_IMPL(GEOTRAIN_STATUS_CONCAT(geotrain_statusor_, __LINE__), lhs, expr)
