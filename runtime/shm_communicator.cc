#include "runtime/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cast.h"
#include "runtime/logging.h"
#include "runtime/status.h"
#include "runtime/thread_pool.h"

namespace ps {
namespace {

// Note [Shared-memory steps]
// The segment holds a header, one control block per rank and two slots of `slot_bytes` per
// rank. Every collective is cut into steps (the same cut on every rank: it depends only on the
// call, the world size and slot_bytes, which all ranks agree on), and steps are numbered from 1
// across calls; step s uses slot s % 2 of every rank. For its step s, rank r:
//   1. waits until every peer's `consumed` >= s - 2: nobody still reads r's slot s % 2, last
//      used for step s - 2;
//   2. writes its piece into its slot s % 2 (below);
//   3. stores `published` = s (release);
//   4. waits until `published` >= s for every rank it reads from (acquire): their pieces are
//      complete;
//   5. reads those slots and writes its own output buffers (never anything in the segment);
//   6. stores `consumed` = s (release).
// A slot is written by its owner only and read by the others only between steps 3 and 6 of the
// same step, so the `consumed` wait in 1 is the whole reuse rule. A peer can never be two steps
// ahead: it publishes s + 1 only after this rank consumed s - 1, and s + 2 only after it
// consumed s; with two slots a rank fills its next slot while the peers still read the last one
// (a pipeline of depth 2, no barrier between steps). `published` > s while reading step s is
// possible and fine (the peer's next piece is in its other slot).
//
// What a step's piece is (elements [o, o + n) of every buffer; null inputs are written as
// zeros, null outputs are not read into):
//   allgather        this rank's buffer; it copies every peer's slot into that peer's buffer.
//   reduce-scatter   world_size sub-pieces of slot_bytes / world_size (64-byte aligned), sub-
//                    piece d holding the contribution to rank d (its own one stays unused);
//                    rank d sums sub-piece d of every slot and its own buffer d.
//   all-reduce       this rank's buffer; every rank sums all ranks' pieces in rank order, so
//                    all get the same bits. reduce: the same on the root, whose own piece is
//                    read from its buffer (it writes nothing). broadcast: the root's buffer.
// Sums run in fp32 (fp16/bf16 widened by kernels/cast.h and rounded once), average = sum /
// world_size.
//
// Waiting: a rank bumps its futex word `signal` after each store of `published` or `consumed`
// and wakes it when someone sleeps there (`waiters`). A waiter reads `signal`, tests its
// condition, spins a little, then sleeps on the word it read (futex across processes: the
// segment is MAP_SHARED, so no FUTEX_PRIVATE_FLAG) for at most kSleep, which bounds how late it
// notices the communicator's destruction or its deadline. A store between the read and the
// sleep changes the word and the futex returns at once, so no wake-up is lost.
//
// Failure: a collective whose peer does not come within the timeout, or whose communicator is
// destroyed, fails; the rank then sets its `state` to kFailed (kClosed on destruction) and
// every later call on it fails at once, since the ranks' step numbers no longer agree. A peer
// waiting for a rank that left fails too, with Aborted naming that rank, instead of waiting
// for its own timeout (and one whose process died: Note [Dead peers]). A rank that left
// normally has already satisfied every condition its peers wait on (the same sequence of
// calls), and the conditions are tested before the state.

// Note [Dead peers]
// A rank killed without closing (SIGKILL, a crash, os._exit) never stores kClosed, and gloo
// would have seen its socket close at once. So a rank that has been asleep waiting for a peer
// looks at the peer's process every kLivenessInterval: no /proc/<pid> entry, a zombie, or a
// different start time (the pid was reused) means the peer is gone, and the wait fails with
// Aborted naming it. Ranks in one process (threads, the tests) and ranks in another pid
// namespace (whose pids mean nothing here) are not checked; the timeout still covers them.

constexpr uint64_t kMagic = 0x70732d73686d3032;  // "ps-shm02"
constexpr int kMaxWorldSize = 1024;
constexpr int kSpins = 256;
constexpr absl::Duration kSleep = absl::Milliseconds(5);
constexpr int64_t kBlock = 1024;  // elements reduced at a time, in fp32 on the stack
constexpr absl::Duration kLivenessInterval = absl::Milliseconds(100);

enum RankState : uint32_t { kAlive = 0, kClosed = 1, kFailed = 2 };
constexpr int kEveryPeer = -1;
constexpr int kNobody = -2;

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are 32 bits");

struct alignas(64) SegmentHeader {
  std::atomic<uint64_t> magic;  // stored last by rank 0: the rest is initialized
  int64_t world_size;
  int64_t slot_bytes;
  std::atomic<int64_t> attached;  // ranks that mapped the segment
};

// Note [Same call at every step]
// Steps pair the ranks' calls by position alone, so ranks whose sequences of calls differ (one
// rank ran a forward the others did not: evaluation or saving under `if rank == 0`) would read
// each other's pieces as if they belonged to their own calls: an allgather's parameters summed as
// another rank's loss flags, flags copied in as parameters, silently, until the step counts
// drift apart and a wait times out minutes later. So each rank writes what its step belongs to
// (the call's type, sizes and root, the step's offset in it, and the call's label for the
// message) beside its piece before publishing it, and a rank compares the signature of every
// slot it reads with its own before reading: a difference fails the call at once on the reading
// ranks, naming both calls. Labels are not compared (ranks may word them differently).
struct CallSignature {
  uint32_t type;
  uint32_t dtype;
  int32_t root;
  int32_t buffers;
  int64_t count;
  int64_t offset;
  char label[64];  // the call's label, cut to fit, NUL-terminated: for the message only
  bool SameCall(const CallSignature& other) const {
    return type == other.type && dtype == other.dtype && root == other.root &&
           buffers == other.buffers && count == other.count && offset == other.offset;
  }
};

struct alignas(64) RankControl {
  std::atomic<uint64_t> published;  // the last step whose piece is in this rank's slot
  std::atomic<uint64_t> consumed;   // the last step this rank finished reading
  std::atomic<uint32_t> signal;     // futex word, bumped after every store above or to state
  std::atomic<uint32_t> waiters;    // peers asleep on `signal`
  std::atomic<uint32_t> state;      // RankState
  // Calls issued, counted once scheduled (Note [Issued everywhere] in communicator.h).
  std::atomic<int64_t> issued;
  // The rank's process, written before it counts itself attached (Note [Dead peers]).
  int64_t pid;
  uint64_t start_time;     // field 22 of /proc/<pid>/stat: tells a reused pid apart
  uint64_t pid_namespace;  // inode of /proc/self/ns/pid: pids compare within one namespace
  // What the piece in slot k belongs to (Note [Same call at every step]).
  CallSignature signature[2];
};

int64_t SegmentBytes(int world_size, int64_t slot_bytes) {
  return static_cast<int64_t>(sizeof(SegmentHeader)) +
         static_cast<int64_t>(sizeof(RankControl)) * world_size + 2 * slot_bytes * world_size;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const timespec relative = absl::ToTimespec(timeout);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &relative, nullptr,
          0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

// The state letter and start time of process `pid` from /proc/<pid>/stat; false if it has none.
bool ReadProcessStat(int64_t pid, char* state, uint64_t* start_time) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[1024];
  const ssize_t length = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (length <= 0) return false;
  text[length] = '\0';
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so start after the last
  // ')'. The state is field 3, the start time field 22.
  const char* fields = std::strrchr(text, ')');
  if (fields == nullptr) return false;
  fields += 1;
  int field = 2;
  for (const char* c = fields; *c != '\0'; ++c) {
    if (*c != ' ') continue;
    ++field;
    if (field == 3) *state = c[1];
    if (field == 22) {
      *start_time = std::strtoull(c + 1, nullptr, 10);
      return true;
    }
  }
  return false;
}

uint64_t PidNamespace() {
  struct stat info;
  return stat("/proc/self/ns/pid", &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The mapping and, until every rank attached, the open name.
struct Segment {
  void* base = MAP_FAILED;
  int64_t bytes = 0;
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base != MAP_FAILED) munmap(base, static_cast<size_t>(bytes));
  }
  SegmentHeader* header() const { return static_cast<SegmentHeader*>(base); }
  RankControl* control(int rank) const {
    return reinterpret_cast<RankControl*>(static_cast<char*>(base) + sizeof(SegmentHeader)) +
           rank;
  }
  char* slot(int rank, uint64_t step) const {
    const int64_t world = header()->world_size;
    char* slots = reinterpret_cast<char*>(control(static_cast<int>(world)));
    return slots + (2 * rank + static_cast<int64_t>(step % 2)) * header()->slot_bytes;
  }
};

// One operand of a reduction: a pointer to `dtype` elements, or null for zeros.
using Sources = std::vector<const void*>;

// out[i] = (sum over sources in order)[i] (divided by `divisor` when not 1), accumulated in
// fp32 and rounded once for the 16-bit dtypes. `out` may be one of the sources (in place).
absl::Status ReduceInto(const Sources& sources, void* out, int64_t count, DType dtype,
                        int divisor) {
  float acc[kBlock];
  float widened[kBlock];
  const int64_t size = ElementSize(dtype);
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t n = std::min(kBlock, count - base);
    bool first = true;
    for (const void* source : sources) {
      if (source == nullptr) continue;
      const float* values;
      if (dtype == DType::kFloat32) {
        values = static_cast<const float*>(source) + base;
      } else {
        PS_RETURN_IF_ERROR(kernels::Cast16ToFloat(
            static_cast<const uint16_t*>(source) + base, widened, n, dtype));
        values = widened;
      }
      if (first) {
        std::memcpy(acc, values, n * sizeof(float));
        first = false;
      } else {
        for (int64_t i = 0; i < n; ++i) acc[i] += values[i];
      }
    }
    if (first) std::memset(acc, 0, n * sizeof(float));
    if (divisor != 1) {
      const float d = static_cast<float>(divisor);
      for (int64_t i = 0; i < n; ++i) acc[i] /= d;
    }
    char* destination = static_cast<char*>(out) + base * size;
    if (dtype == DType::kFloat32) {
      std::memcpy(destination, acc, n * sizeof(float));
    } else {
      PS_RETURN_IF_ERROR(
          kernels::CastFloatTo16(acc, reinterpret_cast<uint16_t*>(destination), n, dtype));
    }
  }
  return absl::OkStatus();
}

void CopyOrZero(void* destination, const void* source, int64_t bytes) {
  if (source == nullptr) {
    std::memset(destination, 0, static_cast<size_t>(bytes));
  } else {
    std::memcpy(destination, source, static_cast<size_t>(bytes));
  }
}

char* Offset(void* buffer, int64_t bytes) {
  return buffer == nullptr ? nullptr : static_cast<char*>(buffer) + bytes;
}

struct Call {
  CollectiveType type;
  std::vector<void*> buffers;
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::string label;  // for Note [Same call at every step]'s message
};

CallSignature SignatureOf(const Call& call, int64_t offset) {
  CallSignature signature{};
  signature.type = static_cast<uint32_t>(call.type);
  signature.dtype = static_cast<uint32_t>(call.dtype);
  signature.root = call.root;
  signature.buffers = static_cast<int32_t>(call.buffers.size());
  signature.count = call.count;
  signature.offset = offset;
  const size_t n = std::min(call.label.size(), sizeof(signature.label) - 1);
  std::memcpy(signature.label, call.label.data(), n);
  signature.label[n] = '\0';
  return signature;
}

std::string DescribeSignature(const CallSignature& signature) {
  CollectiveDescription description;
  description.type = static_cast<CollectiveType>(signature.type);
  description.buffers = signature.buffers;
  description.count = signature.count;
  description.dtype = static_cast<DType>(signature.dtype);
  description.label = signature.label;
  return description.ToString();
}

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(std::unique_ptr<Segment> segment, int rank, absl::Duration timeout)
      : segment_(std::move(segment)),
        rank_(rank),
        world_size_(static_cast<int>(segment_->header()->world_size)),
        slot_bytes_(segment_->header()->slot_bytes),
        timeout_(timeout),
        worker_(1, absl::StrCat("ps-shm-", rank)) {}

  ~ShmCommunicator() override {
    // Note [Shared-memory steps], Failure: the running call notices within kSleep, the queued
    // ones fail at once, then ~ThreadPool joins; the peers see kClosed. A forked child (a data
    // loader worker) that destroys its copy must not close the parent's rank.
    stopping_.store(true);
    worker_.WaitIdle();
    if (!failed_ && getpid() == creator_pid_) SetState(kClosed);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "shm"; }
  AddressSpace address_space() const override { return AddressSpace::kHostMemory; }

  CollectiveHandle AllGather(absl::Span<void* const> buffers, int64_t count, DType dtype,
                             std::string label) override {
    return Issue({CollectiveType::kAllGather, {buffers.begin(), buffers.end()}, count, dtype},
                 std::move(label));
  }
  CollectiveHandle ReduceScatter(absl::Span<void* const> buffers, int64_t count, DType dtype,
                                 ReduceOp op, std::string label) override {
    return Issue(
        {CollectiveType::kReduceScatter, {buffers.begin(), buffers.end()}, count, dtype, op},
        std::move(label));
  }
  CollectiveHandle AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                             std::string label) override {
    return Issue({CollectiveType::kAllReduce, {buffer}, count, dtype, op}, std::move(label));
  }
  CollectiveHandle Broadcast(void* buffer, int64_t count, DType dtype, int root,
                             std::string label) override {
    return Issue({CollectiveType::kBroadcast, {buffer}, count, dtype, ReduceOp::kSum, root},
                 std::move(label));
  }
  CollectiveHandle Reduce(void* buffer, int64_t count, DType dtype, ReduceOp op, int root,
                          std::string label) override {
    return Issue({CollectiveType::kReduce, {buffer}, count, dtype, op, root}, std::move(label));
  }

 private:
  CollectiveHandle Issue(Call call, std::string label) {
    call.label = label;
    CollectiveDescription description{call.type, static_cast<int64_t>(call.buffers.size()),
                                      call.count, call.dtype, std::move(label), backend()};
    // A null single buffer is allowed (zeros in, discarded out), as on the c10d back end.
    std::vector<void*> checked = call.buffers;
    if (checked.size() == 1 && checked[0] == nullptr) checked[0] = this;
    absl::Status valid = ValidateCollective(*this, call.type, checked, call.count, call.root);
    if (!valid.ok()) return CollectiveHandle::Failed(std::move(description), valid);
    auto state = std::make_shared<CollectiveState>(std::move(description));
    worker_.Schedule([this, state, call = std::move(call)] { state->Finish(Run(call)); });
    // After scheduling: a peer that reads n here may rely on our first n calls running
    // (Note [Issued everywhere] in communicator.h).
    segment_->control(rank_)->issued.fetch_add(1, std::memory_order_release);
    return CollectiveHandle(state);
  }

 public:
  std::vector<int64_t> IssuedByRank() const override {
    std::vector<int64_t> issued(static_cast<size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) {
      issued[r] = segment_->control(r)->issued.load(std::memory_order_acquire);
    }
    return issued;
  }

 private:

  // On the worker thread.
  absl::Status Run(const Call& call) {
    if (stopping_.load()) {
      return absl::CancelledError("the communicator was destroyed before the collective ran");
    }
    if (failed_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "an earlier collective on this communicator failed (", first_error_.ToString(),
          "); the ranks' sequences no longer agree"));
    }
    absl::Status status = RunSteps(call);
    if (!status.ok()) {
      failed_ = true;
      first_error_ = status;
      SetState(stopping_.load() ? kClosed : kFailed);
    }
    return status;
  }

  absl::Status RunSteps(const Call& call) {
    const int64_t size = ElementSize(call.dtype);
    const bool scatter = call.type == CollectiveType::kReduceScatter;
    // Reduce-scatter puts world_size pieces (one per destination) in a slot, 64-byte aligned.
    const int64_t piece_bytes =
        scatter ? slot_bytes_ / world_size_ / 64 * 64 / size * size : slot_bytes_ / size * size;
    const int64_t piece = piece_bytes / size;
    const absl::Time deadline = absl::Now() + timeout_;
    for (int64_t offset = 0; offset < call.count; offset += piece) {
      const int64_t n = std::min(piece, call.count - offset);
      PS_RETURN_IF_ERROR(Step(call, offset * size, n, piece_bytes, deadline));
    }
    return absl::OkStatus();
  }

  // Note [Shared-memory steps]: one step over elements [offset, offset + n) of every buffer.
  absl::Status Step(const Call& call, int64_t offset, int64_t n, int64_t piece_bytes,
                    absl::Time deadline) {
    const uint64_t step = ++step_;
    const int64_t bytes = n * ElementSize(call.dtype);
    const int me = rank_;
    const int world = world_size_;
    const std::vector<void*>& b = call.buffers;

    // 1. Our slot for this step is free once every peer consumed step - 2.
    PS_RETURN_IF_ERROR(WaitForPeers(
        [step](const RankControl& c) {
          return c.consumed.load(std::memory_order_acquire) + 2 >= step;
        },
        kEveryPeer, deadline, "finish reading step", step - 2, CollectiveName(call.type)));

    // 2. Our piece, and whom step 4 waits for: every peer, nobody, or the root.
    char* slot = segment_->slot(me, step);
    int read_from = kEveryPeer;
    switch (call.type) {
      case CollectiveType::kAllGather:
        CopyOrZero(slot, Offset(b[me], offset), bytes);
        break;
      case CollectiveType::kReduceScatter:
        for (int r = 0; r < world; ++r) {
          if (r != me) CopyOrZero(slot + r * piece_bytes, Offset(b[r], offset), bytes);
        }
        break;
      case CollectiveType::kAllReduce:
        CopyOrZero(slot, Offset(b[0], offset), bytes);
        break;
      case CollectiveType::kReduce:
        if (me != call.root) CopyOrZero(slot, Offset(b[0], offset), bytes);
        read_from = me == call.root ? kEveryPeer : kNobody;
        break;
      case CollectiveType::kBroadcast:
        if (me == call.root) CopyOrZero(slot, Offset(b[0], offset), bytes);
        read_from = me == call.root ? kNobody : call.root;
        break;
    }

    // 3. Publish, with what the piece belongs to (Note [Same call at every step]).
    RankControl& own = *segment_->control(me);
    own.signature[step % 2] = SignatureOf(call, offset);
    own.published.store(step, std::memory_order_release);
    Signal(own);

    // 4. Wait for the pieces we read.
    if (read_from != kNobody) {
      PS_RETURN_IF_ERROR(WaitForPeers(
          [step](const RankControl& c) {
            return c.published.load(std::memory_order_acquire) >= step;
          },
          read_from, deadline, "publish step", step, CollectiveName(call.type)));
    }

    // 5. Read, once every piece read belongs to the same call (Note [Same call at every step]).
    for (int r = 0; r < world; ++r) {
      if (r == me || (read_from != kEveryPeer && r != read_from)) continue;
      const CallSignature& peer = segment_->control(r)->signature[step % 2];
      if (!peer.SameCall(own.signature[step % 2])) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", r, " issued ", DescribeSignature(peer), " at step ", step,
            " (offset ", peer.offset, ") where rank ", me, " issued this call (offset ", offset,
            "): the ranks' sequences of collectives differ: ", kSameCallsHint));
      }
    }
    absl::Status status;
    switch (call.type) {
      case CollectiveType::kAllGather:
        for (int r = 0; r < world; ++r) {
          if (r != me && b[r] != nullptr) {
            std::memcpy(Offset(b[r], offset), segment_->slot(r, step), bytes);
          }
        }
        break;
      case CollectiveType::kReduceScatter:
        if (b[me] != nullptr) {
          Sources sources(world);
          for (int r = 0; r < world; ++r) {
            sources[r] = r == me ? Offset(b[me], offset)
                                 : segment_->slot(r, step) + static_cast<int64_t>(me) * piece_bytes;
          }
          status = ReduceInto(sources, Offset(b[me], offset), n, call.dtype, Divisor(call.op));
        }
        break;
      case CollectiveType::kAllReduce:
      case CollectiveType::kReduce:
        if (b[0] != nullptr && (call.type == CollectiveType::kAllReduce || me == call.root)) {
          Sources sources(world);
          for (int r = 0; r < world; ++r) {
            sources[r] = r == me ? Offset(b[0], offset) : segment_->slot(r, step);
          }
          status = ReduceInto(sources, Offset(b[0], offset), n, call.dtype, Divisor(call.op));
        }
        break;
      case CollectiveType::kBroadcast:
        if (me != call.root && b[0] != nullptr) {
          std::memcpy(Offset(b[0], offset), segment_->slot(call.root, step), bytes);
        }
        break;
    }

    // 6. Done with the peers' slots of this step.
    own.consumed.store(step, std::memory_order_release);
    Signal(own);
    return status;
  }

  // Note [Dead peers].
  bool PeerProcessAlive(const RankControl& peer) const {
    if (peer.pid == creator_pid_ || peer.pid_namespace != own_pid_namespace_ ||
        peer.pid_namespace == 0) {
      return true;
    }
    char state = '?';
    uint64_t start_time = 0;
    if (!ReadProcessStat(peer.pid, &state, &start_time)) return false;
    return state != 'Z' && state != 'X' && start_time == peer.start_time;
  }

  int Divisor(ReduceOp op) const { return op == ReduceOp::kAvg ? world_size_ : 1; }

  void Signal(RankControl& control) {
    control.signal.fetch_add(1, std::memory_order_seq_cst);
    if (control.waiters.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&control.signal);
  }

  void SetState(RankState state) {
    RankControl& own = *segment_->control(rank_);
    own.state.store(state, std::memory_order_release);
    Signal(own);
  }

  // Waits until `ready` holds for every peer, or for rank `only` alone.
  absl::Status WaitForPeers(absl::FunctionRef<bool(const RankControl&)> ready, int only,
                            absl::Time deadline, absl::string_view what, uint64_t step,
                            absl::string_view collective) {
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_ || (only >= 0 && r != only)) continue;
      RankControl& peer = *segment_->control(r);
      absl::Time next_liveness_check = absl::Now() + kLivenessInterval;
      for (int spins = 0;; ++spins) {
        const uint32_t signal = peer.signal.load(std::memory_order_acquire);
        if (ready(peer)) break;
        const uint32_t state = peer.state.load(std::memory_order_acquire);
        if (state != kAlive) {
          if (ready(peer)) break;  // its last stores came before its state
          return absl::AbortedError(absl::StrCat(
              "rank ", r, state == kClosed ? " closed its communicator" : " failed a collective",
              " before it could ", what, " ", step, " of ", collective, " (rank ", rank_, ")"));
        }
        if (stopping_.load(std::memory_order_relaxed)) {
          return absl::CancelledError("the communicator was destroyed during the collective");
        }
        if (spins < kSpins) {
          CpuRelax();
          continue;
        }
        const absl::Time now = absl::Now();
        if (now >= next_liveness_check) {
          next_liveness_check = now + kLivenessInterval;
          if (!PeerProcessAlive(peer)) {
            if (ready(peer)) break;
            return absl::AbortedError(absl::StrCat(
                "rank ", r, " (process ", peer.pid, ") exited before it could ", what, " ",
                step, " of ", collective, " (rank ", rank_, ")"));
          }
        }
        if (now > deadline) {
          return absl::DeadlineExceededError(absl::StrCat(
              "rank ", r, " did not ", what, " ", step, " within ", absl::FormatDuration(timeout_),
              " (rank ", rank_, " waiting): it died, stopped, or issued a different sequence "
              "of collectives (", kSameCallsHint, ")"));
        }
        peer.waiters.fetch_add(1, std::memory_order_seq_cst);
        FutexWait(&peer.signal, signal, kSleep);
        peer.waiters.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    return absl::OkStatus();
  }

  const std::unique_ptr<Segment> segment_;
  const int rank_;
  const int world_size_;
  const int64_t slot_bytes_;
  const absl::Duration timeout_;
  const pid_t creator_pid_ = getpid();
  const uint64_t own_pid_namespace_ = PidNamespace();
  std::atomic<bool> stopping_{false};
  // Worker thread only.
  uint64_t step_ = 0;
  bool failed_ = false;
  absl::Status first_error_;
  ThreadPool worker_;  // last: joined first, while the rest is alive
};

absl::Status ValidateOptions(const ShmCommunicatorOptions& options) {
  if (options.world_size < 1 || options.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("shm communicator: world size ",
                                                   options.world_size, " is not in [1, ",
                                                   kMaxWorldSize, "]"));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shm communicator: rank ", options.rank,
                                                   " is not in a world of ",
                                                   options.world_size));
  }
  if (options.slot_bytes % 64 != 0 || options.slot_bytes < 64 * options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm communicator: slot_bytes must be a multiple of 64 and at least 64 x "
                     "world size (",
                     64 * options.world_size, "), got ", options.slot_bytes));
  }
  if (options.name.size() < 2 || options.name[0] != '/' ||
      options.name.find('/', 1) != std::string::npos || options.name.size() > 250) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm communicator: the segment name must be '/' and up to 249 characters without '/', "
        "got '",
        options.name, "'"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shm communicator: the timeout must be positive");
  }
  return absl::OkStatus();
}

// Rank 0: creates, sizes (allocating the pages now: a full /dev/shm is an error here rather
// than a SIGBUS at the first write) and initializes the segment.
absl::Status CreateSegment(const ShmCommunicatorOptions& options, Segment* segment) {
  const int fd = shm_open(options.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("shm_open('", options.name, "')"));
  const int64_t bytes = SegmentBytes(options.world_size, options.slot_bytes);
  const int allocated = posix_fallocate(fd, 0, bytes);
  if (allocated != 0) {
    close(fd);
    shm_unlink(options.name.c_str());
    return ErrnoToStatus(allocated,
                         absl::StrCat("allocating ", bytes, " bytes of shared memory for '",
                                      options.name, "' (is /dev/shm large enough?)"));
  }
  // MAP_POPULATE: the slots' page faults now rather than in the first collectives.
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(options.name.c_str());
    return ErrnoToStatus(mmap_errno, absl::StrCat("mmap of '", options.name, "'"));
  }
  segment->base = base;
  segment->bytes = bytes;
  // The pages are zero: every counter starts at 0, every state at kAlive.
  SegmentHeader* header = segment->header();
  header->world_size = options.world_size;
  header->slot_bytes = options.slot_bytes;
  header->magic.store(kMagic, std::memory_order_release);
  return absl::OkStatus();
}

// Ranks other than 0: opens the segment once rank 0 initialized it. NotFound (retry) until then.
absl::Status OpenSegment(const ShmCommunicatorOptions& options, Segment* segment) {
  const int fd = shm_open(options.name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError("not created yet");
    return ErrnoToStatus(errno, absl::StrCat("shm_open('", options.name, "')"));
  }
  struct stat info;
  const int64_t bytes = SegmentBytes(options.world_size, options.slot_bytes);
  if (fstat(fd, &info) != 0 || info.st_size < static_cast<off_t>(sizeof(SegmentHeader))) {
    close(fd);
    return absl::NotFoundError("not sized yet");
  }
  void* base = mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, fd, 0);
  const int mmap_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return ErrnoToStatus(mmap_errno, absl::StrCat("mmap of '", options.name, "'"));
  }
  segment->base = base;
  segment->bytes = info.st_size;
  SegmentHeader* header = segment->header();
  if (header->magic.load(std::memory_order_acquire) != kMagic) {
    munmap(base, static_cast<size_t>(info.st_size));
    segment->base = MAP_FAILED;
    return absl::NotFoundError("not initialized yet");
  }
  if (header->world_size != options.world_size || header->slot_bytes != options.slot_bytes ||
      info.st_size != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm communicator '", options.name, "': rank 0 made it for a world of ",
        header->world_size, " with slots of ", header->slot_bytes, " bytes; rank ", options.rank,
        " expects ", options.world_size, " and ", options.slot_bytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(
    const ShmCommunicatorOptions& options) {
  PS_RETURN_IF_ERROR(ValidateOptions(options));
  const absl::Time deadline = absl::Now() + options.timeout;
  auto segment = std::make_unique<Segment>();
  const bool creator = options.rank == 0;
  if (creator) {
    PS_RETURN_IF_ERROR(CreateSegment(options, segment.get()));
  } else {
    while (true) {
      absl::Status opened = OpenSegment(options, segment.get());
      if (opened.ok()) break;
      if (!absl::IsNotFound(opened)) return opened;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "shm communicator: rank ", options.rank, " found no segment '", options.name,
            "' from rank 0 within ", absl::FormatDuration(options.timeout)));
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  SegmentHeader* header = segment->header();
  RankControl* own = segment->control(options.rank);
  own->pid = getpid();
  own->pid_namespace = PidNamespace();
  char state = '?';
  if (!ReadProcessStat(own->pid, &state, &own->start_time)) own->pid_namespace = 0;  // unknown
  header->attached.fetch_add(1, std::memory_order_acq_rel);  // publishes the identity above
  while (header->attached.load(std::memory_order_acquire) < options.world_size) {
    if (absl::Now() > deadline) {
      if (creator) shm_unlink(options.name.c_str());
      return absl::DeadlineExceededError(absl::StrCat(
          "shm communicator '", options.name, "': ",
          header->attached.load(std::memory_order_acquire), " of ", options.world_size,
          " ranks attached within ", absl::FormatDuration(options.timeout)));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  // Everybody mapped it: the name is no longer needed, and the memory goes with the last unmap.
  if (creator && shm_unlink(options.name.c_str()) != 0) {
    PS_LOG(kWarning, "shm_unlink('%s'): %s", options.name, std::strerror(errno));
  }
  PS_LOG(kDebug, "shm communicator '%s': rank %d of %d, %d-byte slots", options.name,
         options.rank, options.world_size, options.slot_bytes);
  return std::unique_ptr<Communicator>(
      new ShmCommunicator(std::move(segment), options.rank, options.timeout));
}

}  // namespace ps
