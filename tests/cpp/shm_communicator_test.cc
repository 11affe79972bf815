// The shared-memory communicator over a real segment, its ranks as threads of this process (and
// as forked processes): every collective for 2, 3 and 4 ranks and every dtype, sizes around the
// slot and reduce-scatter piece boundaries, all issued before any is waited for; null buffers;
// a missing rank (DeadlineExceeded naming the collective, at Wait and from the worker's own
// timeout); a peer process that exited; destruction while a call waits; attaching; the name
// gone once everybody attached.
#include "runtime/shm_communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cast.h"
#include "tests/cpp/test_util.h"

namespace ps {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSlotBytes = 4096;  // small: a few thousand elements take many steps

std::string UniqueName() {
  static std::atomic<int> counter{0};
  return absl::StrCat("/ps-shm-test-", getpid(), "-", counter++);
}

ShmCommunicatorOptions Options(const std::string& name, int rank, int world,
                               absl::Duration timeout = absl::Seconds(30),
                               int64_t slot_bytes = kSlotBytes) {
  ShmCommunicatorOptions options;
  options.name = name;
  options.rank = rank;
  options.world_size = world;
  options.timeout = timeout;
  options.slot_bytes = slot_bytes;
  return options;
}

// Creates every rank's communicator at once (Create waits for all to attach).
std::vector<std::unique_ptr<Communicator>> MakeWorld(int world, int64_t slot_bytes = kSlotBytes,
                                                     absl::Duration timeout = absl::Seconds(30)) {
  const std::string name = UniqueName();
  std::vector<std::unique_ptr<Communicator>> ranks(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto made = CreateShmCommunicator(Options(name, r, world, timeout, slot_bytes));
      EXPECT_TRUE(made.ok()) << made.status();
      if (made.ok()) ranks[r] = std::move(made).value();
    });
  }
  for (std::thread& thread : threads) thread.join();
  return ranks;
}

void OnEveryRank(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(body, r);
  for (std::thread& thread : threads) thread.join();
}

// Small integers: sums of up to 4 of them are exact in every dtype, so only the average rounds
// (once, the same way here and in the communicator).
float Value(int rank, int buffer, int64_t i) {
  return static_cast<float>((rank * 31 + buffer * 17 + i * 7) % 16) - 8.0f;
}

// Elements of one dtype in a byte vector.
struct Typed {
  DType dtype;
  std::vector<unsigned char> bytes;
  Typed(DType d, int64_t count) : dtype(d), bytes(count * ElementSize(d), 0xAB) {}
  void* data() { return bytes.data(); }
  int64_t count() const { return static_cast<int64_t>(bytes.size()) / ElementSize(dtype); }
  void Set(int64_t i, float value) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&bytes[i * 4], &value, 4);
    } else {
      const uint16_t bits = dtype == DType::kFloat16 ? kernels::FloatToHalfBits(value)
                                                     : kernels::FloatToBFloat16Bits(value);
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
  }
  float Get(int64_t i) const {
    if (dtype == DType::kFloat32) {
      float value;
      std::memcpy(&value, &bytes[i * 4], 4);
      return value;
    }
    uint16_t bits;
    std::memcpy(&bits, &bytes[i * 2], 2);
    return dtype == DType::kFloat16 ? kernels::HalfBitsToFloat(bits)
                                    : kernels::BFloat16BitsToFloat(bits);
  }
};

// What the dtype makes of an fp32 value (round once).
float Rounded(float value, DType dtype) {
  Typed one(dtype, 1);
  one.Set(0, value);
  return one.Get(0);
}

float Sum(int world, int buffer, int64_t i, ReduceOp op, DType dtype) {
  float sum = 0;
  for (int r = 0; r < world; ++r) sum += Value(r, buffer, i);
  if (op == ReduceOp::kAvg) sum /= static_cast<float>(world);
  return Rounded(sum, dtype);
}

// One rank's collective: its buffers, and the check of its outputs once it finished.
struct Pending {
  explicit Pending(std::string name) : what(std::move(name)) {}
  std::string what;
  std::vector<std::unique_ptr<Typed>> buffers;
  CollectiveHandle handle;
  std::function<void(Pending&)> check;
};

std::vector<int64_t> Sizes(int world, DType dtype) {
  const int64_t slot = kSlotBytes / ElementSize(dtype);
  const int64_t piece = kSlotBytes / world / 64 * 64 / ElementSize(dtype);  // reduce-scatter
  return {1, 2, piece - 1, piece, piece + 1, slot - 1, slot, slot + 1, 3 * slot, 3 * slot + 5};
}

class ShmCollectivesTest : public ::testing::TestWithParam<std::tuple<int, DType>> {};

// Every collective and size, all issued before the first wait (a long queue on every rank).
TEST_P(ShmCollectivesTest, EveryCollectiveAndSizeMatchesTheDefinition) {
  const auto [world, dtype] = GetParam();
  auto ranks = MakeWorld(world);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(world));
  OnEveryRank(world, [&, world = world, dtype = dtype](int me) {
    Communicator& comm = *ranks[me];
    std::vector<Pending> pending;
    for (int64_t n : Sizes(world, dtype)) {
      auto fill = [&](Typed& t, int rank, int buffer) {
        for (int64_t i = 0; i < n; ++i) t.Set(i, Value(rank, buffer, i));
      };
      {  // allgather
        Pending p(absl::StrCat("allgather n=", n));
        std::vector<void*> pointers;
        for (int r = 0; r < world; ++r) {
          p.buffers.push_back(std::make_unique<Typed>(dtype, n));
          if (r == me) fill(*p.buffers.back(), me, r);
          pointers.push_back(p.buffers.back()->data());
        }
        p.handle = comm.AllGather(pointers, n, dtype, p.what);
        p.check = [n, world](Pending& p) {
          for (int r = 0; r < world; ++r) {
            for (int64_t i = 0; i < n; ++i) {
              ASSERT_EQ(p.buffers[r]->Get(i), Value(r, r, i)) << p.what << " r=" << r << " i=" << i;
            }
          }
        };
        pending.push_back(std::move(p));
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        {  // reduce-scatter
          Pending p(absl::StrCat("reduce_scatter ", ReduceOpName(op), " n=", n));
          std::vector<void*> pointers;
          for (int r = 0; r < world; ++r) {
            p.buffers.push_back(std::make_unique<Typed>(dtype, n));
            fill(*p.buffers.back(), me, r);
            pointers.push_back(p.buffers.back()->data());
          }
          p.handle = comm.ReduceScatter(pointers, n, dtype, op, p.what);
          p.check = [n, world, me, op, dtype](Pending& p) {
            for (int64_t i = 0; i < n; ++i) {
              ASSERT_EQ(p.buffers[me]->Get(i), Sum(world, me, i, op, dtype)) << p.what << " " << i;
            }
          };
          pending.push_back(std::move(p));
        }
        {  // all-reduce
          Pending p(absl::StrCat("all_reduce ", ReduceOpName(op), " n=", n));
          p.buffers.push_back(std::make_unique<Typed>(dtype, n));
          fill(*p.buffers[0], me, 0);
          p.handle = comm.AllReduce(p.buffers[0]->data(), n, dtype, op, p.what);
          p.check = [n, world, op, dtype](Pending& p) {
            for (int64_t i = 0; i < n; ++i) {
              ASSERT_EQ(p.buffers[0]->Get(i), Sum(world, 0, i, op, dtype)) << p.what << " " << i;
            }
          };
          pending.push_back(std::move(p));
        }
        {  // reduce, to a root that changes with the size
          const int root = static_cast<int>(n % world);
          Pending p(absl::StrCat("reduce ", ReduceOpName(op), " root=", root, " n=", n));
          p.buffers.push_back(std::make_unique<Typed>(dtype, n));
          fill(*p.buffers[0], me, 0);
          p.handle = comm.Reduce(p.buffers[0]->data(), n, dtype, op, root, p.what);
          p.check = [n, world, op, dtype, root, me](Pending& p) {
            for (int64_t i = 0; i < n; ++i) {
              const float expected = me == root ? Sum(world, 0, i, op, dtype) : Value(me, 0, i);
              ASSERT_EQ(p.buffers[0]->Get(i), expected) << p.what << " " << i;
            }
          };
          pending.push_back(std::move(p));
        }
      }
      {  // broadcast
        const int root = static_cast<int>((n + 1) % world);
        Pending p(absl::StrCat("broadcast root=", root, " n=", n));
        p.buffers.push_back(std::make_unique<Typed>(dtype, n));
        if (me == root) fill(*p.buffers[0], me, 0);
        p.handle = comm.Broadcast(p.buffers[0]->data(), n, dtype, root, p.what);
        p.check = [n, root](Pending& p) {
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(p.buffers[0]->Get(i), Value(root, 0, i)) << p.what << " " << i;
          }
        };
        pending.push_back(std::move(p));
      }
    }
    for (Pending& p : pending) {
      const absl::Status status = p.handle.Wait(absl::Seconds(60));
      ASSERT_TRUE(status.ok()) << p.what << ": " << status;
      p.check(p);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndDtypes, ShmCollectivesTest,
    ::testing::Combine(::testing::Values(2, 3, 4),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param), "ranks_",
                          DTypeName(std::get<1>(info.param)));
    });

TEST(ShmCommunicatorTest, WorldOfOneCopiesNothingAndFinishes) {
  auto ranks = MakeWorld(1);
  std::vector<float> values = {1, 2, 3};
  void* buffer = values.data();
  PS_ASSERT_OK(ranks[0]->AllGather({&buffer, 1}, 3, DType::kFloat32, "").Wait(absl::Seconds(5)));
  PS_ASSERT_OK(ranks[0]->AllReduce(buffer, 3, DType::kFloat32, ReduceOp::kAvg, "")
                   .Wait(absl::Seconds(5)));
  EXPECT_EQ(values, (std::vector<float>{1, 2, 3}));
}

TEST(ShmCommunicatorTest, NullBuffersContributeZerosAndDiscardOutputs) {
  constexpr int kWorld = 3;
  constexpr int64_t kCount = 3000;  // three steps
  auto ranks = MakeWorld(kWorld);
  OnEveryRank(kWorld, [&](int me) {
    Communicator& comm = *ranks[me];
    // Allgather: rank 1 has no input (padding chunk), rank 2 receives nothing from rank 0.
    std::vector<std::vector<float>> gathered(kWorld, std::vector<float>(kCount, -1.0f));
    std::vector<void*> pointers;
    for (int r = 0; r < kWorld; ++r) pointers.push_back(gathered[r].data());
    for (int64_t i = 0; i < kCount; ++i) gathered[me][i] = Value(me, me, i);
    if (me == 1) pointers[1] = nullptr;
    if (me == 2) pointers[0] = nullptr;
    PS_ASSERT_OK(comm.AllGather(pointers, kCount, DType::kFloat32, "").Wait(absl::Seconds(30)));
    for (int r = 0; r < kWorld; ++r) {
      if (r == me) continue;
      const bool discarded = me == 2 && r == 0;
      for (int64_t i = 0; i < kCount; i += 97) {
        const float expected = discarded ? -1.0f : r == 1 ? 0.0f : Value(r, r, i);
        ASSERT_EQ(gathered[r][i], expected) << "rank " << me << " buffer " << r << " i " << i;
      }
    }
    // Reduce-scatter: rank 0 contributes nothing to rank 1; rank 2 has no output.
    std::vector<std::vector<float>> parts(kWorld, std::vector<float>(kCount));
    pointers.clear();
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kCount; ++i) parts[r][i] = Value(me, r, i);
      pointers.push_back(parts[r].data());
    }
    if (me == 0) pointers[1] = nullptr;
    if (me == 2) pointers[2] = nullptr;
    PS_ASSERT_OK(comm.ReduceScatter(pointers, kCount, DType::kFloat32, ReduceOp::kSum, "")
                     .Wait(absl::Seconds(30)));
    if (me != 2) {
      for (int64_t i = 0; i < kCount; i += 97) {
        float expected = 0;
        for (int r = 0; r < kWorld; ++r) {
          if (!(r == 0 && me == 1)) expected += Value(r, me, i);
        }
        ASSERT_EQ(parts[me][i], expected) << "rank " << me << " i " << i;
      }
    }
    // All-reduce with one rank's buffer missing: zeros in, nothing out.
    std::vector<float> single(kCount);
    for (int64_t i = 0; i < kCount; ++i) single[i] = Value(me, 0, i);
    void* buffer = me == 1 ? nullptr : single.data();
    PS_ASSERT_OK(comm.AllReduce(buffer, kCount, DType::kFloat32, ReduceOp::kSum, "")
                     .Wait(absl::Seconds(30)));
    if (me != 1) {
      for (int64_t i = 0; i < kCount; i += 97) {
        ASSERT_EQ(single[i], Value(0, 0, i) + Value(2, 0, i)) << "rank " << me;
      }
    }
  });
}

TEST(ShmCommunicatorTest, BadArgumentsFailAtOnceAndLeaveTheSequenceIntact) {
  auto ranks = MakeWorld(2);
  OnEveryRank(2, [&](int me) {
    Communicator& comm = *ranks[me];
    std::vector<float> a(8, 1.0f), b(8, 2.0f);
    std::vector<void*> pointers = {a.data(), b.data()};
    const absl::Status empty = comm.AllGather(pointers, 0, DType::kFloat32, "empty")
                                   .Wait(absl::Seconds(5));
    EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
    EXPECT_THAT(empty.message(), HasSubstr("allgather"));
    const absl::Status root =
        comm.Broadcast(a.data(), 8, DType::kFloat32, 2, "").Wait(absl::Seconds(5));
    EXPECT_EQ(root.code(), absl::StatusCode::kInvalidArgument) << root;
    std::vector<void*> three = {a.data(), b.data(), a.data()};
    EXPECT_EQ(comm.AllGather(three, 8, DType::kFloat32, "").Wait(absl::Seconds(5)).code(),
              absl::StatusCode::kInvalidArgument);
    PS_ASSERT_OK(comm.AllReduce(a.data(), 8, DType::kFloat32, ReduceOp::kSum, "")
                     .Wait(absl::Seconds(30)));
    EXPECT_EQ(a[0], 2.0f);
  });
}

TEST(ShmCommunicatorTest, ManySmallCallsInARow) {
  constexpr int kWorld = 2;
  constexpr int kCalls = 2000;
  auto ranks = MakeWorld(kWorld);
  OnEveryRank(kWorld, [&](int me) {
    std::vector<float> values(kCalls);
    std::vector<CollectiveHandle> handles;
    for (int c = 0; c < kCalls; ++c) {
      values[c] = static_cast<float>(c + me);
      handles.push_back(
          ranks[me]->AllReduce(&values[c], 1, DType::kFloat32, ReduceOp::kSum, "small"));
    }
    for (CollectiveHandle& handle : handles) PS_ASSERT_OK(handle.Wait(absl::Seconds(60)));
    for (int c = 0; c < kCalls; ++c) ASSERT_EQ(values[c], static_cast<float>(2 * c + 1));
  });
}

TEST(ShmCommunicatorTest, EveryRankSeesWhatEachIssued) {
  // Note [Issued everywhere]: a call counts once issued, before it runs, on every rank's view.
  auto ranks = MakeWorld(3);
  EXPECT_EQ(ranks[0]->IssuedByRank(), (std::vector<int64_t>{0, 0, 0}));
  float a = 1, b = 2, c = 3;
  CollectiveHandle first = ranks[0]->AllReduce(&a, 1, DType::kFloat32, ReduceOp::kSum, "one");
  CollectiveHandle second = ranks[0]->AllReduce(&a, 1, DType::kFloat32, ReduceOp::kSum, "two");
  CollectiveHandle peer = ranks[2]->AllReduce(&c, 1, DType::kFloat32, ReduceOp::kSum, "one");
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks[r]->IssuedByRank(), (std::vector<int64_t>{2, 0, 1})) << "rank " << r;
  }
  EXPECT_FALSE(first.done());  // rank 1 has issued nothing yet
  // A call that fails its checks is not issued: the peers must not count on it.
  EXPECT_FALSE(ranks[1]->AllReduce(&b, -1, DType::kFloat32, ReduceOp::kSum, "bad").Wait(
      absl::Seconds(5)).ok());
  EXPECT_EQ(ranks[0]->IssuedByRank()[1], 0);
  CollectiveHandle late = ranks[1]->AllReduce(&b, 1, DType::kFloat32, ReduceOp::kSum, "one");
  PS_EXPECT_OK(first.Wait(absl::Seconds(30)));
  PS_EXPECT_OK(peer.Wait(absl::Seconds(30)));
  PS_EXPECT_OK(late.Wait(absl::Seconds(30)));
  EXPECT_EQ(ranks[1]->IssuedByRank(), (std::vector<int64_t>{2, 1, 1}));
  CollectiveHandle ends = ranks[1]->AllReduce(&b, 1, DType::kFloat32, ReduceOp::kSum, "two");
  CollectiveHandle also = ranks[2]->AllReduce(&c, 1, DType::kFloat32, ReduceOp::kSum, "two");
  PS_EXPECT_OK(second.Wait(absl::Seconds(30)));
  PS_EXPECT_OK(ends.Wait(absl::Seconds(30)));
  PS_EXPECT_OK(also.Wait(absl::Seconds(30)));
}

TEST(ShmCommunicatorTest, MissingRankIsDeadlineExceededNamingTheCollective) {
  auto ranks = MakeWorld(2);
  std::vector<float> a(100), b(100);
  std::vector<void*> pointers = {a.data(), b.data()};
  CollectiveHandle handle = ranks[0]->AllGather(pointers, 100, DType::kFloat32, "layer 3");
  const absl::Time start = absl::Now();
  const absl::Status status = handle.Wait(absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr("allgather of 2 x 100 float32 (layer 3) on shm"));

  // Destroying rank 0 while its call waits for rank 1 returns promptly and cancels the call.
  const absl::Time destroy = absl::Now();
  ranks[0].reset();
  EXPECT_LT(absl::Now() - destroy, absl::Seconds(2));
  const absl::Status cancelled = handle.Wait(absl::Seconds(1));
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled) << cancelled;
  // Rank 1, arriving late, still finds the piece rank 0 published for that call; at the next
  // one it is told rank 0 left instead of waiting for its timeout.
  PS_EXPECT_OK(
      ranks[1]->AllGather(pointers, 100, DType::kFloat32, "layer 3").Wait(absl::Seconds(5)));
  const absl::Status late =
      ranks[1]->AllGather(pointers, 100, DType::kFloat32, "layer 4").Wait(absl::Seconds(5));
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_THAT(late.message(), HasSubstr("rank 0 closed its communicator"));
  EXPECT_THAT(late.message(), HasSubstr("allgather"));
}

// Note [Same call at every step]: ranks whose calls differ fail at once, naming both calls,
// instead of reading each other's pieces (an allgather's data summed as another rank's flags).
TEST(ShmCommunicatorTest, DifferentCallsAtOneStepFailAtOnceNamingBoth) {
  auto ranks = MakeWorld(2);
  std::vector<float> a(100, 1.0f), b(100, 2.0f), flags(2, 0.0f);
  std::vector<void*> pointers = {a.data(), b.data()};
  absl::Status gather, reduce;
  const absl::Time start = absl::Now();
  OnEveryRank(2, [&](int r) {
    if (r == 0) {
      gather = ranks[0]->AllGather(pointers, 100, DType::kFloat32, "forward gather of group 3")
                   .Wait(absl::Seconds(20));
    } else {
      reduce = ranks[1]
                   ->AllReduce(flags.data(), 2, DType::kFloat32, ReduceOp::kSum,
                               "non-finite loss flags")
                   .Wait(absl::Seconds(20));
    }
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the 30 s timeout
  EXPECT_EQ(gather.code(), absl::StatusCode::kFailedPrecondition) << gather;
  EXPECT_THAT(gather.message(),
              HasSubstr("rank 1 issued all_reduce of 2 float32 (non-finite loss flags)"));
  EXPECT_THAT(gather.message(), HasSubstr("allgather of 2 x 100 float32 (forward gather"));
  EXPECT_THAT(gather.message(), HasSubstr("sequences of collectives differ"));
  EXPECT_EQ(reduce.code(), absl::StatusCode::kFailedPrecondition) << reduce;
  EXPECT_THAT(reduce.message(), HasSubstr("rank 0 issued allgather of 2 x 100 float32"));
  EXPECT_EQ(flags[0], 0.0f);  // nothing read from the other call's piece
  // The sequences no longer agree: later calls fail at once.
  EXPECT_FALSE(ranks[0]->AllReduce(a.data(), 1, DType::kFloat32, ReduceOp::kSum, "")
                   .Wait(absl::Seconds(5))
                   .ok());
}

TEST(ShmCommunicatorTest, WorkerTimesOutAndLaterCallsFailAtOnce) {
  auto ranks = MakeWorld(2, kSlotBytes, absl::Milliseconds(300));
  std::vector<float> a(10), b(10);
  std::vector<void*> pointers = {a.data(), b.data()};
  const absl::Status status =
      ranks[0]
          ->ReduceScatter(pointers, 10, DType::kFloat32, ReduceOp::kAvg, "grads")
          .Wait(absl::Seconds(20));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr("reduce_scatter of 2 x 10 float32 (grads) on shm"));
  EXPECT_THAT(status.message(), HasSubstr("rank 1 did not"));
  const absl::Status next =
      ranks[0]->AllReduce(a.data(), 10, DType::kFloat32, ReduceOp::kSum, "").Wait(absl::Seconds(5));
  EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
  // Rank 1 finds the piece rank 0 published before it gave up, then learns that rank 0 failed
  // without waiting for its own timeout.
  PS_EXPECT_OK(ranks[1]
                   ->ReduceScatter(pointers, 10, DType::kFloat32, ReduceOp::kAvg, "")
                   .Wait(absl::Seconds(5)));
  const absl::Status peer = ranks[1]
                                ->ReduceScatter(pointers, 10, DType::kFloat32, ReduceOp::kAvg, "")
                                .Wait(absl::Seconds(5));
  EXPECT_EQ(peer.code(), absl::StatusCode::kAborted) << peer;
  EXPECT_THAT(peer.message(), HasSubstr("rank 0 failed a collective"));
}

TEST(ShmCommunicatorTest, DestroyingWithQueuedCallsCancelsThem) {
  auto ranks = MakeWorld(2);
  std::vector<float> value(1);
  std::vector<CollectiveHandle> handles;
  for (int i = 0; i < 10; ++i) {
    handles.push_back(ranks[0]->AllReduce(value.data(), 1, DType::kFloat32, ReduceOp::kSum, ""));
  }
  const absl::Time start = absl::Now();
  ranks[0].reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  for (CollectiveHandle& handle : handles) {
    EXPECT_EQ(handle.Wait(absl::Seconds(1)).code(), absl::StatusCode::kCancelled);
  }
}

TEST(ShmCommunicatorTest, NameIsUnlinkedOnceEveryRankAttached) {
  const std::string name = UniqueName();
  std::vector<std::unique_ptr<Communicator>> ranks(2);
  OnEveryRank(2, [&](int r) {
    auto made = CreateShmCommunicator(Options(name, r, 2));
    PS_ASSERT_OK(made.status());
    ranks[r] = std::move(made).value();
  });
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

TEST(ShmCommunicatorTest, RankThatNeverAttachesIsDeadlineExceeded) {
  const std::string name = UniqueName();
  auto alone = CreateShmCommunicator(Options(name, 0, 2, absl::Milliseconds(200)));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  EXPECT_THAT(alone.status().message(), HasSubstr("1 of 2 ranks attached"));
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);  // rank 0 removed it
  auto orphan = CreateShmCommunicator(Options(UniqueName(), 1, 2, absl::Milliseconds(200)));
  EXPECT_EQ(orphan.status().code(), absl::StatusCode::kDeadlineExceeded) << orphan.status();
}

TEST(ShmCommunicatorTest, OptionsAreChecked) {
  EXPECT_EQ(CreateShmCommunicator(Options("no-slash", 0, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmCommunicator(Options(UniqueName(), 2, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateShmCommunicator(Options(UniqueName(), 0, 4, absl::Seconds(1), 100))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// The ranks as processes: rank 0 here, the others forked before anything is created (no other
// thread exists yet), each checking its own results and reporting through its exit code.
TEST(ShmCommunicatorTest, RanksAsProcesses) {
  constexpr int kWorld = 3;
  constexpr int64_t kCount = (1 << 20) + 3;  // 4 MiB of fp32, 64 steps of 64 KiB slots
  const std::string name = UniqueName();
  auto run_rank = [&](int me) -> int {
    auto made = CreateShmCommunicator(Options(name, me, kWorld, absl::Seconds(60), 64 << 10));
    if (!made.ok()) return 10;
    Communicator& comm = **made;
    std::vector<std::vector<float>> buffers(kWorld, std::vector<float>(kCount));
    std::vector<void*> pointers;
    for (int r = 0; r < kWorld; ++r) pointers.push_back(buffers[r].data());
    for (int64_t i = 0; i < kCount; ++i) buffers[me][i] = Value(me, me, i);
    if (!comm.AllGather(pointers, kCount, DType::kFloat32, "").Wait(absl::Seconds(60)).ok()) {
      return 11;
    }
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kCount; ++i) {
        if (buffers[r][i] != Value(r, r, i)) return 12;
      }
    }
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kCount; ++i) buffers[r][i] = Value(me, r, i);
    }
    if (!comm.ReduceScatter(pointers, kCount, DType::kFloat32, ReduceOp::kSum, "")
             .Wait(absl::Seconds(60))
             .ok()) {
      return 13;
    }
    for (int64_t i = 0; i < kCount; ++i) {
      if (buffers[me][i] != Sum(kWorld, me, i, ReduceOp::kSum, DType::kFloat32)) return 14;
    }
    return 0;
  };
  std::vector<pid_t> children;
  for (int r = 1; r < kWorld; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(run_rank(r));
    children.push_back(pid);
  }
  EXPECT_EQ(run_rank(0), 0);
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "a forked rank failed";
  }
}

// Note [Dead peers]: a rank whose process exits without closing (killed, os._exit) makes the
// others fail with Aborted naming it well before their timeout, as gloo's closed socket does.
TEST(ShmCommunicatorTest, PeerProcessThatExitedIsAbortedBeforeTheTimeout) {
  const std::string name = UniqueName();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto made = CreateShmCommunicator(Options(name, 1, 2, absl::Seconds(60)));
    _exit(made.ok() ? 0 : 1);  // leaves without closing, a zombie until waitpid below
  }
  auto made = CreateShmCommunicator(Options(name, 0, 2, absl::Seconds(60)));
  PS_ASSERT_OK(made.status());
  std::vector<float> a(10), b(10);
  std::vector<void*> pointers = {a.data(), b.data()};
  const absl::Time start = absl::Now();
  const absl::Status status =
      (*made)->AllGather(pointers, 10, DType::kFloat32, "layer 0").Wait(absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_THAT(status.message(), HasSubstr("rank 1 (process "));
  EXPECT_THAT(status.message(), HasSubstr("exited"));
  EXPECT_THAT(status.message(), HasSubstr("allgather of 2 x 10 float32 (layer 0) on shm"));
  int exit_status = 0;
  ASSERT_EQ(waitpid(child, &exit_status, 0), child);
  EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0);
}

}  // namespace
}  // namespace ps
