// Delivers a stage actor's reports to the head in order, on a background thread, so that training never
// waits on the head: while the head is unreachable (restarting, or cut off) reports queue up and are
// retried with backoff (0.2 s doubling to 5 s) until the head takes them.
//
//   StepReporter reporter(&head_client, actor_id, [&] { actor.Stop("the head stopped the job"); });
//   reporter.Enqueue(report);                     // returns at once
//   reporter.Drain(absl::Minutes(5));             // at the end: wait for the last reports
//
// The queue holds at most kMaxQueued reports: beyond that the oldest plain step reports are dropped (the
// head then misses those steps' figures); reports that decide something (done, error, checkpoint shards)
// are never dropped. A reply with stop set calls `on_stop` (once). Every reply is handed to `on_reply` (a drain's
// step boundary, head/job_drain.h) before its report leaves the queue, so that once Drain() returned, the replies to
// every report queued before are known.
// Thread-safety: all methods may be called from any thread. The destructor stops retrying and drops what
// is undelivered.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "control.pb.h"
#include "worker/head_client.h"

namespace geotrain::worker {

class StepReporter {
 public:
  static constexpr size_t kMaxQueued = 10000;

  // `head` may be null (reports are dropped); it must outlive the reporter. `on_reply` may be null; it runs on the
  // reporter's thread.
  StepReporter(HeadClient* head, std::string actor_id, std::function<void()> on_stop,
               std::function<void(const ReportStepReply&)> on_reply = nullptr);
  ~StepReporter();
  StepReporter(const StepReporter&) = delete;
  StepReporter& operator=(const StepReporter&) = delete;

  void Enqueue(StepReport report);
  // Waits until every queued report was delivered, or `timeout`; true when nothing is left.
  // No report will follow: the thread ends once the queue is delivered (or dropped as undeliverable) instead of
  // waiting for more, so that a finished actor holds no thread. A report enqueued after Close is not delivered.
  void Close();
  bool Drain(absl::Duration timeout);
  size_t queued() const;
  int64_t dropped() const;

 private:
  void Loop();

  HeadClient* const head_;
  const std::string actor_id_;
  const std::function<void()> on_stop_;
  const std::function<void(const ReportStepReply&)> on_reply_;
  mutable absl::Mutex mu_;
  std::deque<StepReport> queue_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;  // the front report is being delivered
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_signalled_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace geotrain::worker
