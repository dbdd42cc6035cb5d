// RETURN_IF_ERROR, ASSIGN_OR_RETURN and WithContext.
#include "common/status.h"

#include <string>

#include "gtest/gtest.h"

namespace geotrain {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status CheckEven(int x) { return Half(x).status(); }

absl::StatusOr<int> Quarter(int x, int* calls) {
  ++*calls;
  ASSIGN_OR_RETURN(int half, Half(x));
  ++*calls;
  ASSIGN_OR_RETURN(half, Half(half));  // an existing variable
  return half;
}

absl::Status Both(int a, int b, int* reached) {
  RETURN_IF_ERROR(CheckEven(a));
  *reached = 1;
  RETURN_IF_ERROR(Half(b));  // a StatusOr works too
  *reached = 2;
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnStopsAtTheFirstError) {
  int calls = 0;
  EXPECT_EQ(*Quarter(8, &calls), 2);
  EXPECT_EQ(calls, 2);
  calls = 0;
  absl::StatusOr<int> odd = Quarter(6, &calls);  // 6 -> 3, then odd
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 2);
  calls = 0;
  EXPECT_FALSE(Quarter(5, &calls).ok());
  EXPECT_EQ(calls, 1);
}

TEST(StatusMacros, ReturnIfErrorReturnsTheStatus) {
  int reached = 0;
  EXPECT_TRUE(Both(2, 4, &reached).ok());
  EXPECT_EQ(reached, 2);
  reached = 0;
  EXPECT_EQ(Both(1, 4, &reached).message(), "odd");
  EXPECT_EQ(reached, 0);
  EXPECT_EQ(Both(2, 3, &reached).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, WithContextPrependsAndKeepsTheCode) {
  EXPECT_TRUE(WithContext(absl::OkStatus(), "loading").ok());
  absl::Status s = WithContext(absl::NotFoundError("no such file"), "loading spec.yaml");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "loading spec.yaml: no such file");
}

}  // namespace
}  // namespace geotrain
