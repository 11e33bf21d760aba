// tests/tsan_absl_shim.cc — ThreadSanitizer annotations for Debian's absl::Mutex (TSan stage of
// tests/run_sanitizers.sh only; never linked into kvtrie).
//
// Debian's libabsl_synchronization is not built with TSan, and absl::Mutex waits on futexes TSan
// cannot see, so every access guarded by an absl::Mutex would be reported as a race. This library
// is LD_PRELOADed into the TSan test processes: it interposes the Mutex and CondVar entry points
// (Debian 12's abseil 20220623, inline namespace debian3), calls the real ones (dlsym RTLD_NEXT)
// and tells TSan the mutex was released before / acquired after (__tsan_release/__tsan_acquire on
// its address). Built uninstrumented; the __tsan_* symbols come from the TSan executable (weak, so
// uninstrumented processes such as ctest load it harmlessly).
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" void __tsan_acquire(void* addr) __attribute__((weak));
extern "C" void __tsan_release(void* addr) __attribute__((weak));

namespace {

struct Duration {  // absl::Duration / absl::Time: 16 bytes, passed in two registers
  int64_t hi;
  uint32_t lo;
};

void* Real(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    fprintf(stderr, "tsan_absl_shim: %s not found\n", name);
    abort();
  }
  return f;
}
void Acquire(void* mu) {
  if (__tsan_acquire) __tsan_acquire(mu);
}
void Release(void* mu) {
  if (__tsan_release) __tsan_release(mu);
}

}  // namespace

#define KVTRIE_REAL(type, name) \
  static const auto real = reinterpret_cast<type>(Real(name))

#define LOCK_VOID(fn, sym)                                         \
  extern "C" void fn(void* mu) __asm__(sym);                       \
  extern "C" void fn(void* mu) {                                   \
    KVTRIE_REAL(void (*)(void*), sym);                             \
    real(mu);                                                      \
    Acquire(mu);                                                   \
  }
#define UNLOCK_VOID(fn, sym)                                       \
  extern "C" void fn(void* mu) __asm__(sym);                       \
  extern "C" void fn(void* mu) {                                   \
    KVTRIE_REAL(void (*)(void*), sym);                             \
    Release(mu);                                                   \
    real(mu);                                                      \
  }
#define TRY_LOCK(fn, sym)                                          \
  extern "C" bool fn(void* mu) __asm__(sym);                       \
  extern "C" bool fn(void* mu) {                                   \
    KVTRIE_REAL(bool (*)(void*), sym);                             \
    const bool locked = real(mu);                                  \
    if (locked) Acquire(mu);                                       \
    return locked;                                                 \
  }
#define LOCK_WHEN(fn, sym)                                         \
  extern "C" void fn(void* mu, const void* c) __asm__(sym);        \
  extern "C" void fn(void* mu, const void* c) {                    \
    KVTRIE_REAL(void (*)(void*, const void*), sym);                \
    real(mu, c);                                                   \
    Acquire(mu);                                                   \
  }
#define LOCK_WHEN_TIMED(fn, sym)                                   \
  extern "C" bool fn(void* mu, const void* c, Duration d) __asm__(sym); \
  extern "C" bool fn(void* mu, const void* c, Duration d) {        \
    KVTRIE_REAL(bool (*)(void*, const void*, Duration), sym);      \
    const bool r = real(mu, c, d);                                 \
    Acquire(mu);                                                   \
    return r;                                                      \
  }
#define AWAIT(fn, sym)                                             \
  extern "C" void fn(void* mu, const void* c) __asm__(sym);        \
  extern "C" void fn(void* mu, const void* c) {                    \
    KVTRIE_REAL(void (*)(void*, const void*), sym);                \
    Release(mu);                                                   \
    real(mu, c);                                                   \
    Acquire(mu);                                                   \
  }
#define AWAIT_TIMED(fn, sym)                                       \
  extern "C" bool fn(void* mu, const void* c, Duration d) __asm__(sym); \
  extern "C" bool fn(void* mu, const void* c, Duration d) {        \
    KVTRIE_REAL(bool (*)(void*, const void*, Duration), sym);      \
    Release(mu);                                                   \
    const bool r = real(mu, c, d);                                 \
    Acquire(mu);                                                   \
    return r;                                                      \
  }

#define CV_WAIT(fn, sym)                                           \
  extern "C" void fn(void* cv, void* mu) __asm__(sym);             \
  extern "C" void fn(void* cv, void* mu) {                         \
    KVTRIE_REAL(void (*)(void*, void*), sym);                      \
    Release(mu);                                                   \
    real(cv, mu);                                                  \
    Acquire(mu);                                                   \
  }
#define CV_WAIT_TIMED(fn, sym)                                     \
  extern "C" bool fn(void* cv, void* mu, Duration d) __asm__(sym); \
  extern "C" bool fn(void* cv, void* mu, Duration d) {             \
    KVTRIE_REAL(bool (*)(void*, void*, Duration), sym);            \
    Release(mu);                                                   \
    const bool r = real(cv, mu, d);                                \
    Acquire(mu);                                                   \
    return r;                                                      \
  }

LOCK_VOID(ShimLock, "_ZN4absl7debian35Mutex4LockEv")
LOCK_VOID(ShimReaderLock, "_ZN4absl7debian35Mutex10ReaderLockEv")
UNLOCK_VOID(ShimUnlock, "_ZN4absl7debian35Mutex6UnlockEv")
UNLOCK_VOID(ShimReaderUnlock, "_ZN4absl7debian35Mutex12ReaderUnlockEv")
TRY_LOCK(ShimTryLock, "_ZN4absl7debian35Mutex7TryLockEv")
TRY_LOCK(ShimReaderTryLock, "_ZN4absl7debian35Mutex13ReaderTryLockEv")
LOCK_WHEN(ShimLockWhen, "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE")
LOCK_WHEN(ShimReaderLockWhen, "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE")
LOCK_WHEN_TIMED(ShimLockWhenWithTimeout,
                "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
LOCK_WHEN_TIMED(ShimLockWhenWithDeadline,
                "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
AWAIT(ShimAwait, "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE")
AWAIT_TIMED(ShimAwaitWithTimeout,
            "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE")
AWAIT_TIMED(ShimAwaitWithDeadline,
            "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE")
// CondVar::Wait*(Mutex*): the mutex is released while waiting and held again on return.
CV_WAIT(ShimCondVarWait, "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE")
CV_WAIT_TIMED(ShimCondVarWaitWithTimeout,
            "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE")
CV_WAIT_TIMED(ShimCondVarWaitWithDeadline,
            "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE")
