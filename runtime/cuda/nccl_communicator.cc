// The direct NCCL back end of ps::Communicator (runtime/communicator.h).
//
// Note [NCCL group calls]
// A chunk group is world_size separate device buffers, so one group call is world_size
// point-to-root collectives batched between ncclGroupStart/End, which NCCL fuses into one
// launch: the allgather is a broadcast from each rank r of buffer r, the reduce-scatter a reduce
// to each rank r of buffer r (ncclAvg for averages). Everything is enqueued in issue order on
// the communicator's own non-blocking stream, followed by an event; a worker thread waits for
// the events in order (polling, so it can give up) and finishes the handles. A collective not
// done within the timeout aborts the communicator (ncclCommAbort), which is the only way to free
// a stream stuck on a dead peer; later calls then fail at once. The caller makes the buffers'
// contents ready before issuing (it synchronizes the stream that wrote them).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/communicator.h"
#include "runtime/gpu.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/thread_pool.h"

namespace ps {
namespace {

absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(result)));
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kUInt8:
      return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) { return op == ReduceOp::kAvg ? ncclAvg : ncclSum; }

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, int device, ncclComm_t comm, cudaStream_t stream)
      : rank_(rank), world_size_(world_size), device_(device), comm_(comm), stream_(stream) {}
  ~NcclCommunicator() override {
    waiter_.WaitIdle();
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    if (!aborted_) ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "nccl"; }
  AddressSpace address_space() const override { return AddressSpace::kDeviceMemory; }

  CollectiveHandle AllGather(absl::Span<void* const> buffers, int64_t count, DType dtype,
                             std::string label) override {
    std::vector<void*> b(buffers.begin(), buffers.end());
    return Issue(CollectiveType::kAllGather, b, count, dtype, 0, std::move(label),
                 [&](void* scratch, void* zeros) -> absl::Status {
                   PS_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
                   for (int r = 0; r < world_size_; ++r) {
                     void* out = b[r] != nullptr ? b[r] : (r == rank_ ? zeros : scratch);
                     const void* in = r == rank_ ? out : nullptr;
                     PS_RETURN_IF_ERROR(NcclStatus(
                         ncclBroadcast(in, out, count, NcclType(dtype), r, comm_, stream_),
                         "ncclBroadcast"));
                   }
                   return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
                 });
  }

  CollectiveHandle ReduceScatter(absl::Span<void* const> buffers, int64_t count, DType dtype,
                                 ReduceOp op, std::string label) override {
    std::vector<void*> b(buffers.begin(), buffers.end());
    return Issue(CollectiveType::kReduceScatter, b, count, dtype, 0, std::move(label),
                 [&](void* scratch, void* zeros) -> absl::Status {
                   PS_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart"));
                   for (int r = 0; r < world_size_; ++r) {
                     const void* in = b[r] != nullptr ? b[r] : zeros;
                     void* out = r == rank_ ? (b[r] != nullptr ? b[r] : scratch) : nullptr;
                     PS_RETURN_IF_ERROR(NcclStatus(
                         ncclReduce(in, out, count, NcclType(dtype), NcclOp(op), r, comm_, stream_),
                         "ncclReduce"));
                   }
                   return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
                 });
  }

  CollectiveHandle AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                             std::string label) override {
    return Issue(CollectiveType::kAllReduce, {buffer}, count, dtype, 0, std::move(label),
                 [&](void* scratch, void* zeros) {
                   void* data = buffer != nullptr ? buffer : zeros;
                   return NcclStatus(ncclAllReduce(data, data, count, NcclType(dtype), NcclOp(op),
                                                   comm_, stream_),
                                     "ncclAllReduce");
                 });
  }

  CollectiveHandle Broadcast(void* buffer, int64_t count, DType dtype, int root,
                             std::string label) override {
    return Issue(CollectiveType::kBroadcast, {buffer}, count, dtype, root, std::move(label),
                 [&](void* scratch, void* zeros) {
                   void* data = buffer != nullptr ? buffer : (root == rank_ ? zeros : scratch);
                   return NcclStatus(
                       ncclBroadcast(data, data, count, NcclType(dtype), root, comm_, stream_),
                       "ncclBroadcast");
                 });
  }

  CollectiveHandle Reduce(void* buffer, int64_t count, DType dtype, ReduceOp op, int root,
                          std::string label) override {
    return Issue(CollectiveType::kReduce, {buffer}, count, dtype, root, std::move(label),
                 [&](void* scratch, void* zeros) {
                   void* data = buffer != nullptr ? buffer : zeros;
                   return NcclStatus(ncclReduce(data, data, count, NcclType(dtype), NcclOp(op),
                                                root, comm_, stream_),
                                     "ncclReduce");
                 });
  }

 private:
  // Enqueues `enqueue(scratch, zeros)` on the stream (with a scratch and a zeroed buffer of
  // `count` elements when some buffer is null), records an event and lets the waiter finish
  // the handle when it completes.
  template <typename F>
  CollectiveHandle Issue(CollectiveType type, std::vector<void*> buffers, int64_t count,
                         DType dtype, int root, std::string label, F&& enqueue) {
    CollectiveDescription description{
        type, static_cast<int64_t>(buffers.size()), count, dtype, std::move(label), backend()};
    std::vector<void*> checked = buffers;
    const bool group = type == CollectiveType::kAllGather || type == CollectiveType::kReduceScatter;
    if (!group && checked[0] == nullptr) checked[0] = this;
    absl::Status status = ValidateCollective(*this, type, checked, count, root);
    if (status.ok() && aborted_) {
      status = absl::FailedPreconditionError("the NCCL communicator was aborted after a timeout");
    }
    if (!status.ok()) return CollectiveHandle::Failed(std::move(description), status);
    status = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
    const bool any_null = std::find(buffers.begin(), buffers.end(), nullptr) != buffers.end();
    const size_t bytes = static_cast<size_t>(count * ElementSize(dtype));
    void* scratch = nullptr;
    void* zeros = nullptr;
    if (status.ok() && any_null) {
      status = CudaStatus(cudaMallocAsync(&scratch, 2 * bytes, stream_), "cudaMallocAsync");
      zeros = static_cast<char*>(scratch) + bytes;
      if (status.ok()) status = CudaStatus(cudaMemsetAsync(zeros, 0, bytes, stream_), "memset");
    }
    if (status.ok()) status = enqueue(scratch, zeros);
    if (scratch != nullptr) cudaFreeAsync(scratch, stream_);
    cudaEvent_t event = nullptr;
    if (status.ok()) {
      status = CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event");
    }
    if (status.ok()) status = CudaStatus(cudaEventRecord(event, stream_), "cudaEventRecord");
    if (!status.ok()) {
      if (event != nullptr) cudaEventDestroy(event);
      return CollectiveHandle::Failed(std::move(description), status);
    }
    auto state = std::make_shared<CollectiveState>(std::move(description));
    waiter_.Schedule([this, state, event] { state->Finish(AwaitEvent(event)); });
    return CollectiveHandle(state);
  }

  absl::Status AwaitEvent(cudaEvent_t event) {
    cudaSetDevice(device_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    absl::Status status;
    while (true) {
      const cudaError_t query = cudaEventQuery(event);
      if (query == cudaSuccess) break;
      if (query != cudaErrorNotReady) {
        status = CudaStatus(query, "waiting for the collective");
        break;
      }
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (async_error != ncclSuccess) {
        status = NcclStatus(async_error, "NCCL asynchronous error");
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        aborted_ = true;
        ncclCommAbort(comm_);
        status = absl::DeadlineExceededError("not done in time; the NCCL communicator was aborted");
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    cudaEventDestroy(event);
    return status;
  }

  const int rank_;
  const int world_size_;
  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  std::atomic<bool> aborted_{false};
  // Waits inside the handle have their own timeout; this one bounds the stream itself.
  const std::chrono::seconds timeout_{600};
  ThreadPool waiter_{1, "ps-nccl"};
};

}  // namespace

bool NcclAvailable() { return true; }

absl::StatusOr<std::string> NcclUniqueId() {
  ncclUniqueId id;
  PS_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int world_size,
                                                                     int device,
                                                                     const std::string& unique_id) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL communicator: rank ", rank, " of a world of ", world_size));
  }
  if (gpu::StrictDevice()) {  // Note [Strict device]: NCCL's transport is not emulated
    return absl::FailedPreconditionError(
        "NCCL communicator: the strict emulated device has no NCCL; use the torch.distributed "
        "communicator on the host tier");
  }
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL communicator: the unique id has ",
                                                   unique_id.size(), " bytes, NCCL's has ",
                                                   sizeof(id.internal)));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("NCCL communicator: no CUDA device");
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  PS_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  ncclComm_t comm;
  PS_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(&comm, world_size, id, rank), "ncclCommInitRank"));
  cudaStream_t stream;
  absl::Status created =
      CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  if (!created.ok()) {
    ncclCommDestroy(comm);
    return created;
  }
  PS_LOG(kInfo, "NCCL communicator: rank %d of %d on device %d", rank, world_size, device);
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(rank, world_size, device, comm, stream));
}

}  // namespace ps
