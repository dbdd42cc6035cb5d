// Route parsing and routes files: the accepted form and the errors.
#include "netem/route.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace geotrain::netem {
namespace {

using ::testing::HasSubstr;

TEST(RouteTest, ParsesAndFormats) {
  absl::StatusOr<RouteSpec> r = ParseRoute("7001=utah>amsterdam@127.0.0.1:9000");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->listen_port, 7001);
  EXPECT_EQ(r->src_site, "utah");
  EXPECT_EQ(r->dst_site, "amsterdam");
  EXPECT_EQ(r->target_host, "127.0.0.1");
  EXPECT_EQ(r->target_port, 9000);
  EXPECT_EQ(FormatRoute(*r), "7001=utah>amsterdam@127.0.0.1:9000");
  absl::StatusOr<RouteSpec> v6 = ParseRoute("0=a>b@[::1]:80");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->target_host, "::1");
  EXPECT_EQ(FormatRoute(*v6), "0=a>b@[::1]:80");
  EXPECT_EQ(*ParseRoute(FormatRoute(*v6)), *v6);
}

TEST(RouteTest, RejectsMalformedRoutesWithTheExpectedForm) {
  for (const char* bad : {"", "7001", "7001=a>b", "7001=ab@h:1", "x=a>b@h:1", "70000=a>b@h:1", "1=a>b@h:0", "1=a>b@h",
                          "1=>b@h:2", "1=a>@h:2", "1=a>b@:2"}) {
    absl::StatusOr<RouteSpec> r = ParseRoute(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("LISTEN_PORT=SRC_SITE>DST_SITE")) << bad;
  }
}

TEST(RouteTest, RoutesFileSkipsCommentsAndNamesTheBadLine) {
  const std::string path = ::testing::TempDir() + "/routes.txt";
  {
    std::ofstream out(path);
    out << "# routes\n\n7001=a>b@127.0.0.1:9000\n  7002=b>a@127.0.0.1:9001  \n";
  }
  absl::StatusOr<std::vector<RouteSpec>> routes = LoadRoutesFile(path);
  ASSERT_TRUE(routes.ok()) << routes.status();
  ASSERT_EQ(routes->size(), 2u);
  EXPECT_EQ((*routes)[1].listen_port, 7002);
  {
    std::ofstream out(path);
    out << "7001=a>b@127.0.0.1:9000\nnonsense\n";
  }
  routes = LoadRoutesFile(path);
  ASSERT_FALSE(routes.ok());
  EXPECT_THAT(std::string(routes.status().message()), HasSubstr("routes.txt:2"));
  EXPECT_FALSE(LoadRoutesFile(path + ".missing").ok());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace geotrain::netem
