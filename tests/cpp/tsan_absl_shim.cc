// Linked into the test binaries of ThreadSanitizer builds only (PS_TSAN, tools/test.sh --tsan).
//
// Note [TSan and Debian's Abseil]
// Debian's libabsl_synchronization is not built with -fsanitize=thread, so TSan never sees its
// mutexes lock and unlock: every access guarded by an absl::Mutex would be reported as a race.
// Rather than carry a TSan build of Abseil, this file interposes the entry points the runtime
// uses (the executable's definitions win over the shared library's, and the library's own
// calls, e.g. Notification's, go through its PLT to these too), calls the real function through
// dlsym(RTLD_NEXT) and tells TSan what happened with its mutex annotations. Accesses inside the
// real functions (absl's bookkeeping, and Condition functions it evaluates with the lock held)
// fall between pre/post annotations, which TSan ignores.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

// In libtsan, not declared by <sanitizer/tsan_interface.h>: ignore this thread's accesses.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();

namespace {

#define PS_STR2(x) #x
#define PS_STR(x) PS_STR2(x)

// "_ZN4absl" + <inline namespace> + rest: the Itanium mangling of absl::<ns>::rest.
template <typename F>
F Real(const char* rest, const char* prefix = "_ZN") {
  const char* ns = PS_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string symbol =
      std::string(prefix) + "4absl" + std::to_string(std::strlen(ns)) + ns + rest;
  void* function = dlsym(RTLD_NEXT, symbol.c_str());
  if (function == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found\n", symbol.c_str());
    std::abort();
  }
  return reinterpret_cast<F>(function);
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  __tsan_mutex_pre_lock(this, 0);
  real(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_mutex_pre_unlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  __tsan_mutex_pre_lock(this, 0);
  real(this, cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

// Await releases the lock, waits, and takes it again.
void Mutex::Await(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  __tsan_mutex_pre_unlock(this, 0);
  __tsan_mutex_post_unlock(this, 0);
  __tsan_mutex_pre_lock(this, 0);
  real(this, cond);
  __tsan_mutex_post_lock(this, 0, 0);
}

// The same with a deadline (CollectiveState::Wait, so every collective's handle).
bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  __tsan_mutex_pre_unlock(this, 0);
  __tsan_mutex_post_unlock(this, 0);
  __tsan_mutex_pre_lock(this, 0);
  const bool satisfied = real(this, cond, timeout);
  __tsan_mutex_post_lock(this, 0, 0);
  return satisfied;
}

Mutex::~Mutex() {
  static const auto real = Real<void (*)(Mutex*)>("5MutexD2Ev");
  __tsan_mutex_destroy(this, 0);
  // Deadlock detection's global graph (GraphCycles::RemoveNode) is guarded by a lock of the
  // uninstrumented library: its memmoves would be reported as races between destructors.
  __tsan_ignore_thread_begin();
  real(this);
  __tsan_ignore_thread_end();
}

// The fast path returns without touching the mutex when notified_yet_ is already set (an
// atomic the uninstrumented library wrote): acquire what Notify()'s unlock released.
void Notification::WaitForNotification() const {
  static const auto real =
      Real<void (*)(const Notification*)>("12Notification19WaitForNotificationEv", "_ZNK");
  real(this);
  __tsan_acquire(const_cast<Mutex*>(&mutex_));
}

// Status payloads are reference counted; the decrement lives in the uninstrumented library while
// copies happen in our (instrumented) code on other threads. The last owner must see every
// earlier owner's accesses before it deletes the rep.
void Status::UnrefNonInlined(uintptr_t rep) {
  static const auto real = Real<void (*)(uintptr_t)>("6Status15UnrefNonInlinedEm");
  void* pointer = reinterpret_cast<void*>(rep - 1);
  __tsan_release(pointer);
  __tsan_acquire(pointer);
  real(rep);
}

ABSL_NAMESPACE_END
}  // namespace absl
