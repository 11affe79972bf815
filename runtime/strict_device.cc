// The strict emulated device (Note [Strict device] in runtime/strict_device.h).
#include "runtime/strict_device.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "runtime/logging.h"

namespace ps::gpu::strict {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  int64_t value = 0;
  if (text == nullptr || *text == '\0') return fallback;
  if (!absl::SimpleAtoi(text, &value) || value < 0) {
    PS_LOG(kWarning, "strict device: ignoring %s='%s' (not a non-negative integer)", name, text);
    return fallback;
  }
  return value;
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "strict device: %s\n", message.c_str());
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  std::abort();
}

// ---- Device memory ---------------------------------------------------------------------------

struct Allocation {
  uintptr_t base = 0;  // the PROT_NONE mapping: the device pointer
  int64_t bytes = 0;
  char* alias = nullptr;  // the read-write mapping of the same pages
  int device = -1;        // -1: pinned host memory
  int64_t serial = 0;
};

// What the SIGSEGV handler may read: fixed slots of atomics, no locks.
struct FaultSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<int> device{0};
  std::atomic<int64_t> serial{0};
};
constexpr int kFaultSlots = 4096;
FaultSlot g_fault_slots[kFaultSlots];
struct sigaction g_previous_segv;

void WriteString(const char* text) { (void)!write(STDERR_FILENO, text, std::strlen(text)); }

void WriteNumber(uint64_t value, int base) {
  char buffer[32];
  int n = 0;
  do {
    buffer[n++] = "0123456789abcdef"[value % base];
    value /= base;
  } while (value != 0);
  char out[34];
  int k = 0;
  if (base == 16) {
    out[k++] = '0';
    out[k++] = 'x';
  }
  while (n > 0) out[k++] = buffer[--n];
  out[k] = '\0';
  WriteString(out);
}

void OnSegv(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (FaultSlot& slot : g_fault_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= slot.end.load(std::memory_order_acquire)) {
      continue;
    }
    WriteString("strict device: the host touched device memory at ");
    WriteNumber(address, 16);
    WriteString(" (offset ");
    WriteNumber(address - begin, 10);
    WriteString(" of cudaMalloc #");
    WriteNumber(static_cast<uint64_t>(slot.serial.load()), 10);
    WriteString(" on device ");
    WriteNumber(static_cast<uint64_t>(slot.device.load()), 10);
    WriteString(
        "); device memory is reached only by copies, memsets and kernels (Note [Strict "
        "device] in runtime/strict_device.h). The host call that touched it:\n");
    void* frames[64];
    const int depth = backtrace(frames, 64);
    backtrace_symbols_fd(frames, depth, STDERR_FILENO);
    break;
  }
  // Hand over to whoever handled SIGSEGV before (Python's faulthandler prints its traceback);
  // returning re-runs the faulting access under that handler.
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
  (void)signal;
  (void)context;
}

class Memory {
 public:
  Memory()
      : devices_(static_cast<int>(EnvInt("PATRICKSTAR_STRICT_DEVICE_COUNT", 8))),
        capacity_(EnvInt("PATRICKSTAR_STRICT_DEVICE_MEMORY", int64_t{16} << 30)),
        used_(static_cast<size_t>(std::max(devices_, 0)), 0) {
    struct sigaction action{};
    action.sa_sigaction = OnSegv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
  }

  int devices() const { return devices_; }

  absl::StatusOr<void*> Allocate(int device, int64_t bytes) {
    if (bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("allocation of ", bytes, " bytes"));
    }
    absl::MutexLock lock(&mutex_);
    if (device >= 0) {
      if (used_[device] + bytes > capacity_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "cudaMalloc(", bytes, " bytes) on device ", device, ": cudaErrorMemoryAllocation (",
            used_[device], " of ", capacity_, " bytes in use, PATRICKSTAR_STRICT_DEVICE_MEMORY)"));
      }
    }
    Allocation allocation;
    allocation.bytes = bytes;
    allocation.device = device;
    allocation.serial = ++serial_;
    if (device < 0) {  // pinned host memory: plain host pages the host may touch
      void* pages =
          mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (pages == MAP_FAILED) {
        return absl::ResourceExhaustedError(absl::StrCat("cudaHostAlloc(", bytes, " bytes)"));
      }
      allocation.base = reinterpret_cast<uintptr_t>(pages);
      allocation.alias = static_cast<char*>(pages);
    } else {
      const int fd = memfd_create("ps-strict-device", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, bytes) != 0) {
        if (fd >= 0) close(fd);
        return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc(", bytes, " bytes): memfd"));
      }
      void* guarded = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED, fd, 0);
      void* alias = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (guarded == MAP_FAILED || alias == MAP_FAILED) {
        if (guarded != MAP_FAILED) munmap(guarded, bytes);
        if (alias != MAP_FAILED) munmap(alias, bytes);
        return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc(", bytes, " bytes): mmap"));
      }
      allocation.base = reinterpret_cast<uintptr_t>(guarded);
      allocation.alias = static_cast<char*>(alias);
      used_[device] += bytes;
      for (FaultSlot& slot : g_fault_slots) {
        if (slot.begin.load() != 0) continue;
        slot.device.store(device);
        slot.serial.store(allocation.serial);
        slot.end.store(allocation.base + bytes, std::memory_order_release);
        slot.begin.store(allocation.base, std::memory_order_release);
        break;
      }
    }
    allocations_[allocation.base] = allocation;
    return reinterpret_cast<void*>(allocation.base);
  }

  // Returns false when `pointer` is no allocation of this kind.
  bool Free(void* pointer, bool device) {
    Allocation allocation;
    {
      absl::MutexLock lock(&mutex_);
      auto it = allocations_.find(reinterpret_cast<uintptr_t>(pointer));
      if (it == allocations_.end() || (it->second.device >= 0) != device) return false;
      allocation = it->second;
      allocations_.erase(it);
      if (device) {
        used_[allocation.device] -= allocation.bytes;
        for (FaultSlot& slot : g_fault_slots) {
          if (slot.begin.load() == allocation.base) {
            slot.begin.store(0, std::memory_order_release);
            break;
          }
        }
      }
    }
    if (device) munmap(reinterpret_cast<void*>(allocation.base), allocation.bytes);
    munmap(allocation.alias, allocation.bytes);
    return true;
  }

  // The allocation holding [pointer, pointer + bytes), if any; sets *straddles when the range
  // starts inside one but runs past its end.
  std::optional<Allocation> Find(const void* pointer, int64_t bytes, bool* straddles) const {
    const auto address = reinterpret_cast<uintptr_t>(pointer);
    absl::ReaderMutexLock lock(&mutex_);
    auto it = allocations_.upper_bound(address);
    if (it == allocations_.begin()) return std::nullopt;
    --it;
    const Allocation& found = it->second;
    if (address >= found.base + static_cast<uint64_t>(found.bytes)) return std::nullopt;
    if (straddles != nullptr) {
      *straddles = address + static_cast<uint64_t>(std::max<int64_t>(bytes, 1)) >
                   found.base + static_cast<uint64_t>(found.bytes);
    }
    return found;
  }

 private:
  const int devices_;
  const int64_t capacity_;
  mutable absl::Mutex mutex_;
  std::vector<int64_t> used_ ABSL_GUARDED_BY(mutex_);
  std::map<uintptr_t, Allocation> allocations_ ABSL_GUARDED_BY(mutex_);
  int64_t serial_ ABSL_GUARDED_BY(mutex_) = 0;
};

Memory& GetMemory() {
  static Memory* memory = new Memory;  // never destroyed: streams may outlive static teardown
  return *memory;
}

// ---- Streams and events ----------------------------------------------------------------------

using Marker = std::shared_ptr<absl::Notification>;

struct Op {
  enum Kind { kCopy, kKernel, kRecord, kWait } kind = kKernel;
  std::function<void()> work;  // kCopy, kKernel
  Marker marker;               // kRecord: notified when reached; kWait: waited on
  std::vector<MemoryRange> touched;
  std::string what;
};

class StreamImpl {
 public:
  explicit StreamImpl(int device) : device_(device), worker_([this] { Run(); }) {}
  ~StreamImpl() {
    {
      absl::MutexLock lock(&mutex_);
      stopping_ = true;
    }
    worker_.join();
  }

  int device() const { return device_; }

  void Push(Op op) {
    absl::MutexLock lock(&mutex_);
    queue_.push_back(std::move(op));
  }

  // The first queued (or running) op touching [begin, end), described; empty when none.
  std::string PendingOn(uintptr_t begin, uintptr_t end) const {
    absl::MutexLock lock(&mutex_);
    for (const Op& op : queue_) {
      for (const MemoryRange& range : op.touched) {
        const auto first = reinterpret_cast<uintptr_t>(range.pointer);
        if (first < end && begin < first + static_cast<uint64_t>(range.bytes)) return op.what;
      }
    }
    return "";
  }

 private:
  void Run() {
    while (true) {
      Op op;
      {
        absl::MutexLock lock(&mutex_);
        mutex_.Await(absl::Condition(
            +[](StreamImpl* self) { return self->stopping_ || !self->queue_.empty(); }, this));
        if (queue_.empty()) return;  // stopping with nothing left: CUDA finishes queued work
        op = queue_.front();         // stays queued (and visible to CheckIdle) while it runs
      }
      switch (op.kind) {
        case Op::kKernel: {
          const absl::Duration delay = KernelDelay();
          if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
          op.work();
          break;
        }
        case Op::kCopy:
          op.work();
          break;
        case Op::kRecord:
          op.marker->Notify();
          break;
        case Op::kWait:
          op.marker->WaitForNotification();
          break;
      }
      absl::MutexLock lock(&mutex_);
      queue_.pop_front();
    }
  }

  const int device_;
  mutable absl::Mutex mutex_;
  std::deque<Op> queue_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread worker_;  // last: started once the rest exists
};

struct EventImpl {
  int device = 0;
  absl::Mutex mutex;
  Marker last ABSL_GUARDED_BY(mutex);  // the latest record; null before the first
};

// Every live stream, for CheckIdle and SynchronizeDevice.
struct Registry {
  absl::Mutex mutex;
  std::vector<StreamImpl*> streams ABSL_GUARDED_BY(mutex);
  std::map<int, Stream> compute ABSL_GUARDED_BY(mutex);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

std::atomic<int64_t> g_delay_ns{-1};

StreamImpl* ImplOf(Stream stream) { return static_cast<StreamImpl*>(stream.handle); }
EventImpl* ImplOf(Event event) { return static_cast<EventImpl*>(event.handle); }

absl::Status CheckDevice(int device) {
  if (device < 0 || device >= GetMemory().devices()) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " does not exist (",
                                                   GetMemory().devices(),
                                                   " present: the strict emulated device)"));
  }
  return absl::OkStatus();
}

// Where emulated work reaches [pointer, pointer + bytes): the alias of device memory, or the
// host pointer itself. A range running past its allocation is cudaErrorInvalidValue.
// `pageable`: set to whether the range is host memory the emulation did not allocate (Note
// [Pageable host memory in async copies]).
absl::StatusOr<char*> Reach(const void* pointer, int64_t bytes, absl::string_view what,
                            bool* pageable = nullptr) {
  bool straddles = false;
  const std::optional<Allocation> found = GetMemory().Find(pointer, bytes, &straddles);
  if (pageable != nullptr) *pageable = !found.has_value();
  if (!found.has_value() || found->device < 0) {
    return static_cast<char*>(const_cast<void*>(pointer));
  }
  if (straddles) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", bytes, " bytes at offset ", reinterpret_cast<uintptr_t>(pointer) - found->base,
        " run past cudaMalloc #", found->serial, " of ", found->bytes, " bytes"));
  }
  return found->alias + (reinterpret_cast<uintptr_t>(pointer) - found->base);
}

}  // namespace

bool Enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("PATRICKSTAR_STRICT_DEVICE");
    return text != nullptr && std::string(text) == "1";
  }();
  return enabled;
}

int DeviceCount() { return GetMemory().devices(); }

absl::StatusOr<void*> HostAllocPinned(int64_t bytes) { return GetMemory().Allocate(-1, bytes); }

void HostFreePinned(void* pointer) {
  if (pointer == nullptr) return;
  if (!GetMemory().Free(pointer, /*device=*/false)) {
    Die(absl::StrCat("cudaFreeHost(", reinterpret_cast<uintptr_t>(pointer),
                     ") of memory cudaHostAlloc did not return"));
  }
}

absl::StatusOr<void*> DeviceMalloc(int device, int64_t bytes) {
  if (absl::Status status = CheckDevice(device); !status.ok()) return status;
  return GetMemory().Allocate(device, bytes);
}

void DeviceFree(int device, void* pointer) {
  if (pointer == nullptr) return;
  // cudaFree waits for the device's work first; so does this, then checks nothing queued later
  // can still reach the memory.
  (void)SynchronizeDevice(device);
  if (!GetMemory().Free(pointer, /*device=*/true)) {
    Die(absl::StrCat("cudaFree(", reinterpret_cast<uintptr_t>(pointer), ") on device ", device,
                     " of memory cudaMalloc did not return"));
  }
}

absl::StatusOr<Stream> CreateStream(int device) {
  if (absl::Status status = CheckDevice(device); !status.ok()) return status;
  auto* impl = new StreamImpl(device);
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mutex);
  registry.streams.push_back(impl);
  return Stream{impl, device};
}

void DestroyStream(Stream stream) {
  StreamImpl* impl = ImplOf(stream);
  if (impl == nullptr) return;
  {
    Registry& registry = GetRegistry();
    absl::MutexLock lock(&registry.mutex);
    registry.streams.erase(std::remove(registry.streams.begin(), registry.streams.end(), impl),
                           registry.streams.end());
  }
  delete impl;  // runs what is queued first, as cudaStreamDestroy lets the device do
}

absl::Status SynchronizeStream(Stream stream) {
  StreamImpl* impl = ImplOf(stream);
  if (impl == nullptr) return absl::InvalidArgumentError("cudaStreamSynchronize: null stream");
  auto marker = std::make_shared<absl::Notification>();
  impl->Push(Op{Op::kRecord, nullptr, marker, {}, "synchronize"});
  marker->WaitForNotification();
  return absl::OkStatus();
}

absl::StatusOr<Event> CreateEvent(int device) {
  if (absl::Status status = CheckDevice(device); !status.ok()) return status;
  auto* impl = new EventImpl;
  impl->device = device;
  return Event{impl, device};
}

void DestroyEvent(Event event) {
  // As cudaEventDestroy: allowed while a record is pending; the marker outlives the event.
  delete ImplOf(event);
}

absl::Status RecordEvent(Event event, Stream stream) {
  EventImpl* impl = ImplOf(event);
  if (impl == nullptr || ImplOf(stream) == nullptr) {
    return absl::InvalidArgumentError("cudaEventRecord: null event or stream");
  }
  if (impl->device != stream.device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cudaEventRecord: an event of device ", impl->device, " recorded on a stream of device ",
        stream.device, " (cudaErrorInvalidResourceHandle)"));
  }
  auto marker = std::make_shared<absl::Notification>();
  {
    absl::MutexLock lock(&impl->mutex);
    impl->last = marker;
  }
  ImplOf(stream)->Push(Op{Op::kRecord, nullptr, marker, {}, "event record"});
  return absl::OkStatus();
}

namespace {
Marker LastRecord(Event event) {
  EventImpl* impl = ImplOf(event);
  absl::MutexLock lock(&impl->mutex);
  return impl->last;
}
}  // namespace

absl::Status SynchronizeEvent(Event event) {
  if (ImplOf(event) == nullptr) return absl::InvalidArgumentError("cudaEventSynchronize: null");
  if (Marker marker = LastRecord(event); marker != nullptr) marker->WaitForNotification();
  return absl::OkStatus();
}

absl::StatusOr<bool> QueryEvent(Event event) {
  if (ImplOf(event) == nullptr) return absl::InvalidArgumentError("cudaEventQuery: null");
  const Marker marker = LastRecord(event);
  return marker == nullptr || marker->HasBeenNotified();
}

absl::Status StreamWaitEvent(Stream stream, Event event) {
  if (ImplOf(stream) == nullptr || ImplOf(event) == nullptr) {
    return absl::InvalidArgumentError("cudaStreamWaitEvent: null stream or event");
  }
  // A never-recorded event is complete: the wait is a no-op, as in CUDA.
  if (Marker marker = LastRecord(event); marker != nullptr) {
    ImplOf(stream)->Push(Op{Op::kWait, nullptr, std::move(marker), {}, "event wait"});
  }
  return absl::OkStatus();
}

// Note [Pageable host memory in async copies]
// cudaMemcpyAsync is asynchronous only for pinned host memory. From pageable memory (plain
// malloc, a std::vector) CUDA stages the source before returning, so the caller may reuse or
// free it at once; into pageable memory it returns only once the copy is done. The emulation
// keeps those rules rather than stricter ones: a pageable source is snapshotted at the call and a
// pageable destination waits for its stream. (A test that passed a temporary vector to
// ToDevice() read freed bytes here now and then, a failure CUDA would never show.) Pinned memory
// stays asynchronous, as on a GPU, so a pinned buffer reused too early still reads wrong bytes.
absl::Status CopyAsync(void* dst, const void* src, int64_t bytes, Stream stream) {
  if (ImplOf(stream) == nullptr) return absl::InvalidArgumentError("cudaMemcpyAsync: null stream");
  if (bytes == 0) return absl::OkStatus();
  const std::string what = absl::StrCat("cudaMemcpyAsync(", bytes, " bytes)");
  bool dst_pageable = false, src_pageable = false;
  absl::StatusOr<char*> to = Reach(dst, bytes, what, &dst_pageable);
  if (!to.ok()) return to.status();
  absl::StatusOr<char*> from = Reach(src, bytes, what, &src_pageable);
  if (!from.ok()) return from.status();
  std::function<void()> copy;
  if (src_pageable) {
    auto staged = std::make_shared<std::vector<char>>(*from, *from + bytes);
    copy = [to = *to, staged] { std::memcpy(to, staged->data(), staged->size()); };
  } else {
    copy = [to = *to, from = *from, bytes] { std::memcpy(to, from, static_cast<size_t>(bytes)); };
  }
  ImplOf(stream)->Push(Op{Op::kCopy, std::move(copy), nullptr, {{dst, bytes}, {src, bytes}}, what});
  if (dst_pageable) return strict::SynchronizeStream(stream);
  return absl::OkStatus();
}

absl::Status MemsetAsync(void* dst, int value, int64_t bytes, Stream stream) {
  if (ImplOf(stream) == nullptr) return absl::InvalidArgumentError("cudaMemsetAsync: null stream");
  if (bytes == 0) return absl::OkStatus();
  const std::string what = absl::StrCat("cudaMemsetAsync(", bytes, " bytes)");
  absl::StatusOr<char*> to = Reach(dst, bytes, what);
  if (!to.ok()) return to.status();
  ImplOf(stream)->Push(
      Op{Op::kKernel,
         [to = *to, value, bytes] { std::memset(to, value, static_cast<size_t>(bytes)); },
         nullptr,
         {{dst, bytes}},
         what});
  return absl::OkStatus();
}

absl::Status LaunchWork(Stream stream, std::vector<MemoryRange> touched,
                        std::function<void()> work) {
  if (ImplOf(stream) == nullptr) return absl::InvalidArgumentError("kernel launch: null stream");
  for (const MemoryRange& range : touched) {
    const int device = DeviceOf(range.pointer);
    if (device >= 0 && device != stream.device) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kernel launch on device ", stream.device, " touches memory of device ", device,
          " (cudaErrorIllegalAddress: no peer access; is the device index the local rank?)"));
    }
  }
  ImplOf(stream)->Push(Op{Op::kKernel, std::move(work), nullptr, std::move(touched), "kernel"});
  return absl::OkStatus();
}

absl::StatusOr<Stream> ComputeStream(int device) {
  if (absl::Status status = CheckDevice(device); !status.ok()) return status;
  Registry& registry = GetRegistry();
  {
    absl::MutexLock lock(&registry.mutex);
    auto it = registry.compute.find(device);
    if (it != registry.compute.end()) return it->second;
  }
  absl::StatusOr<Stream> stream = CreateStream(device);
  if (!stream.ok()) return stream.status();
  absl::MutexLock lock(&registry.mutex);
  registry.compute.emplace(device, *stream);
  return *stream;
}

absl::Status SynchronizeDevice(int device) {
  std::vector<Marker> markers;
  {
    Registry& registry = GetRegistry();
    absl::MutexLock lock(&registry.mutex);
    for (StreamImpl* impl : registry.streams) {
      if (impl->device() != device) continue;
      auto marker = std::make_shared<absl::Notification>();
      impl->Push(Op{Op::kRecord, nullptr, marker, {}, "device synchronize"});
      markers.push_back(std::move(marker));
    }
  }
  for (const Marker& marker : markers) marker->WaitForNotification();
  return absl::OkStatus();
}

void* WorkPointer(const void* pointer) {
  const std::optional<Allocation> found = GetMemory().Find(pointer, 0, nullptr);
  if (!found.has_value() || found->device < 0) return const_cast<void*>(pointer);
  return found->alias + (reinterpret_cast<uintptr_t>(pointer) - found->base);
}

int DeviceOf(const void* pointer) {
  const std::optional<Allocation> found = GetMemory().Find(pointer, 0, nullptr);
  return found.has_value() ? found->device : -1;
}

absl::Status CheckIdle(const void* pointer, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(pointer);
  const uintptr_t end = begin + static_cast<uint64_t>(bytes);
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mutex);
  for (StreamImpl* impl : registry.streams) {
    const std::string pending = impl->PendingOn(begin, end);
    if (!pending.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "freeing ", bytes, " bytes of device memory at ", begin, " while a queued ", pending,
          " on device ", impl->device(),
          " still uses them (record an event after that work and make the next user wait on "
          "it, or synchronize, before the block is reused)"));
    }
  }
  return absl::OkStatus();
}

void SetKernelDelay(absl::Duration delay) {
  g_delay_ns.store(absl::ToInt64Nanoseconds(delay), std::memory_order_relaxed);
}

absl::Duration KernelDelay() {
  int64_t ns = g_delay_ns.load(std::memory_order_relaxed);
  if (ns < 0) {
    ns = EnvInt("PATRICKSTAR_STRICT_DEVICE_DELAY_US", 200) * 1000;
    g_delay_ns.store(ns, std::memory_order_relaxed);
  }
  return absl::Nanoseconds(ns);
}

}  // namespace ps::gpu::strict
