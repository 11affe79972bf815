// An in-process world for tests: one FakeCommunicator per rank, each running its collectives on
// its own worker thread in issue order (as the real back ends do), meeting the other ranks'
// calls of the same sequence number. float32 reductions only.
#pragma once

#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/communicator.h"
#include "runtime/thread_pool.h"

namespace ps::testing {

class FakeWorld {
 public:
  explicit FakeWorld(int world_size) : world_size_(world_size) {}
  int world_size() const { return world_size_; }

  struct Call {
    CollectiveType type;
    std::vector<void*> buffers;
    int64_t count = 0;
    ReduceOp op = ReduceOp::kSum;
    int root = 0;
  };

  // Posts rank `rank`'s call number `seq` (phase 0), waits until every rank arrived at
  // (seq, phase) or the world is aborted, and returns all ranks' calls.
  bool Meet(int64_t seq, int rank, const Call& call, std::vector<Call>* all, int phase) {
    std::unique_lock<std::mutex> lock(mutex_);
    Slot& slot = slots_[{seq, phase}];
    if (phase == 0) {
      slot.calls.resize(world_size_);
      slot.calls[rank] = call;
    }
    slot.arrived += 1;
    changed_.notify_all();
    changed_.wait(lock, [&] { return slot.arrived == world_size_ || aborted_; });
    if (aborted_) return false;
    if (all != nullptr) *all = slot.calls;
    return true;
  }

  // Calls each rank issued, when the world counts them (Note [Issued everywhere]); else empty.
  void CountIssued() {
    std::lock_guard<std::mutex> lock(mutex_);
    issued_.assign(world_size_, 0);
  }
  void Issued(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!issued_.empty()) issued_[rank] += 1;
  }
  std::vector<int64_t> IssuedByRank() {
    std::lock_guard<std::mutex> lock(mutex_);
    return issued_;
  }

  void Abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    changed_.notify_all();
  }

 private:
  struct Slot {
    std::vector<Call> calls;
    int arrived = 0;
  };
  const int world_size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::pair<int64_t, int>, Slot> slots_;
  bool aborted_ = false;
  std::vector<int64_t> issued_;
};

class FakeCommunicator : public Communicator {
 public:
  FakeCommunicator(std::shared_ptr<FakeWorld> world, int rank)
      : world_(std::move(world)), rank_(rank), worker_(1, absl::StrCat("fake-comm-", rank)) {}
  ~FakeCommunicator() override { Shutdown(); }

  // Aborts the world (a peer that never comes must not keep the worker waiting) and waits
  // until this rank's worker has finished what it was doing: after it, no copy of a collective
  // still touches any rank's buffers, so those may be freed.
  void Shutdown() {
    world_->Abort();
    worker_.WaitIdle();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_->world_size(); }
  std::string backend() const override { return "fake"; }
  AddressSpace address_space() const override { return AddressSpace::kHostMemory; }
  int64_t issued() const { return seq_; }
  std::vector<int64_t> IssuedByRank() const override { return world_->IssuedByRank(); }

  CollectiveHandle AllGather(absl::Span<void* const> buffers, int64_t count, DType dtype,
                             std::string label) override {
    return Issue(CollectiveType::kAllGather, buffers, count, dtype, ReduceOp::kSum, 0, label);
  }
  CollectiveHandle ReduceScatter(absl::Span<void* const> buffers, int64_t count, DType dtype,
                                 ReduceOp op, std::string label) override {
    return Issue(CollectiveType::kReduceScatter, buffers, count, dtype, op, 0, label);
  }
  CollectiveHandle AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                             std::string label) override {
    return Issue(CollectiveType::kAllReduce, {buffer}, count, dtype, op, 0, label);
  }
  CollectiveHandle Broadcast(void* buffer, int64_t count, DType dtype, int root,
                             std::string label) override {
    return Issue(CollectiveType::kBroadcast, {buffer}, count, dtype, ReduceOp::kSum, root, label);
  }
  CollectiveHandle Reduce(void* buffer, int64_t count, DType dtype, ReduceOp op, int root,
                          std::string label) override {
    return Issue(CollectiveType::kReduce, {buffer}, count, dtype, op, root, label);
  }

 private:
  CollectiveHandle Issue(CollectiveType type, absl::Span<void* const> buffers, int64_t count,
                         DType dtype, ReduceOp op, int root, std::string label) {
    CollectiveDescription description{
        type, static_cast<int64_t>(buffers.size()), count, dtype, std::move(label), backend()};
    const bool group = type == CollectiveType::kAllGather || type == CollectiveType::kReduceScatter;
    absl::Status valid =
        group ? ValidateCollective(*this, type, buffers, count, root) : absl::OkStatus();
    // Gathers and broadcasts only copy: 16-bit elements move as half as many float32 words.
    const bool copies = type == CollectiveType::kAllGather || type == CollectiveType::kBroadcast;
    if (valid.ok() && copies && ElementSize(dtype) == 2 && count % 2 == 0) {
      count /= 2;
      dtype = DType::kFloat32;
    }
    if (valid.ok() && dtype != DType::kFloat32) {
      valid = absl::UnimplementedError("the fake communicator reduces float32 only");
    }
    if (!valid.ok()) return CollectiveHandle::Failed(std::move(description), valid);
    auto state = std::make_shared<CollectiveState>(std::move(description));
    FakeWorld::Call call{type, std::vector<void*>(buffers.begin(), buffers.end()), count, op, root};
    const int64_t seq = seq_++;
    worker_.Schedule([this, state, call, seq] { state->Finish(Run(seq, call)); });
    world_->Issued(rank_);
    return CollectiveHandle(state);
  }

  absl::Status Run(int64_t seq, const FakeWorld::Call& call) {
    std::vector<FakeWorld::Call> all;
    if (!world_->Meet(seq, rank_, call, &all, 0)) return absl::AbortedError("world aborted");
    const int world = world_size();
    const int64_t n = call.count;
    auto read = [&](int from, int index, std::vector<float>* out) {
      const void* source = all[from].buffers[index];
      if (source == nullptr) return;
      const float* values = static_cast<const float*>(source);
      for (int64_t i = 0; i < n; ++i) (*out)[i] += values[i];
    };
    // Phase 1: read what this rank needs from the others into temporaries.
    std::vector<std::vector<float>> results;
    switch (call.type) {
      case CollectiveType::kAllGather:
        for (int r = 0; r < world; ++r) {
          results.emplace_back(n, 0.0f);
          if (r != rank_) read(r, r, &results.back());
        }
        break;
      case CollectiveType::kReduceScatter:
        results.emplace_back(n, 0.0f);
        for (int r = 0; r < world; ++r) read(r, rank_, &results.back());
        break;
      case CollectiveType::kAllReduce:
      case CollectiveType::kReduce:
        results.emplace_back(n, 0.0f);
        for (int r = 0; r < world; ++r) read(r, 0, &results.back());
        break;
      case CollectiveType::kBroadcast:
        results.emplace_back(n, 0.0f);
        read(call.root, 0, &results.back());
        break;
    }
    if (call.op == ReduceOp::kAvg) {
      for (float& v : results.back()) v /= static_cast<float>(world);
    }
    // Phase 2: once everybody has read, write this rank's own buffers.
    if (!world_->Meet(seq, rank_, call, nullptr, 1)) return absl::AbortedError("world aborted");
    auto write = [&](void* destination, const std::vector<float>& values) {
      if (destination != nullptr) std::memcpy(destination, values.data(), n * sizeof(float));
    };
    switch (call.type) {
      case CollectiveType::kAllGather:
        for (int r = 0; r < world; ++r) {
          if (r != rank_) write(call.buffers[r], results[r]);
        }
        break;
      case CollectiveType::kReduceScatter:
        write(call.buffers[rank_], results[0]);
        break;
      case CollectiveType::kAllReduce:
        write(call.buffers[0], results[0]);
        break;
      case CollectiveType::kReduce:
      case CollectiveType::kBroadcast:
        if (call.type == CollectiveType::kBroadcast ? rank_ != call.root : rank_ == call.root) {
          write(call.buffers[0], results[0]);
        }
        break;
    }
    return absl::OkStatus();
  }

  std::shared_ptr<FakeWorld> world_;
  const int rank_;
  int64_t seq_ = 0;
  ThreadPool worker_;
};

}  // namespace ps::testing
