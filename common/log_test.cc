// GT_LOG: one expression (safe under an unbraced if/else), operands of a dropped message not evaluated, one
// line per message on stderr.
#include "common/log.h"

#include <string>
#include <type_traits>

#include "gtest/gtest.h"

namespace geotrain {
namespace {

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = MinLogLevel(); }
  void TearDown() override { SetMinLogLevel(saved_); }

 private:
  LogLevel saved_ = LogLevel::kInfo;
};

TEST_F(LogTest, DroppedMessageDoesNotEvaluateItsOperands) {
  SetMinLogLevel(LogLevel::kError);
  int evaluated = 0;
  const auto count = [&evaluated] { return ++evaluated; };
  testing::internal::CaptureStderr();
  GT_LOG(INFO) << "dropped " << count();
  GT_LOG(WARNING) << "dropped " << count();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(evaluated, 0);
}

TEST_F(LogTest, WritesOneLineWithLevelFileAndMessage) {
  SetMinLogLevel(LogLevel::kInfo);
  testing::internal::CaptureStderr();
  GT_LOG(WARNING) << "disk " << 3 << " is full";
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.rfind("W ", 0), 0u) << out;
  EXPECT_NE(out.find("log_test.cc:"), std::string::npos) << out;
  EXPECT_NE(out.find("] disk 3 is full\n"), std::string::npos) << out;
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
}

// An expression, not a statement: the `if {} else` form this replaced cannot be used in a `decltype`.
static_assert(std::is_void_v<decltype(GT_LOG(INFO) << 1)>);

TEST_F(LogTest, IsOneExpressionUnderAnUnbracedIfElse) {
  SetMinLogLevel(LogLevel::kInfo);
  for (const bool bad : {true, false}) {
    int branch = 0;
    testing::internal::CaptureStderr();
    if (bad)
      GT_LOG(ERROR) << "bad";
    else
      branch = 2;
    const std::string out = testing::internal::GetCapturedStderr();
    EXPECT_EQ(branch, bad ? 0 : 2);
    EXPECT_EQ(out.empty(), !bad) << out;
  }
}

}  // namespace
}  // namespace geotrain
