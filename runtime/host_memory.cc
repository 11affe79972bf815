#include "runtime/host_memory.h"

#include <dlfcn.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "runtime/logging.h"

namespace ps {
namespace {

struct Allocator {
  void* (*malloc_aligned)(size_t, size_t) = nullptr;
  void (*free)(void*) = nullptr;
  std::string name;
};

const Allocator& GetAllocator() {
  static const Allocator allocator = [] {
    Allocator a;
#ifdef PS_SANITIZE_BUILD
    // ASan cannot see inside mimalloc's pages and refuses RTLD_DEEPBIND.
    a.name = "libc aligned_alloc (sanitizer build)";
    return a;
#endif
    const char* candidates[] = {PS_MIMALLOC_LIBRARY, "libmimalloc.so.2", "libmimalloc.so"};
    std::string errors;
    for (const char* candidate : candidates) {
      if (candidate == nullptr || candidate[0] == '\0') continue;
      void* handle = dlopen(candidate, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle == nullptr) {
        absl::StrAppend(&errors, errors.empty() ? "" : "; ", dlerror());
        continue;
      }
      auto malloc_aligned =
          reinterpret_cast<void* (*)(size_t, size_t)>(dlsym(handle, "mi_malloc_aligned"));
      auto free = reinterpret_cast<void (*)(void*)>(dlsym(handle, "mi_free"));
      auto version = reinterpret_cast<int (*)()>(dlsym(handle, "mi_version"));
      if (malloc_aligned == nullptr || free == nullptr) continue;
      a.malloc_aligned = malloc_aligned;
      a.free = free;
      a.name = absl::StrCat("mimalloc ", version != nullptr ? version() : 0);
      return a;
    }
    a.name = absl::StrCat("libc aligned_alloc (mimalloc not loadable: ", errors, ")");
    PS_LOG(kInfo, "host memory from %s", a.name);
    return a;
  }();
  return allocator;
}

}  // namespace

void* AlignedHostAlloc(int64_t bytes, int64_t alignment) {
  const Allocator& allocator = GetAllocator();
  if (allocator.malloc_aligned != nullptr) {
    return allocator.malloc_aligned(static_cast<size_t>(bytes), static_cast<size_t>(alignment));
  }
  const int64_t rounded = (bytes + alignment - 1) / alignment * alignment;
  return std::aligned_alloc(static_cast<size_t>(alignment), static_cast<size_t>(rounded));
}

void AlignedHostFree(void* pointer) {
  if (pointer == nullptr) return;
  const Allocator& allocator = GetAllocator();
  if (allocator.free != nullptr) {
    allocator.free(pointer);
  } else {
    std::free(pointer);
  }
}

std::string HostAllocatorName() { return GetAllocator().name; }

}  // namespace ps
