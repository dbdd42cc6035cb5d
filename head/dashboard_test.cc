// The dashboard's HTTP surface: logging in (form and link), the session cookie (HttpOnly, SameSite, Secure under
// TLS, forged or expired ones refused), 401s and redirects without the token, CSRF checks on POSTs, size limits and
// security headers; then a real head serving it next to /metrics (JSON of the public API, submit and cancel through
// it, /metrics unchanged), and the MFU and configured-link figures it shows.
#include "head/dashboard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "head/dashboard_figures.h"
#include "head/head_server.h"

namespace geotrain::head {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr char kToken[] = "dashboard-token-0123456789abcdef";

HttpRequest Request(std::string method, std::string target,
                    std::vector<std::pair<std::string, std::string>> headers = {}, std::string body = "") {
  HttpRequest r;
  r.method = std::move(method);
  r.target = target;
  const size_t question = target.find('?');
  r.path = target.substr(0, question);
  if (question != std::string::npos) r.query = target.substr(question + 1);
  r.headers = std::move(headers);
  r.headers.emplace_back("host", "127.0.0.1:9470");
  r.body = std::move(body);
  return r;
}

std::string HeaderOf(const HttpResponse& response, const std::string& name) {
  for (const auto& [key, value] : response.headers) {
    if (key == name) return value;
  }
  return "";
}

// "name=value" of a Set-Cookie header.
std::string CookieOf(const HttpResponse& response) {
  const std::string set = HeaderOf(response, "Set-Cookie");
  return set.substr(0, set.find(';'));
}

class DashboardAuthTest : public ::testing::Test {
 protected:
  FakeClock clock_;
  Dashboard dashboard_{DashboardOptions{.token = kToken, .clock = &clock_}};
  const std::pair<std::string, std::string> origin_{"origin", "http://127.0.0.1:9470"};

  std::string LogIn() {
    HttpResponse r = dashboard_.Respond(Request("POST", "/login", {origin_}, absl::StrCat("token=", kToken)));
    EXPECT_EQ(r.status, 303);
    return CookieOf(r);
  }
};

TEST_F(DashboardAuthTest, WithoutTheTokenPagesRedirectToTheLoginPageAndTheApiIs401) {
  for (const char* page : {"/", "/jobs", "/job?id=job-000001", "/plan", "/static/job.js", "/nowhere"}) {
    HttpResponse r = dashboard_.Respond(Request("GET", page));
    EXPECT_EQ(r.status, 303) << page;
    EXPECT_EQ(HeaderOf(r, "Location"), "/login") << page;
  }
  for (const char* api : {"/api/cluster", "/api/jobs", "/api/job?id=job-000001", "/api/events?id=job-000001"}) {
    HttpResponse r = dashboard_.Respond(Request("GET", api));
    EXPECT_EQ(r.status, 401) << api;
    EXPECT_THAT(r.body, Not(HasSubstr("job-000001")));
    r = dashboard_.Respond(Request("GET", api, {{"authorization", "Bearer wrong"}}));
    EXPECT_EQ(r.status, 401) << api;
  }
  EXPECT_EQ(dashboard_
                .Respond(Request("POST", "/api/cancel", {origin_, {"content-type", "application/json"}},
                                 R"({"job_id":"job-000001"})"))
                .status,
            401);
  HttpResponse login = dashboard_.Respond(Request("GET", "/login"));
  EXPECT_EQ(login.status, 200);
  EXPECT_THAT(login.body, AllOf(HasSubstr("<form method=\"post\" action=\"/login\">"), HasSubstr("name=\"token\"")));
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/static/style.css")).status, 200);  // the login page's looks
}

TEST_F(DashboardAuthTest, TheLoginFormSetsAnHttpOnlyStrictCookieThatOpensThePages) {
  HttpResponse r = dashboard_.Respond(Request("POST", "/login", {origin_}, absl::StrCat("token=", kToken)));
  ASSERT_EQ(r.status, 303);
  EXPECT_EQ(HeaderOf(r, "Location"), "/");
  const std::string set = HeaderOf(r, "Set-Cookie");
  EXPECT_THAT(set, AllOf(StartsWith("geotrain_session_9470="), HasSubstr("HttpOnly"), HasSubstr("SameSite=Strict"),
                         HasSubstr("Path=/"), Not(HasSubstr("Secure")), Not(HasSubstr(kToken))));
  const std::string cookie = CookieOf(r);
  HttpResponse page = dashboard_.Respond(Request("GET", "/jobs", {{"cookie", "other=1; " + cookie}}));
  EXPECT_EQ(page.status, 200);
  EXPECT_EQ(page.content_type, "text/html; charset=utf-8");
  EXPECT_THAT(page.body, HasSubstr("/static/jobs.js"));
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/static/charts.js", {{"cookie", cookie}})).content_type,
            "text/javascript; charset=utf-8");
  // Authenticated, but not attached to a head yet: the JSON is 503, not 401.
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/api/jobs", {{"cookie", cookie}})).status, 503);
}

TEST_F(DashboardAuthTest, AWrongTokenGetsTheLoginPageWithAFixedMessageAndNoCookie) {
  HttpResponse r = dashboard_.Respond(Request("POST", "/login", {origin_}, "token=guess"));
  EXPECT_EQ(r.status, 303);
  EXPECT_EQ(HeaderOf(r, "Location"), "/login?reason=wrong-token");
  EXPECT_EQ(HeaderOf(r, "Set-Cookie"), "");
  EXPECT_THAT(dashboard_.Respond(Request("GET", "/login?reason=wrong-token")).body,
              HasSubstr("That is not this cluster's token."));
  // Nothing from the request is written into the page.
  EXPECT_THAT(dashboard_.Respond(Request("GET", "/login?reason=%3Cscript%3E")).body, Not(HasSubstr("<script>")));
}

TEST_F(DashboardAuthTest, ALinkWithTheTokenLogsInOnceAndDropsTheTokenFromTheAddress) {
  HttpResponse r = dashboard_.Respond(Request("GET", absl::StrCat("/job?id=job-000002&token=", kToken)));
  EXPECT_EQ(r.status, 303);
  EXPECT_EQ(HeaderOf(r, "Location"), "/job?id=job-000002");
  EXPECT_THAT(HeaderOf(r, "Set-Cookie"), HasSubstr("HttpOnly"));
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/job?id=job-000002", {{"cookie", CookieOf(r)}})).status, 200);
  r = dashboard_.Respond(Request("GET", absl::StrCat("/?token=", kToken)));
  EXPECT_EQ(HeaderOf(r, "Location"), "/");
  r = dashboard_.Respond(Request("GET", "/?token=wrong"));
  EXPECT_EQ(HeaderOf(r, "Location"), "/login?reason=wrong-token");
  EXPECT_EQ(HeaderOf(r, "Set-Cookie"), "");
}

TEST_F(DashboardAuthTest, ForgedAndExpiredCookiesAreRefused) {
  const std::string cookie = LogIn();
  const std::string name = cookie.substr(0, cookie.find('=') + 1);
  const std::string value = cookie.substr(cookie.find('=') + 1);
  const std::string expires = value.substr(0, value.find('.'));
  // Another expiry with the same MAC, a MAC for another token, garbage.
  Dashboard other(DashboardOptions{.token = "another-token", .clock = &clock_});
  for (const std::string& forged :
       {absl::StrCat(std::stoll(expires) + 1000, value.substr(value.find('.'))),
        other.SessionValue(std::stoll(expires)), std::string("1.abc"), std::string(kToken)}) {
    EXPECT_EQ(dashboard_.Respond(Request("GET", "/api/jobs", {{"cookie", name + forged}})).status, 401) << forged;
  }
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/plan", {{"cookie", cookie}})).status, 200);
  clock_.AdvanceMillis(8LL * 24 * 3600 * 1000);  // past the week a session lasts
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/plan", {{"cookie", cookie}})).status, 303);
}

TEST_F(DashboardAuthTest, PostsAuthenticatedByTheCookieMustComeFromTheDashboardsOrigin) {
  const std::string cookie = LogIn();
  const std::pair<std::string, std::string> json{"content-type", "application/json"};
  const std::string body = R"({"job_id":"job-000001"})";
  // No Origin, another site's, or a browser that says the request is cross-site: refused before anything is done.
  for (const auto& headers : std::vector<std::vector<std::pair<std::string, std::string>>>{
           {{"cookie", cookie}, json},
           {{"cookie", cookie}, json, {"origin", "http://evil.example"}},
           {{"cookie", cookie}, json, origin_, {"sec-fetch-site", "cross-site"}}}) {
    EXPECT_EQ(dashboard_.Respond(Request("POST", "/api/cancel", headers, body)).status, 403);
  }
  EXPECT_EQ(
      dashboard_.Respond(Request("POST", "/login", {{"origin", "http://evil.example"}}, absl::StrCat("token=", kToken)))
          .status,
      403);
  EXPECT_EQ(dashboard_.Respond(Request("POST", "/logout", {{"cookie", cookie}})).status, 403);
  // Same origin passes the check (and gets 503: no head attached); so does a bearer request, which has no cookie.
  EXPECT_EQ(dashboard_.Respond(Request("POST", "/api/cancel", {{"cookie", cookie}, json, origin_}, body)).status, 503);
  EXPECT_EQ(
      dashboard_
          .Respond(Request("POST", "/api/cancel", {{"authorization", absl::StrCat("Bearer ", kToken)}, json}, body))
          .status,
      503);
  HttpResponse out = dashboard_.Respond(Request("POST", "/logout", {{"cookie", cookie}, origin_}));
  EXPECT_EQ(HeaderOf(out, "Location"), "/login?reason=logged-out");
  EXPECT_THAT(HeaderOf(out, "Set-Cookie"), HasSubstr("Max-Age=0"));
}

TEST_F(DashboardAuthTest, MalformedAndOversizedRequestsAndSecurityHeaders) {
  HttpRequest garbage;
  EXPECT_EQ(dashboard_.Respond(garbage).status, 400);
  HttpRequest large = Request("POST", "/api/plan");
  large.body_too_large = true;
  EXPECT_EQ(dashboard_.Respond(large).status, 413);
  const std::string cookie = LogIn();
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/static/../token", {{"cookie", cookie}})).status, 404);
  EXPECT_EQ(dashboard_.Respond(Request("GET", "/static/login.html", {{"cookie", cookie}})).status, 404);
  EXPECT_EQ(dashboard_.Respond(Request("DELETE", "/", {{"cookie", cookie}})).status, 405);
  const std::string answer = dashboard_.Handle(Request("GET", "/login"), "");
  EXPECT_THAT(answer, AllOf(HasSubstr("Content-Security-Policy: default-src 'none'; script-src 'self'"),
                            HasSubstr("frame-ancestors 'none'"), HasSubstr("X-Frame-Options: DENY"),
                            HasSubstr("X-Content-Type-Options: nosniff"), HasSubstr("Cache-Control: no-store")));
}

TEST(DashboardTlsTest, UnderTlsTheCookieIsSecureAndHostBound) {
  Dashboard dashboard(DashboardOptions{.token = kToken, .tls = true});
  HttpRequest login = Request("POST", "/login", {{"origin", "https://127.0.0.1:9470"}}, absl::StrCat("token=", kToken));
  login.tls = true;
  HttpResponse r = dashboard.Respond(login);
  ASSERT_EQ(r.status, 303);
  EXPECT_THAT(HeaderOf(r, "Set-Cookie"), AllOf(StartsWith("__Host-geotrain_session_9470="), HasSubstr("; Secure")));
  // The plaintext origin of the same host is another origin.
  login.headers[0].second = "http://127.0.0.1:9470";
  EXPECT_EQ(dashboard.Respond(login).status, 403);
}

// A real head with the dashboard on its metrics port, over real sockets.
std::string Ask(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return answer;
}

class DashboardHeadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_dashboard_" + GenerateToken())).string();
    setenv("GEOTRAIN_HOME", (dir_ + "/home").c_str(), 1);
    HeadOptions options = InProcessHeadOptions(dir_ + "/state", kToken);
    options.metrics_port = 0;
    head_ = std::make_unique<HeadServer>(options);
    absl::Status started = head_->Start();
    ASSERT_TRUE(started.ok()) << started;
    port_ = head_->metrics_port();
  }
  void TearDown() override {
    head_->Shutdown();
    std::filesystem::remove_all(dir_);
  }
  std::string Get(const std::string& target) {
    return Ask(port_, absl::StrCat("GET ", target, " HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ", kToken,
                                   "\r\n\r\n"));
  }
  std::string Post(const std::string& target, const std::string& json) {
    return Ask(port_,
               absl::StrCat("POST ", target, " HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ", kToken,
                            "\r\nContent-Type: application/json\r\nContent-Length: ", json.size(), "\r\n\r\n", json));
  }
  std::string dir_;
  std::unique_ptr<HeadServer> head_;
  int port_ = 0;
};

TEST_F(DashboardHeadTest, ServesThePublicApiNextToUnchangedMetrics) {
  EXPECT_EQ(head_->dashboard_url(), absl::StrCat("http://127.0.0.1:", port_, "/"));
  // /metrics needs no token and answers as before.
  EXPECT_THAT(Ask(port_, "GET /metrics HTTP/1.1\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 200"), HasSubstr("geotrain_jobs")));
  EXPECT_THAT(Get("/api/cluster"), AllOf(StartsWith("HTTP/1.1 200"), HasSubstr("\"head_id\":\"h-"),
                                         HasSubstr(absl::StrCat("\"dashboard_url\":\"http://127.0.0.1:", port_))));
  // A job submitted and cancelled through the dashboard, as the RPCs would.
  const std::string submitted =
      Post("/api/submit",
           R"({"spec_text":"name: web\nmodel: {preset: gpt2-tiny-test}\ndata: {train: /nonexistent/t_*.bin}\n)"
           R"(train: {steps: 5, global_batch: 4, seq_len: 16}\n","spec_source":"web.yaml"})");
  ASSERT_THAT(submitted, StartsWith("HTTP/1.1 200"));
  EXPECT_THAT(submitted, HasSubstr("\"job_id\":\"job-000001\""));
  EXPECT_THAT(Get("/api/jobs"), HasSubstr("\"name\":\"web\""));
  EXPECT_THAT(Get("/api/job?id=job-000001"),
              AllOf(HasSubstr("\"job\":{"), HasSubstr("\"efficiency\":{"), HasSubstr("\"flops_per_token\"")));
  EXPECT_THAT(Get("/api/events?id=job-000001&after=0"), AllOf(HasSubstr("\"events\":["), HasSubstr("\"more\":false")));
  EXPECT_THAT(Get("/api/job?id=job-000404"), StartsWith("HTTP/1.1 404"));
  EXPECT_THAT(Post("/api/submit", R"({"spec_text":"train: {stepz: 1}"})"),
              AllOf(StartsWith("HTTP/1.1 400"), HasSubstr("stepz")));
  EXPECT_THAT(Post("/api/cancel", R"({"job_id":"job-000001","extra":1})"), StartsWith("HTTP/1.1 400"));
  EXPECT_THAT(Post("/api/cancel", R"({"job_id":"job-000001"})"),
              AllOf(StartsWith("HTTP/1.1 200"), HasSubstr("JOB_CANCELLED")));
  EXPECT_THAT(Post("/api/plan", R"({"spec_text":"model: {preset: gpt2}"})"), StartsWith("HTTP/1.1 409"));  // no workers
  // A body over the bound is refused without being read; no token, no data.
  EXPECT_THAT(Ask(port_, absl::StrCat("POST /api/plan HTTP/1.1\r\nHost: x\r\nContent-Length: ",
                                      2 * kDashboardMaxBodyBytes, "\r\n\r\n")),
              StartsWith("HTTP/1.1 413"));
  EXPECT_THAT(Ask(port_, "GET /api/jobs HTTP/1.1\r\nHost: x\r\n\r\n"),
              AllOf(StartsWith("HTTP/1.1 401"), Not(HasSubstr("job-000001"))));
}

TEST(DashboardFiguresTest, MfuIsAchievedOverTheHeldDevicesPeakInTheJobsPrecision) {
  JobInfo job;
  job.set_job_id("job-000001");
  job.set_precision("bf16");
  job.set_tokens_per_second(1000);
  job.mutable_spec()->mutable_model()->set_preset("gpt2-tiny-test");
  job.mutable_spec()->mutable_train()->set_seq_len(16);
  for (int stage = 0; stage < 2; ++stage) {
    ActorRecord* a = job.add_actors();
    a->set_worker_id("w1");
    a->set_device_index(stage);
  }
  job.add_actors()->set_worker_id("w1");  // a second actor on device 0 (tensor ranks) counts the device once
  WorkerInfo worker;
  worker.set_worker_id("w1");
  for (int i = 0; i < 2; ++i) {
    Device* d = worker.add_devices();
    d->set_index(i);
    d->set_kind(DEVICE_KIND_EMULATED);
    d->set_tflops(65);
    d->set_bf16_tflops(i == 0 ? 100 : 0);  // the second gives no bf16 figure: its declared TFLOP/s stands
  }
  const v1::JobEfficiency e = JobEfficiencyOf(job, {worker});
  EXPECT_EQ(e.devices(), 2);
  EXPECT_DOUBLE_EQ(e.peak_flops(), 165e12);
  EXPECT_GT(e.flops_per_token(), 0);
  EXPECT_DOUBLE_EQ(e.achieved_flops(), 1000 * e.flops_per_token());
  EXPECT_DOUBLE_EQ(e.mfu(), e.achieved_flops() / 165e12);
  EXPECT_TRUE(e.emulated_devices());
  EXPECT_EQ(JobEfficiencyOf(JobInfo(), {}).mfu(), 0);
}

TEST(DashboardFiguresTest, ConfiguredLinksComeFromTheTopologyFile) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("topology_" + GenerateToken() + ".yaml")).string();
  std::ofstream(path) << "sites:\n  - {name: a, workers: [{device: T4}]}\n  - {name: b, workers: [{device: T4}]}\n"
                         "links:\n  - {a: a, b: b, latency_ms: 30, bandwidth_mbps: 100, jitter_ms: 1}\n";
  auto links = ConfiguredLinksOf(path);
  ASSERT_TRUE(links.ok()) << links.status();
  ASSERT_EQ(links->size(), 1u);
  EXPECT_EQ((*links)[0].latency_ms(), 30);
  EXPECT_EQ((*links)[0].bandwidth_mbps(), 100);
  std::filesystem::remove(path);
  EXPECT_THAT(ConfiguredLinksOf(path).status().message(), HasSubstr(path));
}

}  // namespace
}  // namespace geotrain::head
