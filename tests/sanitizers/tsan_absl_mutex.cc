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
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"

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
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  real(this, cond);
  __tsan_acquire(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  real(this, cond);
  __tsan_acquire(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      ("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);  // held either way
  return met;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      ("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
}
bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      ("5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);
  return met;
}
bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      ("5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
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
void Mutex::Await(const Condition& cond) {
  static auto real = Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  real(this, cond);
  __tsan_acquire(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      ("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  __tsan_release(this);
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);
  return met;
}
bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real =
      Real<bool (*)(Mutex*, const Condition&, absl::Time)>("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_release(this);
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
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
