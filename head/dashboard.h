// The head's web dashboard: four pages (the cluster, the jobs, one job live, the planner) and the JSON they read,
// answered from the head's own state through the public API's in-process calls (head/public_api.h), so it needs
// nothing but the head: no Prometheus, no web server, no Node. The pages are static files from head/dashboard/,
// compiled into the binary (dashboard_assets.h); their scripts poll the JSON every few seconds.
//
//   auto dashboard = std::make_shared<Dashboard>(DashboardOptions{.token = token, .tls = true});
//   metrics.Start("127.0.0.1:9470", [dashboard](const HttpRequest& r, std::string_view raw) {
//     return dashboard->Handle(r, raw);
//   }, kDashboardMaxBodyBytes);                    // or an HttpServer of its own (HTTPS when the head has TLS)
//   dashboard->Attach(&public_api);               // from now on it answers with data
//   ...
//   dashboard->Detach();                          // before the public API goes
//
// Security: every page, script and JSON answer needs the cluster token, compared in constant time (TokenMatches):
// an `Authorization: Bearer TOKEN` header, or the session cookie that logging in sets (HttpOnly, SameSite=Strict,
// Secure under TLS; its value is an HMAC of the token and its expiry, so the cookie is not the token, survives a
// head restart, and dies with the token). Logging in: the login page's form, or a link `<url>/?token=TOKEN` (what
// `geotrain cluster up` prints), which sets the cookie and redirects to the same page without the token. Without a
// valid token a page redirects to the login page, and the JSON is 401. A POST (cancel, plan, submit, log in, log
// out) authenticated by the cookie must come from the dashboard's own origin (Origin header; CSRF). Every answer
// carries a Content-Security-Policy without inline script, frame-ancestors 'none', nosniff and no-store.
//
// Routes: GET / (cluster), /jobs, /job?id=, /plan, /login, /static/NAME; GET /api/cluster, /api/jobs,
// /api/job?id=, /api/events?id=&after=SEQ[&tail=N]; POST /login, /logout, /api/cancel, /api/plan, /api/submit (JSON bodies:
// the public API's requests in its JSON form). JSON answers are the public API's messages as `--json` prints them.
//
// Threads: Handle is called on the HTTP server's handler threads, several at once; one plan is computed at a time
// (another is answered 429). Attach and Detach from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/http_server.h"
#include "head/public_api.h"

namespace geotrain::head {

// The largest request body the dashboard reads (a pasted job spec).
inline constexpr size_t kDashboardMaxBodyBytes = 1 << 20;

struct DashboardOptions {
  std::string token;  // the cluster token; empty: nobody gets in
  bool tls = false;   // served over HTTPS: the session cookie is Secure
  int64_t session_seconds = 7 * 24 * 3600;
  const Clock* clock = RealClock::Get();
};

class Dashboard {
 public:
  explicit Dashboard(DashboardOptions options);
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  // Answers with data from `api` from now on (until then the JSON is 503). `api` must stay until Detach().
  void Attach(const PublicApi* api);
  // Stops using the API: waits for the answers being computed, and answers 503 afterwards.
  void Detach();

  // The whole HTTP answer to one request: an HttpHandler (common/http_server.h).
  std::string Handle(const HttpRequest& request, std::string_view raw_head);
  // The same, before serialization (for tests).
  HttpResponse Respond(const HttpRequest& request);

  // The session cookie's value for a session that ends at `expires_unix_s`.
  std::string SessionValue(int64_t expires_unix_s) const;

 private:
  // A Bearer header carries the token, or (no Bearer header) the session cookie is valid.
  bool Authenticated(const HttpRequest& request) const;
  bool BearerAuthenticated(const HttpRequest& request) const;
  bool CookieAuthenticated(const HttpRequest& request) const;
  // Whether a POST may change something: its Bearer token is valid (a script, not a browser), or it comes from the
  // dashboard's own origin (CSRF: a cookie alone is not enough).
  bool MayChange(const HttpRequest& request) const;
  HttpResponse Login(const HttpRequest& request);
  HttpResponse LoginPage(std::string_view reason, int status) const;
  HttpResponse StartSession(const HttpRequest& request, std::string location) const;
  HttpResponse Page(const HttpRequest& request);
  HttpResponse Api(const HttpRequest& request);
  HttpResponse ApiGet(const HttpRequest& request, const PublicApi& api);
  HttpResponse ApiPost(const HttpRequest& request, const PublicApi& api);
  std::string CookieName(const HttpRequest& request) const;

  const DashboardOptions options_;
  absl::Mutex mu_;  // readers: answers being computed; writer: Detach
  const PublicApi* api_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Mutex plan_mu_;  // held while a plan is computed
};

}  // namespace geotrain::head
