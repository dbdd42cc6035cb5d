// The rendezvous client (see rendezvous.h).
#include "comm/rendezvous.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"

namespace geotrain::comm {
namespace {

constexpr absl::Duration kHeadMaxWait = absl::Seconds(60);  // the head refuses longer fetches
constexpr absl::Duration kCallGrace = absl::Seconds(5);     // the RPC's deadline beyond the head's wait

// Waits `backoff` (doubled for the next time, up to 2 s) unless that passes the deadline.
bool Backoff(absl::Duration* backoff, absl::Time deadline) {
  if (absl::Now() + *backoff >= deadline) return false;
  std::this_thread::sleep_for(absl::ToChronoNanoseconds(*backoff));
  *backoff = std::min(*backoff * 2, absl::Seconds(2));
  return true;
}

absl::Status GaveUp(const std::string& job_id, const std::string& key, absl::Duration timeout,
                    const absl::Status& last) {
  return absl::DeadlineExceededError(absl::StrCat("rendezvous: key '", key, "' of job ", job_id, " not ",
                                                  "exchanged within ", absl::FormatDuration(timeout),
                                                  last.ok() ? "" : absl::StrCat(" (last: ", last.ToString(), ")")));
}

}  // namespace

absl::StatusOr<std::string> ExchangeRendezvous(geotrain::internal::HeadControl::StubInterface* head,
                                               const std::string& token, const std::string& job_id,
                                               const std::string& key, bool publisher, const std::string& value,
                                               absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Status last;
  for (bool first = true;; first = false) {
    // A zero timeout still asks once (is the key there?).
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    if (left == absl::ZeroDuration() && !first) return GaveUp(job_id, key, timeout, last);
    grpc::ClientContext context;
    AttachToken(&context, token);
    grpc::Status status;
    FetchRendezvousReply fetched;
    if (publisher) {
      PublishRendezvousRequest request;
      request.set_job_id(job_id);
      request.set_key(key);
      request.set_value(value);
      context.set_deadline(absl::ToChronoTime(std::max(deadline, absl::Now() + kCallGrace)));
      PublishRendezvousReply reply;
      status = head->PublishRendezvous(&context, request, &reply);
    } else {
      // The head waits at most kHeadMaxWait per call; the RPC's own deadline leaves it time to answer.
      const absl::Duration wait = std::min(left, kHeadMaxWait);
      FetchRendezvousRequest request;
      request.set_job_id(job_id);
      request.set_key(key);
      request.set_timeout_ms(absl::ToInt64Milliseconds(wait));
      context.set_deadline(absl::ToChronoTime(absl::Now() + wait + kCallGrace));
      status = head->FetchRendezvous(&context, request, &fetched);
    }
    if (status.ok()) return publisher ? value : std::move(*fetched.mutable_value());
    last = FromGrpc(status);
    switch (status.error_code()) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        if (absl::Now() >= deadline) return GaveUp(job_id, key, timeout, last);
        continue;  // one wait of a longer fetch ended
      case grpc::StatusCode::UNAVAILABLE:
        if (!Backoff(&backoff, deadline)) return GaveUp(job_id, key, timeout, last);
        continue;
      default:
        return last;
    }
  }
}

}  // namespace geotrain::comm
