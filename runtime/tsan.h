// ThreadSanitizer annotations for synchronization TSan cannot see.
//
// Note [Happens-before through the kernel]
// An io_uring request carries a pointer from the submitting thread to the reaper thread through
// memory the kernel writes (the completion ring), so TSan sees no edge between the submitter's
// writes to the request and the reaper's reads. PS_TSAN_RELEASE(p) before submitting and
// PS_TSAN_ACQUIRE(p) after reaping state that edge; both are no-ops outside TSan builds.
#pragma once

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define PS_TSAN_RELEASE(addr) __tsan_release(const_cast<void*>(static_cast<const void*>(addr)))
#define PS_TSAN_ACQUIRE(addr) __tsan_acquire(const_cast<void*>(static_cast<const void*>(addr)))
#else
#define PS_TSAN_RELEASE(addr) static_cast<void>(addr)
#define PS_TSAN_ACQUIRE(addr) static_cast<void>(addr)
#endif
