#include "runtime/copy_engine.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory.h"
#include "runtime/nvme_tier.h"
#include "runtime/status.h"

namespace ps {
namespace {

NvmeTier* AsNvme(const Block& block) {
  return block.tier->address_space() == AddressSpace::kFile ? static_cast<NvmeTier*>(block.tier)
                                                            : nullptr;
}

struct AlignedBuffer {
  explicit AlignedBuffer(int64_t bytes) : data(AlignedHostAlloc(bytes, kBlockAlignment)) {}
  ~AlignedBuffer() { AlignedHostFree(data); }
  void* data;
};

std::string Describe(const Block& block) {
  return absl::StrCat("block ", block.id, " of tier '", block.tier->name(), "'");
}

}  // namespace

absl::Status CopyHandle::Wait() const {
  if (state_ == nullptr) return absl::FailedPreconditionError("Wait() on an empty CopyHandle");
  state_->done.WaitForNotification();
  return state_->status;
}

bool CopyHandle::Done() const { return state_ == nullptr || state_->done.HasBeenNotified(); }

CopyEngine::CopyEngine(Options options)
    : options_(options), pool_(options.host_threads, "ps-copy") {}

CopyEngine::~CopyEngine() {
  WaitAll();
  absl::MutexLock lock(&gpu_mutex_);
  for (gpu::Event event : all_events_) gpu::DestroyEvent(event);
  gpu::DestroyStream(to_device_stream_);
  gpu::DestroyStream(from_device_stream_);
}

void CopyEngine::WaitAll() {
  absl::MutexLock lock(&mutex_);
  mutex_.Await(absl::Condition(
      +[](int64_t* in_flight) { return *in_flight == 0; }, &in_flight_));
}

absl::Status CopyEngine::CopyAndWait(const Block& src, const Block& dst) {
  PS_ASSIGN_OR_RETURN(CopyHandle handle, Copy(src, dst));
  return handle.Wait();
}

absl::StatusOr<CopyHandle> CopyEngine::Copy(const Block& src, const Block& dst) {
  if (src.tier == nullptr || dst.tier == nullptr || src.is_null() || dst.is_null()) {
    return absl::InvalidArgumentError("copy: source or destination is not a block");
  }
  if (src.tier == dst.tier && src.id == dst.id) {
    return absl::InvalidArgumentError(absl::StrCat("copy: ", Describe(src), " onto itself"));
  }
  if (dst.bytes < src.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("copy: ", Describe(src), " holds ", src.bytes,
                                                   " bytes but ", Describe(dst), " only ",
                                                   dst.bytes));
  }
  PS_ASSIGN_OR_RETURN(bool src_valid, src.tier->IsValid(src));
  if (!src_valid) {
    return absl::FailedPreconditionError(
        absl::StrCat("copy: ", Describe(src),
                     " holds no complete data (never written, or a copy into it "
                     "failed or is still in flight)"));
  }
  PS_RETURN_IF_ERROR(src.tier->Pin(src));
  if (absl::Status status = dst.tier->BeginWrite(dst); !status.ok()) {
    src.tier->Unpin(src);
    return status;
  }
  {
    absl::MutexLock lock(&mutex_);
    ++in_flight_;
  }
  CopyHandle handle;
  handle.state_ = std::make_shared<CopyHandle::State>();
  auto state = handle.state_;
  NvmeTier* src_nvme = AsNvme(src);
  NvmeTier* dst_nvme = AsNvme(dst);
  const AddressSpace from = src.tier->address_space();
  const AddressSpace to = dst.tier->address_space();
  const int64_t bytes = src.bytes;
  auto finish = [this, src, dst, state](absl::Status status) {
    Finish(src, dst, state, std::move(status));
  };

  if (options_.faults != nullptr) {
    const IoFault fault = options_.faults->Next(FaultSite::kCopy, bytes);
    if (fault.error != 0) {
      pool_.Schedule([finish, error = fault.error] {
        finish(ErrnoToStatus(error, "injected copy fault (PATRICKSTAR_FAULT_INJECT)"));
      });
      return handle;
    }
  }
  if (from == AddressSpace::kHostMemory && to == AddressSpace::kHostMemory) {
    pool_.Schedule([this, src, dst, state] { RunMemoryCopy(src, dst, state); });
  } else if (from == AddressSpace::kHostMemory && dst_nvme != nullptr) {
    dst_nvme->SubmitWrite(dst, src.data(), bytes, finish);
  } else if (src_nvme != nullptr && to == AddressSpace::kHostMemory) {
    src_nvme->SubmitRead(src, dst.data(), bytes, finish);
  } else if (src_nvme == nullptr && dst_nvme == nullptr) {
    // At least one side is device memory; device -> device uses the upload stream.
    const bool to_device = to == AddressSpace::kDeviceMemory;
    pool_.Schedule([this, src, dst, bytes, to_device, finish] {
      finish(RunDeviceCopy(dst.data(), src.data(), bytes, to_device));
    });
  } else {
    // Staged through host memory: file -> file, device -> file, file -> device.
    pool_.Schedule([this, src, dst, src_nvme, dst_nvme, bytes, finish] {
      AlignedBuffer staging(bytes);
      if (staging.data == nullptr) {
        finish(absl::ResourceExhaustedError(
            absl::StrCat("copy: no host memory for a staging buffer of ", FormatBytes(bytes))));
        return;
      }
      absl::Status status = src_nvme != nullptr
                                ? src_nvme->TransferAndWait(IoOp::kRead, src, staging.data, bytes)
                                : RunDeviceCopy(staging.data, src.data(), bytes, false);
      if (status.ok()) {
        status = dst_nvme != nullptr
                     ? dst_nvme->TransferAndWait(IoOp::kWrite, dst, staging.data, bytes)
                     : RunDeviceCopy(dst.data(), staging.data, bytes, true);
      }
      finish(std::move(status));
    });
  }
  return handle;
}

void CopyEngine::RunMemoryCopy(const Block& src, const Block& dst,
                               std::shared_ptr<CopyHandle::State> state) {
  std::memcpy(dst.data(), src.data(), static_cast<size_t>(src.bytes));
  Finish(src, dst, std::move(state), absl::OkStatus());
}

absl::Status CopyEngine::EnsureGpuStreams() {
  if (to_device_stream_.handle != nullptr) return absl::OkStatus();
  PS_ASSIGN_OR_RETURN(to_device_stream_, gpu::CreateStream(options_.device));
  PS_ASSIGN_OR_RETURN(from_device_stream_, gpu::CreateStream(options_.device));
  return absl::OkStatus();
}

absl::StatusOr<gpu::Event> CopyEngine::TakeEvent() {
  if (!free_events_.empty()) {
    gpu::Event event = free_events_.back();
    free_events_.pop_back();
    return event;
  }
  PS_ASSIGN_OR_RETURN(gpu::Event event, gpu::CreateEvent(options_.device));
  all_events_.push_back(event);
  return event;
}

void CopyEngine::ReturnEvent(gpu::Event event) {
  absl::MutexLock lock(&gpu_mutex_);
  free_events_.push_back(event);
}

absl::Status CopyEngine::RunDeviceCopy(void* dst, const void* src, int64_t bytes, bool to_device) {
  // Note [Copy stream ordering]: copies are enqueued on non-blocking streams (one per direction,
  // so uploads and downloads overlap) and each records its own event, which only the worker
  // thread waits on, and the lock is held just for enqueueing, so copies in flight do not
  // serialize one another. A copy that lands on the device is complete before the chunk is
  // handed to compute (the host waited for its event). The other direction is not free: work
  // that compute streams enqueued on a block (torch's gradient store) may not have run when the
  // chunk manager copies the block out or reuses it, so whoever enqueues such work calls
  // OrderAfter(stream) before releasing the chunk, and the copy streams wait on it.
  gpu::Event event;
  {
    absl::MutexLock lock(&gpu_mutex_);
    PS_RETURN_IF_ERROR(Annotate(EnsureGpuStreams(), "copy engine"));
    PS_ASSIGN_OR_RETURN(event, TakeEvent());
    const gpu::Stream stream = to_device ? to_device_stream_ : from_device_stream_;
    absl::Status enqueued = gpu::CopyAsync(dst, src, bytes, stream);
    if (enqueued.ok()) enqueued = gpu::RecordEvent(event, stream);
    if (!enqueued.ok()) {
      free_events_.push_back(event);
      return enqueued;
    }
  }
  absl::Status status = gpu::SynchronizeEvent(event);
  ReturnEvent(event);
  return status;
}

absl::Status CopyEngine::Fill(const Block& block, int value) {
  if (block.tier == nullptr || block.is_null()) {
    return absl::InvalidArgumentError("fill: not a block");
  }
  switch (block.tier->address_space()) {
    case AddressSpace::kHostMemory:
      std::memset(block.data(), value, static_cast<size_t>(block.bytes));
      return absl::OkStatus();
    case AddressSpace::kFile:
      return absl::InvalidArgumentError(
          absl::StrCat("fill: ", Describe(block), " is a file range, not memory"));
    case AddressSpace::kDeviceMemory:
      break;
  }
  gpu::Event event;
  {
    absl::MutexLock lock(&gpu_mutex_);
    PS_RETURN_IF_ERROR(Annotate(EnsureGpuStreams(), "copy engine"));
    PS_ASSIGN_OR_RETURN(event, TakeEvent());
    absl::Status enqueued = gpu::MemsetAsync(block.data(), value, block.bytes, to_device_stream_);
    if (enqueued.ok()) enqueued = gpu::RecordEvent(event, to_device_stream_);
    if (!enqueued.ok()) {
      free_events_.push_back(event);
      return Annotate(enqueued, absl::StrCat("filling ", Describe(block)));
    }
  }
  absl::Status status = gpu::SynchronizeEvent(event);
  ReturnEvent(event);
  return status;
}

absl::Status CopyEngine::OrderAfter(gpu::Stream producer) {
  absl::MutexLock lock(&gpu_mutex_);
  PS_RETURN_IF_ERROR(Annotate(EnsureGpuStreams(), "copy engine"));
  PS_ASSIGN_OR_RETURN(gpu::Event event, TakeEvent());
  // Each wait captures the record it follows, so the event can be reused at once: a later
  // record does not touch the waits already enqueued (CUDA's cudaStreamWaitEvent semantics).
  absl::Status status = gpu::RecordEvent(event, producer);
  if (status.ok()) status = gpu::StreamWaitEvent(to_device_stream_, event);
  if (status.ok()) status = gpu::StreamWaitEvent(from_device_stream_, event);
  free_events_.push_back(event);
  return Annotate(status, "ordering the copy streams after a compute stream");
}

void CopyEngine::Finish(const Block& src, const Block& dst,
                        std::shared_ptr<CopyHandle::State> state, absl::Status status) {
  src.tier->Unpin(src);
  dst.tier->EndWrite(dst, status.ok());
  if (!status.ok()) {
    status = Annotate(status, absl::StrCat("copy from ", Describe(src), " to ", Describe(dst)));
  }
  state->status = std::move(status);
  state->done.Notify();
  absl::MutexLock lock(&mutex_);
  --in_flight_;
}

}  // namespace ps
