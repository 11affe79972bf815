// Aligned host memory for slabs and staging buffers, from mimalloc.
//
// Note [mimalloc loading]
// Debian's libmimalloc.so is built to override malloc/free/new/delete. Linked into a Python
// extension it would interpose on part of the process (whatever binds to it first) while the rest
// keeps glibc's allocator, and a pointer crossing between them crashes. So mimalloc is loaded
// with dlopen(RTLD_LOCAL | RTLD_DEEPBIND) and only its mi_* entry points are used: it serves our
// slabs without replacing anyone's malloc. If the library cannot be loaded, aligned_alloc is
// used and a note is logged; sanitizer builds always use it, so ASan sees every slab.
#pragma once

#include <cstdint>
#include <string>

namespace ps {

// `alignment` must be a power of two. Returns nullptr when out of memory.
void* AlignedHostAlloc(int64_t bytes, int64_t alignment);
void AlignedHostFree(void* pointer);
// "mimalloc <version>" or "libc (reason)".
std::string HostAllocatorName();

}  // namespace ps
