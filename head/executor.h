// A fixed pool of threads for the head's slow work (RPCs to workers: creating and stopping actors), so that
// the threads that detect failures and steer jobs never wait on a worker.
//
//   Executor executor(8, "head-rpc");
//   executor.Submit([&] { StopActor(a); });                          // fire and forget
//   std::vector<absl::Status> created = executor.Map(n, [&](int i) { return CreateActor(i); });  // parallel
//
// Thread-safety: Submit and Map may be called from any thread but one of the pool's own (Map from a pool
// thread could wait for itself). The destructor runs what is queued, then joins.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace geotrain::head {

class Executor {
 public:
  Executor(int threads, std::string name);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Submit(std::function<void()> task);
  // Runs fn(0) .. fn(n - 1) on the pool at once and waits for all; returns their results in order.
  std::vector<absl::Status> Map(int n, const std::function<absl::Status(int)>& fn);

 private:
  void Loop();

  const std::string name_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace geotrain::head
