// The head's thread pool (see executor.h).
#include "head/executor.h"

#include <memory>

namespace geotrain::head {

Executor::Executor(int threads, std::string name) : name_(std::move(name)) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void Executor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

std::vector<absl::Status> Executor::Map(int n, const std::function<absl::Status(int)>& fn) {
  struct Shared {
    absl::Mutex mu;
    int remaining ABSL_GUARDED_BY(mu);
    std::vector<absl::Status> results ABSL_GUARDED_BY(mu);
  };
  auto shared = std::make_shared<Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    shared->remaining = n;
    shared->results.resize(n);
  }
  for (int i = 0; i < n; ++i) {
    Submit([shared, &fn, i] {
      absl::Status status = fn(i);
      absl::MutexLock lock(&shared->mu);
      shared->results[i] = std::move(status);
      --shared->remaining;
    });
  }
  absl::MutexLock lock(&shared->mu);
  shared->mu.Await(absl::Condition(
      +[](Shared* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->remaining == 0; }, shared.get()));
  return shared->results;
}

void Executor::Loop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Executor* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) { return e->stopping_ || !e->queue_.empty(); }, this));
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace geotrain::head
