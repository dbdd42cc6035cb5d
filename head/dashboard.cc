// The head's web dashboard: authentication, pages and JSON (see dashboard.h).
#include "head/dashboard.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/token.h"
#include "google/protobuf/util/json_util.h"
#include "head/dashboard_assets.h"

namespace geotrain::head {
namespace {

constexpr int kMaxEventsPerAnswer = 2000;

// What every answer carries: no inline script or style, no framing, no sniffing, nothing cached.
void AddSecurityHeaders(HttpResponse* response) {
  response->headers.emplace_back("Content-Security-Policy",
                                 "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'");
  response->headers.emplace_back("X-Frame-Options", "DENY");
  response->headers.emplace_back("X-Content-Type-Options", "nosniff");
  response->headers.emplace_back("Referrer-Policy", "same-origin");
  response->headers.emplace_back("Cross-Origin-Opener-Policy", "same-origin");
  response->headers.emplace_back("Cross-Origin-Resource-Policy", "same-origin");
  response->headers.emplace_back("Cache-Control", "no-store");
}

HttpResponse Text(int status, std::string body) { return {.status = status, .body = std::move(body)}; }

// An answer whose body is JSON: protobuf's mapping of a public API message, or one built with common/json.h.
HttpResponse JsonResponse(int status, std::string body) {
  return {.status = status, .content_type = "application/json", .body = std::move(body)};
}
HttpResponse JsonResponse(int status, const geotrain::Json& body) { return JsonResponse(status, DumpJson(body)); }

// A public API message as a JSON value (protobuf's mapping), to nest in an answer.
geotrain::Json ProtoJson(const google::protobuf::Message& message) { return geotrain::Json::parse(ToJson(message)); }

HttpResponse JsonError(int status, const absl::Status& error) {
  return JsonResponse(status, geotrain::Json{{"error", std::string(error.message())},
                                             {"code", absl::StatusCodeToString(error.code())}});
}

// The HTTP status that says what an API error says.
int HttpStatusOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

template <typename Message>
HttpResponse JsonAnswer(const absl::StatusOr<Message>& result) {
  if (!result.ok()) return JsonError(HttpStatusOf(result.status()), result.status());
  return JsonResponse(200, ToJson(*result));
}

HttpResponse Redirect(std::string location) {
  HttpResponse response = Text(303, "");
  response.headers.emplace_back("Location", std::move(location));
  return response;
}

// The request's body as the public API message `Message`, in its JSON form (unknown keys refused).
template <typename Message>
absl::StatusOr<Message> ParseJsonBody(const HttpRequest& request) {
  if (!absl::StartsWith(absl::AsciiStrToLower(request.Header("content-type")), "application/json")) {
    return absl::InvalidArgumentError("send the request as JSON (Content-Type: application/json)");
  }
  Message message;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  if (auto s = google::protobuf::util::JsonStringToMessage(request.body, &message, options); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request body: ", std::string(s.message())));
  }
  return message;
}

// The value of cookie `name` in the request's Cookie header(s), or "".
std::string CookieValue(const HttpRequest& request, std::string_view name) {
  for (const auto& [header, value] : request.headers) {
    if (header != "cookie") continue;
    for (absl::string_view pair : absl::StrSplit(value, ';')) {
      pair = absl::StripAsciiWhitespace(pair);
      const size_t equals = pair.find('=');
      if (equals != absl::string_view::npos && pair.substr(0, equals) == absl::string_view(name.data(), name.size())) {
        return std::string(pair.substr(equals + 1));
      }
    }
  }
  return "";
}

// The query without its `token` parameter (what a link that logs in redirects to).
std::string WithoutToken(std::string_view query) {
  std::vector<absl::string_view> kept;
  for (absl::string_view pair : absl::StrSplit(absl::string_view(query.data(), query.size()), '&')) {
    if (!pair.empty() && !absl::StartsWith(pair, "token=") && pair != "token") kept.push_back(pair);
  }
  return absl::StrJoin(kept, "&");
}

// The pages, by path.
const char* PageFile(std::string_view path) {
  if (path == "/" || path == "/cluster") return "cluster.html";
  if (path == "/jobs") return "jobs.html";
  if (path == "/job") return "job.html";
  if (path == "/plan") return "plan.html";
  return nullptr;
}

// A state-changing request a browser made must come from a page of this dashboard: its Origin is this server's
// (browsers send Origin on every POST; a cross-site page cannot forge it). Bearer requests carry no ambient
// credential, so they need no such check.
bool SameOrigin(const HttpRequest& request) {
  const std::string host = request.Header("host");
  const std::string origin = request.Header("origin");
  const std::string fetch_site = request.Header("sec-fetch-site");
  if (!fetch_site.empty() && fetch_site != "same-origin") return false;
  return !host.empty() && origin == absl::StrCat(request.tls ? "https://" : "http://", host);
}

HttpResponse Asset(const DashboardAsset& asset) {
  return {.status = 200,
          .content_type = asset.content_type,
          .body = std::string(reinterpret_cast<const char*>(asset.data), asset.size)};
}

}  // namespace

Dashboard::Dashboard(DashboardOptions options) : options_(std::move(options)) {}

void Dashboard::Attach(const PublicApi* api) {
  absl::WriterMutexLock lock(&mu_);
  api_ = api;
}

void Dashboard::Detach() {
  absl::WriterMutexLock lock(&mu_);
  api_ = nullptr;
}

std::string Dashboard::SessionValue(int64_t expires_unix_s) const {
  const std::string message = absl::StrCat("geotrain dashboard session until ", expires_unix_s);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), options_.token.data(), static_cast<int>(options_.token.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &length);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppend(&hex, absl::Hex(mac[i], absl::kZeroPad2));
  return absl::StrCat(expires_unix_s, ".", hex);
}

std::string Dashboard::CookieName(const HttpRequest& request) const {
  // Cookies do not tell ports apart: two heads on one host each keep their own session, named by the port.
  const std::string host = request.Header("host");
  const size_t colon = host.rfind(':');
  std::string port = colon == std::string::npos ? "" : host.substr(colon + 1);
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit)) {
    port = options_.tls ? "443" : "80";
  }
  return absl::StrCat(options_.tls ? "__Host-" : "", "geotrain_session_", port);
}

bool Dashboard::CookieAuthenticated(const HttpRequest& request) const {
  const std::string cookie = CookieValue(request, CookieName(request));
  const size_t dot = cookie.find('.');
  int64_t expires = 0;
  if (dot == std::string::npos || !absl::SimpleAtoi(absl::string_view(cookie).substr(0, dot), &expires)) return false;
  // Compared in seconds: an expiry near INT64_MAX in a forged cookie must not overflow.
  if (expires <= options_.clock->UnixMillis() / 1000 || options_.token.empty()) return false;
  return TokenMatches(cookie, SessionValue(expires));
}

bool Dashboard::BearerAuthenticated(const HttpRequest& request) const {
  const std::string authorization = request.Header("authorization");
  return absl::StartsWithIgnoreCase(authorization, "Bearer ") &&
         TokenMatches(std::string(absl::StripAsciiWhitespace(absl::string_view(authorization).substr(7))),
                      options_.token);
}

bool Dashboard::Authenticated(const HttpRequest& request) const {
  if (absl::StartsWithIgnoreCase(request.Header("authorization"), "Bearer ")) return BearerAuthenticated(request);
  return CookieAuthenticated(request);
}

bool Dashboard::MayChange(const HttpRequest& request) const {
  return BearerAuthenticated(request) || SameOrigin(request);
}

HttpResponse Dashboard::LoginPage(std::string_view reason, int status) const {
  const DashboardAsset* asset = FindDashboardAsset("login.html");
  if (asset == nullptr) return Text(500, "the dashboard was built without its pages\n");
  HttpResponse page = Asset(*asset);
  page.status = status;
  // Fixed sentences only: nothing from the request is written into the page.
  const char* message = reason == "wrong-token"  ? "That is not this cluster's token."
                        : reason == "logged-out" ? "Logged out."
                        : reason == "expired"    ? "Your session ended; log in again."
                                                 : "";
  const size_t marker = page.body.find("<!--message-->");
  if (marker != std::string::npos) page.body.replace(marker, 14, message);
  return page;
}

HttpResponse Dashboard::StartSession(const HttpRequest& request, std::string location) const {
  const int64_t expires = options_.clock->UnixMillis() / 1000 + options_.session_seconds;
  HttpResponse response = Redirect(std::move(location));
  response.headers.emplace_back(
      "Set-Cookie",
      absl::StrCat(CookieName(request), "=", SessionValue(expires), "; Path=/; Max-Age=", options_.session_seconds,
                   "; HttpOnly; SameSite=Strict", options_.tls ? "; Secure" : ""));
  return response;
}

HttpResponse Dashboard::Login(const HttpRequest& request) {
  if (request.path == "/logout") {
    if (!MayChange(request)) return Text(403, "cross-site request refused\n");
    HttpResponse response = Redirect("/login?reason=logged-out");
    response.headers.emplace_back("Set-Cookie",
                                  absl::StrCat(CookieName(request), "=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict",
                                               options_.tls ? "; Secure" : ""));
    return response;
  }
  if (request.method == "GET") return LoginPage(FormParameter(request.query, "reason"), 200);
  if (request.method != "POST") return Text(405, "GET or POST /login\n");
  if (!MayChange(request)) return Text(403, "cross-site request refused\n");
  if (!TokenMatches(FormParameter(request.body, "token"), options_.token)) {
    GT_LOG(WARNING) << "dashboard: refused a login from " << request.peer << ": wrong cluster token";
    return Redirect("/login?reason=wrong-token");
  }
  return StartSession(request, "/");
}

HttpResponse Dashboard::Page(const HttpRequest& request) {
  if (request.method != "GET") return Text(405, "pages are GET only\n");
  // A link that carries the token (`geotrain cluster up` prints one) logs in once and drops it from the address.
  if (const std::string token = FormParameter(request.query, "token"); !token.empty()) {
    if (!TokenMatches(token, options_.token)) {
      GT_LOG(WARNING) << "dashboard: refused a link from " << request.peer << ": wrong cluster token";
      return Redirect("/login?reason=wrong-token");
    }
    const std::string query = WithoutToken(request.query);
    return StartSession(request, query.empty() ? request.path : absl::StrCat(request.path, "?", query));
  }
  if (!Authenticated(request)) return Redirect("/login");
  if (absl::StartsWith(request.path, "/static/")) {
    const std::string name = request.path.substr(8);
    const DashboardAsset* asset = name.find('/') == std::string::npos ? FindDashboardAsset(name) : nullptr;
    if (asset == nullptr || absl::EndsWith(name, ".html")) return Text(404, "no such file\n");
    return Asset(*asset);
  }
  const char* file = PageFile(request.path);
  const DashboardAsset* asset = file == nullptr ? nullptr : FindDashboardAsset(file);
  if (asset == nullptr) return Text(404, "no such page; the dashboard has /, /jobs, /job?id=JOB and /plan\n");
  return Asset(*asset);
}

HttpResponse Dashboard::ApiGet(const HttpRequest& request, const PublicApi& api) {
  const std::string job_id = FormParameter(request.query, "id");
  if (request.path == "/api/cluster") {
    return JsonResponse(
        200, geotrain::Json{{"status", ProtoJson(api.GetClusterStatus())}, {"info", ProtoJson(api.GetClusterInfo())}});
  }
  if (request.path == "/api/jobs") return JsonResponse(200, ToJson(api.ListJobs()));
  if (request.path == "/api/job") {
    absl::StatusOr<v1::Job> job = api.GetJob(job_id);
    if (!job.ok()) return JsonAnswer(job);
    absl::StatusOr<v1::JobEfficiency> efficiency = api.GetJobEfficiency(job_id);
    if (!efficiency.ok()) return JsonAnswer(efficiency);
    return JsonResponse(200, geotrain::Json{{"job", ProtoJson(*job)}, {"efficiency", ProtoJson(*efficiency)}});
  }
  if (request.path == "/api/events") {
    int64_t after = 0;
    if (const std::string text = FormParameter(request.query, "after");
        !text.empty() && !absl::SimpleAtoi(text, &after)) {
      return JsonError(400, absl::InvalidArgumentError("after must be an event sequence number"));
    }
    int64_t tail = 0;  // only the newest `tail` of them (what the cluster page needs of a running job)
    if (const std::string text = FormParameter(request.query, "tail");
        !text.empty() && !absl::SimpleAtoi(text, &tail)) {
      return JsonError(400, absl::InvalidArgumentError("tail must be a count of events"));
    }
    // The store reads only what is answered: the newest `tail`, or one more than an answer holds (to say `more`).
    const int64_t limit = tail > 0 ? std::min<int64_t>(tail, kMaxEventsPerAnswer) : kMaxEventsPerAnswer + 1;
    absl::StatusOr<std::vector<v1::JobEvent>> events = api.JobEvents(job_id, after, limit, /*newest=*/tail > 0);
    if (!events.ok()) return JsonError(HttpStatusOf(events.status()), events.status());
    const size_t count = std::min<size_t>(events->size(), kMaxEventsPerAnswer);
    geotrain::Json list = geotrain::Json::array();
    for (size_t i = 0; i < count; ++i) list.push_back(ProtoJson((*events)[i]));
    return JsonResponse(200, geotrain::Json{{"events", std::move(list)}, {"more", count < events->size()}});
  }
  return JsonError(404, absl::NotFoundError("no such endpoint"));
}

HttpResponse Dashboard::ApiPost(const HttpRequest& request, const PublicApi& api) {
  if (request.path == "/api/cancel") {
    absl::StatusOr<v1::CancelJobRequest> cancel = ParseJsonBody<v1::CancelJobRequest>(request);
    if (!cancel.ok()) return JsonError(400, cancel.status());
    return JsonAnswer(api.CancelJob(cancel->job_id()));
  }
  if (request.path == "/api/submit") {
    absl::StatusOr<v1::SubmitJobRequest> submit = ParseJsonBody<v1::SubmitJobRequest>(request);
    if (!submit.ok()) return JsonError(400, submit.status());
    return JsonAnswer(api.SubmitJob(*submit));
  }
  if (request.path == "/api/plan") {
    absl::StatusOr<v1::PlanJobRequest> plan = ParseJsonBody<v1::PlanJobRequest>(request);
    if (!plan.ok()) return JsonError(400, plan.status());
    // Planning takes a handler thread for up to seconds: one at a time, so the others stay free.
    if (!plan_mu_.TryLock()) {
      return JsonError(429, absl::ResourceExhaustedError("another plan is being computed; try again in a moment"));
    }
    HttpResponse answer = JsonAnswer(api.PlanJob(*plan));
    plan_mu_.Unlock();
    return answer;
  }
  return JsonError(404, absl::NotFoundError("no such endpoint"));
}

HttpResponse Dashboard::Api(const HttpRequest& request) {
  if (!Authenticated(request)) {
    HttpResponse refused = JsonError(
        401, absl::UnauthenticatedError("log in to the dashboard, or send Authorization: Bearer <cluster token>"));
    refused.headers.emplace_back("WWW-Authenticate", "Bearer realm=\"geotrain\"");
    return refused;
  }
  if (request.method == "POST" && !MayChange(request)) {
    GT_LOG(WARNING) << "dashboard: refused a cross-site " << request.path << " from " << request.peer;
    return JsonError(403, absl::PermissionDeniedError("cross-site request refused"));
  }
  absl::ReaderMutexLock lock(&mu_);
  if (api_ == nullptr) return JsonError(503, absl::UnavailableError("the head is starting or stopping"));
  if (request.method == "GET") return ApiGet(request, *api_);
  if (request.method == "POST") return ApiPost(request, *api_);
  return JsonError(405, absl::InvalidArgumentError("the API takes GET and POST"));
}

HttpResponse Dashboard::Respond(const HttpRequest& request) {
  if (request.method.empty()) return Text(400, "malformed request\n");
  if (request.body_too_large)
    return Text(413, absl::StrCat("request bodies are limited to ", kDashboardMaxBodyBytes, " bytes\n"));
  if (request.path == "/login" || request.path == "/logout") return Login(request);
  if (request.path == "/static/style.css") {  // the login page's looks: public, like the login page
    const DashboardAsset* asset = FindDashboardAsset("style.css");
    return asset == nullptr ? Text(404, "no such file\n") : Asset(*asset);
  }
  if (absl::StartsWith(request.path, "/api/")) return Api(request);
  return Page(request);
}

std::string Dashboard::Handle(const HttpRequest& request, std::string_view) {
  HttpResponse response = Respond(request);
  AddSecurityHeaders(&response);
  return SerializeHttpResponse(response);
}

}  // namespace geotrain::head
