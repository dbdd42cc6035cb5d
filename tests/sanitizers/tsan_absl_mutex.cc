// ThreadSanitizer builds only (GEOTRAIN_SANITIZE=thread): makes absl::Mutex and absl::CondVar visible to TSan.
//
// Debian's Abseil is built without TSan, and absl::Mutex sleeps on futexes of its own rather than pthread
// mutexes, so TSan sees none of its locking: every field guarded by an absl::Mutex (ours and gRPC's, whose
// mutexes are absl::Mutex too) would look racy. Each executable of a TSan build links this file, whose
// definitions of the Mutex and CondVar entry points take precedence over the shared library's (ELF
// interposition: the executable's symbols come first, for our calls and for gRPC's). Each calls the library's
// own function (dlsym RTLD_NEXT) and tells TSan the happens-before edge it makes: a release before the mutex
// is given up, an acquire once it is held. That is all race detection needs; TSan's lock-order (deadlock)
// checks do not see these mutexes.
// Conditions (Await, LockWhen) are waited for here by polling (unlock, sleep up to 1 ms, lock, evaluate), not by
// Abseil: Abseil evaluates a waiter's condition in whichever thread unlocks, at a point no annotation can mark,
// which TSan would report as a race on the fields the condition reads. Polling keeps every evaluation in the
// waiting thread with the mutex held. Await is taken to be called with the mutex held exclusively.
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}

namespace {

#define GT_STRINGIFY_INNER(x) #x
#define GT_STRINGIFY(x) GT_STRINGIFY_INNER(x)

// The shared library's definition of absl::<inline namespace>::`member` (its mangled name after the namespace,
// e.g. "5Mutex4LockEv"; Debian 12's inline namespace is debian3).
template <typename F>
F Real(const char* member) {
  const std::string ns = GT_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = "_ZN4absl" + std::to_string(ns.size()) + ns + member;
  void* f = dlsym(RTLD_NEXT, name.c_str());
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in Abseil: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

namespace {
// Waits, holding `mu` on entry and on return, until `cond` holds (true) or `deadline` passes (false).
bool WaitFor(Mutex* mu, const Condition& cond, absl::Time deadline, bool reader) {
  absl::Duration pause = absl::Microseconds(20);
  while (!cond.Eval()) {
    if (absl::Now() >= deadline) return false;
    reader ? mu->ReaderUnlock() : mu->Unlock();
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
    reader ? mu->ReaderLock() : mu->Lock();
  }
  return true;
}
}  // namespace

// Acquiring.
void Mutex::Lock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}
void Mutex::ReaderLock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}
bool Mutex::TryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
bool Mutex::ReaderTryLock() {
  static auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
void Mutex::LockWhen(const Condition& cond) {
  Lock();
  Await(cond);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  ReaderLock();
  WaitFor(this, cond, absl::InfiniteFuture(), /*reader=*/true);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  return LockWhenWithDeadline(cond, absl::Now() + timeout);
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  Lock();
  return WaitFor(this, cond, deadline, /*reader=*/false);
}
bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  return ReaderLockWhenWithDeadline(cond, absl::Now() + timeout);
}
bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  ReaderLock();
  return WaitFor(this, cond, deadline, /*reader=*/true);
}

// Releasing.
void Mutex::Unlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_release(this);
  real(this);
}
void Mutex::ReaderUnlock() {
  static auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  real(this);
}

// Releasing while waiting, then holding again.
void Mutex::Await(const Condition& cond) { WaitFor(this, cond, absl::InfiniteFuture(), /*reader=*/false); }
bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  return WaitFor(this, cond, absl::Now() + timeout, /*reader=*/false);
}
bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  return WaitFor(this, cond, deadline, /*reader=*/false);
}
void CondVar::Wait(Mutex* mu) {
  static auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(this, mu);
  __tsan_acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static auto real =
      Real<bool (*)(CondVar*, Mutex*, absl::Duration)>("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}
bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl
