// Collectives on whole communication groups of a ChunkManager (Note [Communication groups] in
// chunk_manager_groups.cc): the gather of a group of compute params before use, the reduce-scatter of a
// group of gradients after backward, and the release of gathered groups. One collective per
// group (world_size broadcasts or reduces in memory-saving mode), never one per tensor.
//
// Note [Pinning a group for a collective]
// A collective writes into (and reads from) every chunk of a group at once, possibly on another
// thread, so none of them may move or be freed until it is done. The manager pins a chunk while
// one of its tensors is COMPUTE, so each member is pinned by accessing one of its tensors: a
// parameter chunk, or a gradient chunk with gradients_in_place (another rank's is dropped right
// after its reduce-scatter), where it already is if the communicator can reach that memory,
// anything else in the
// collective's tier (a copy), and released back to the state it had when the collective ends
// (a tensor of the local chunk of a reduce-scatter goes to HOLD: it now holds the reduced
// gradient). A member without tensors (padding) or without data is passed as a null buffer (Note
// [Group collectives] in runtime/communicator.h). The extra accesses appear in the tracer's access
// sequence like any other. A parameter chunk with a prefetch in flight counts as being where the
// prefetch takes it: the trace that issued the prefetch says it is used there right after the
// collective, and pinning it at the old place would copy it back there and then up again (found
// with prefetch on under data parallelism: every gathered group's local chunk made the round trip,
// test PinningAChunkWithAPrefetchInFlightKeepsThePrefetch). A group with a tensor in use
// (COMPUTE) cannot be pinned that way, and pinning it in place would hand the communicator
// memory the compute may be writing; the caller orders a group's collective before any access
// of its tensors, and a collective that finds one in use is a FailedPrecondition naming it
// (test AGatherOfAGroupWithATensorInUseIsAClearError).
//
// Note [Collective order]
// The caller decides *when*; this class only guarantees that each call issues its collectives
// at once, in a fixed order, and that Finish waits for them in issue order. The engine keeps the
// sequence of calls identical on every rank (data_parallel.py, Note [A data-independent
// collective schedule]).
//
// Note [Started gathers]
// StartGather issues a group's gather and returns with the group pinned (as Gather pins it);
// the next Gather of that group, FinishGathers or ReleaseAll(kComputeParam) waits for it, and
// for every gather started before it, in issue order, then unpins and marks the group gathered.
// Starting is only a matter of timing: the collective is issued at the call, so a caller that
// starts and gathers groups in the same order on every rank issues the same sequence as with
// Gather alone, whichever rank's collectives finish first. While a group is in flight nothing
// else may touch its chunks (the communicator writes into them on its thread): the caller
// finishes a group's gather before accessing any tensor of it, local ones included (their
// chunk is pinned for the send), and ReleaseAll finishes every started gather before it drops
// payloads. Pinning ahead holds memory longer than gathering at first use; when a tier cannot
// take the group now (ResourceExhausted) StartGather issues nothing, leaves the group as it
// was and returns false, and the Gather at first use issues the collective: a rank that
// declines and one that starts still issue the same sequence, provided the caller starts no
// later group before the declined one is issued (gathers_declined() tells it; data_parallel.py
// stops starting there). A started gather that fails (a dead peer, or one past the timeout) is
// an error naming the collective at the Gather / FinishGathers that waits for it, never a hang; it and
// every gather queued behind it are abandoned without further waiting: their groups stay
// ungathered and their chunks stay pinned, because the communicator may still write into them
// (the destructor unpins those that finished by then).
//
// Note [Releasing one group]
// Dropping a group's remote payloads is no collective, so each rank may release a group when
// its own pass is done with it (data_parallel.py, Note [Resharding after forward]). What must
// agree is the next Gather: PlanGather's needs_gather is true on a rank that released the group
// and false on one that did not, so the caller makes every rank release every group it will
// gather again before that gather (the end of forward releases all of them), or the ranks would
// issue different sequences. A group with a tensor in COMPUTE is not released (its chunk
// memory is in use by torch); Release says so and the caller retries at its next moment.
//
// Note [Receiving where the group is computed on]
// A chunk a gather receives was placed in the collective's tier (the host tier for gloo) and
// moved into the compute tier by its first access: a copy that holds the chunk twice for a
// moment, one chunk more on the peak model data of every rank that does not own it (traced at
// the peak of the 2-rank bf16 run of docs/benchmarks.md, issue 18). With `compute_tier` set and
// addressable by the communicator (the emulated device tier for gloo, the device tier for
// NCCL), Gather receives there instead, but only into room that is free at the call: it evicts
// nothing for its receive buffers (evicting would do early what the access does anyway, but
// while the group's other chunks are pinned for the collective, so it could fail where the
// access would not). Without free room the chunk goes to `tier` as before and its access moves
// it when it comes. StartGather always receives into `tier`: its chunks stay pinned until their
// group's first use, and room taken in the compute tier then is room that the accesses and
// gradient stores before that use may need (a pipeline stage under a tight device budget,
// tests/python/test_parallelism.py); measured, receiving started gathers there too lowered no
// configuration that was above FSDP2's in docs/benchmarks.md then. Once the owner stopped
// keeping its bf16 compute chunks (Note [Compute chunks re-made from the master] in
// chunk_manager_remake.cc) it did: bf16 with accumulation at 2 ranks peaked in forward while a
// started group's 2 MiB chunk was copied from the host tier into the compute tier at its first
// use, 2 MiB above gathering at first use (measured). So `started_in_compute_tier` lets a
// caller without pipeline stages (data_parallel.py) receive started gathers in the compute tier
// too, only while that tier has free room for twice what the group places there: a tight
// budget keeps the old way (gpt_tight of tests/python/test_data_parallel.py, a device budget of
// a few chunks, evicted more and lost every prefetch hit of rank 0 when started gathers took
// its last free room). Where a chunk is received is this rank's business: the collective
// sequence is the same either way.
#pragma once

#include <deque>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "chunk/chunk_manager.h"
#include "runtime/communicator.h"

namespace ps {

struct GroupCollectiveOptions {
  // Where a group's chunks are placed for the collective: kHost for host back ends (gloo),
  // kDevice for NCCL. Must match the communicator's address space.
  TierKind tier = TierKind::kHost;
  absl::Duration timeout = absl::Minutes(5);
  // PatrickStar's broadcast / reduce per chunk instead of one allgather / reduce-scatter.
  bool memory_saving = false;
  ReduceOp gradient_op = ReduceOp::kAvg;
  // A gradient chunk with a payload (another rank's, or this rank's own) is pinned for its
  // reduce-scatter where it is, when the communicator can address that memory, instead of
  // being copied into `tier` (TierFor). Only for callers that finish reduce-scatters promptly
  // (Note [Waiting for reduce-scatters every rank issued]): a pending one pins the chunk in the
  // compute tier until finished, which starved a pipeline stage's tight device budget.
  bool gradients_in_place = false;
  // The tier the caller computes on (the engine accesses parameters there): the chunks Gather
  // receives go there when the communicator can address it and it has free room, else to
  // `tier`; StartGather's go to `tier` (Note [Receiving where the group is computed on]).
  // Unset, or a tier the communicator cannot address: always `tier`.
  std::optional<TierKind> compute_tier;
  // StartGather's chunks go to `compute_tier` too, but only while it has free room for twice
  // what the group places there (as much again stays free for the accesses before the group's
  // first use): for callers without pipeline stages (Note [Receiving where the group is
  // computed on]).
  bool started_in_compute_tier = false;
};

// Note [Sharded accumulation]
// With gradient accumulation, a group may be reduce-scattered on every micro-step instead of once
// at the boundary, so that no rank keeps full-size gradients between micro-steps. The owner's
// chunk is both its input and its output: after a micro-step's reduce-scatter it holds the sum
// S of every rank's gradients so far, and the next micro-step's local gradients are added to it
// (the remote chunks were dropped and start from zeros). Reducing with kSum before the boundary
// and kAvg at it therefore gives (S + sum of the last micro-step's gradients) / N: the average
// over ranks of the accumulated gradient, exactly what one reduce-scatter at the boundary gives,
// with no extra pass to scale the shard. Summation order differs (per micro-step partial sums),
// so results match the one-shot reduce-scatter up to rounding, not bit for bit.
// Note [One holder, one broadcast]
// An oversize group (Note [Oversize groups] in chunk_layout.h) is world_size chunks of one
// tensor's size of which only the holder's has the tensor; the others are padding that never
// has a payload. An allgather of it moved world_size buffers, zeros from every rank but the
// holder (world_size times the bytes of the tensor), and a reduce-scatter reduced world_size
// buffers of which all but the holder's were discarded. The group's only data is the holder's,
// so its gather is one broadcast from the holder and its reduce-scatter one reduce to it: the
// same results, 1/world_size of the bytes, one collective either way. Every rank decides this
// from the layout alone (the same on every rank), so the collectives still pair.
// Note [Waiting for reduce-scatters every rank issued]
// A reduce-scatter started in backward keeps this rank's full-size gradients of its group until
// it is finished, and FinishCompletedReduceScatters only finishes the ones already done: on
// a rank whose next group's gradients arrive while the last group's reduce is still in flight
// (the common case when compute is short: a 4 MiB reduce against one small matmul), three
// groups were held at once in backward (the next group's parameters, its gradients, the last
// group's gradients), where FSDP2 holds about two. Waiting for the reduce-scatter before the
// next gradients land would keep it at two, but blocking on a collective a peer has yet to
// issue can deadlock: its gradients of the group may come only after a gather it needs this
// rank to join (an unused branch on that rank, or a model whose ranks run different code).
// So the wait is for collectives every rank has already issued (Note [Issued everywhere] in
// runtime/communicator.h), which complete without anybody's caller; while some rank has not
// issued the oldest yet this rank waits for it to do so, but gives up as soon as that rank is
// ahead on `watched` (backward's gathers: it may be waiting there for this rank), or after
// `bound`. Giving up only costs memory: nothing is issued, so the collective sequence is what
// it was. A rank that never issues the reduce-scatter in backward (its gradients of the group
// come last) either gathers again (ahead on `watched`: the waiter stops) or ends backward,
// which begins with a collective on `watched` too.
struct ReduceScatterWait {
  int finished = 0;      // reduce-scatters finished
  bool gave_up = false;  // stopped waiting for a rank to issue the oldest one left
};

class GroupCollectives {
 public:
  // Both must outlive this object; `communicator` has the manager's world size and rank.
  static absl::StatusOr<std::unique_ptr<GroupCollectives>> Create(ChunkManager* manager,
                                                                  Communicator* communicator,
                                                                  GroupCollectiveOptions options);

  // The first chunk of every group of `kind` that holds at least one tensor, in group order.
  std::vector<ChunkId> Groups(ChunkKind kind) const;
  // The first chunk of the group of `tensor`.
  absl::StatusOr<ChunkId> GroupOf(TensorId tensor) const;

  ~GroupCollectives();  // waits for started gathers (the communicator writes into their chunks)

  // Gathers the group (named by any of its chunks) if this rank lacks data of it (PlanGather's
  // needs_gather); synchronous. A group whose gather was started is finished (with every gather
  // started before it). Returns whether a collective ran for it.
  absl::StatusOr<bool> Gather(ChunkId group);
  // Issues the gather of the group if it needs one and is not started yet, and returns at once
  // with the group pinned (Note [Started gathers]). Returns whether a collective started: false
  // too when a tier has no room to pin the group now (Gather issues it later).
  absl::StatusOr<bool> StartGather(ChunkId group);
  // Finishes every started gather, in issue order.
  absl::Status FinishGathers();
  int pending_gathers() const { return static_cast<int>(gathers_.size()); }
  // Releases every group of `kind` (ReleaseGroup): remote payloads are dropped and the next
  // Gather of each group runs its collective, on every rank alike. Finishes started gathers
  // first.
  absl::Status ReleaseAll(ChunkKind kind);
  // Releases one compute-param group (its remote payloads are dropped; the next Gather of it
  // runs its collective), finishing its started gather first. Returns false, changing nothing,
  // while a tensor of the group is in use (COMPUTE): the caller tries again later. Releasing is
  // local, no collective (Note [Releasing one group]).
  absl::StatusOr<bool> Release(ChunkId group);

  // Starts the reduce-scatter of a gradient group; its chunks stay pinned until
  // FinishReduceScatters, which waits for every started one in issue order, drops the remote
  // payloads (their tensors become FREE) and leaves every tensor of the local chunk HOLD.
  // `op` overrides the options' gradient_op for this collective (Note [Sharded accumulation]).
  absl::Status StartReduceScatter(ChunkId group, std::optional<ReduceOp> op = std::nullopt);
  absl::Status FinishReduceScatters();
  // Finishes the started reduce-scatters, oldest first, whose collectives are already done,
  // stopping at the first still running; never waits. Returns how many it finished (their
  // remote gradient payloads are dropped at once, so a long backward holds few full-size
  // gradient groups).
  absl::StatusOr<int> FinishCompletedReduceScatters();
  // Finishes the started reduce-scatters, oldest first, waiting for each once every rank has
  // issued it (Note [Waiting for reduce-scatters every rank issued]). Stops, without error,
  // when the communicator cannot tell who issued what, when a rank that has yet to issue the
  // oldest went ahead of this one on `watched` (null: never), or after `bound`.
  absl::StatusOr<ReduceScatterWait> FinishReduceScattersIssuedEverywhere(
      const Communicator* watched, absl::Duration bound);
  int pending_reduce_scatters() const { return static_cast<int>(pending_.size()); }

  // Counters for tests and benchmarks.
  int64_t collectives_issued() const { return collectives_issued_; }
  int64_t bytes_communicated() const { return bytes_communicated_; }  // per rank, group bytes
  int64_t gathers_started() const { return gathers_started_; }  // collectives StartGather issued
  int64_t gathers_declined() const { return gathers_declined_; }  // StartGather without room

 private:
  struct Pin {
    TensorId tensor = -1;
    TensorState restore = TensorState::kHold;
  };
  struct Pending {
    ChunkId first = -1;
    std::vector<Pin> pins;
    std::vector<CollectiveHandle> handles;
    int64_t issued = 0;  // this rank's calls on the communicator after it; 0: not counted
  };

  GroupCollectives(ChunkManager* manager, Communicator* communicator,
                   GroupCollectiveOptions options)
      : manager_(manager), communicator_(communicator), options_(options) {}
  // The group's chunk ids and the element count every buffer has (equal sizes checked).
  absl::StatusOr<std::vector<ChunkId>> Members(ChunkId group, int64_t* count, DType* dtype) const;
  // FailedPrecondition naming a tensor of the group that is COMPUTE (Note [Pinning a group for
  // a collective]: a collective must come before any tensor of its group is accessed).
  absl::Status CheckNoneInUse(absl::Span<const ChunkId> members) const;
  // Pins `chunk` (Note [Pinning a group for a collective]) and returns its payload, or null when
  // it has no tensor or (unless `zero_fill`) no data.
  absl::StatusOr<void*> PinChunk(ChunkId chunk, bool zero_fill, std::vector<Pin>* pins);
  absl::Status Unpin(std::vector<Pin>& pins);
  // The index of the one member holding tensors when the group is an oversize group (Note
  // [Oversize groups] in chunk_layout.h), else -1: Note [One holder, one broadcast].
  int SoleHolder(absl::Span<const ChunkId> members) const;
  // Adds a just-issued group collective to the counters: its handles, and `buffers` buffers of
  // `count` elements moved.
  void CountCollective(const Pending& pending, int64_t count, DType dtype, size_t buffers);
  // Where to pin `chunk`: a parameter chunk stays in its own tier when the communicator can
  // address it, so that pinning does not move it (autograd may hold views of its current
  // memory); gradient chunks, and chunks elsewhere, go to options_.tier.
  TierKind TierFor(const Chunk& chunk) const;
  absl::Status WaitAll(const std::vector<CollectiveHandle>& handles) const;
  // Gives a remote chunk of a gather its (uninitialized) receive buffer, HOLD and unpinned: in
  // the compute tier when `compute_tier_allowed` and it has free room, else in options_.tier
  // (Note [Receiving where the group is computed on]).
  absl::Status PlaceReceived(ChunkId chunk, bool compute_tier_allowed);
  // Whether a started gather of `plan` (chunks of `count` elements) may place its chunks in the
  // compute tier: started_in_compute_tier and free room for twice them.
  bool StartedFitComputeTier(const GatherPlan& plan, int64_t count, DType dtype) const;
  // Pins the group and issues its gather; nullopt when it needs none.
  // `started`: by StartGather (Note [Receiving where the group is computed on]).
  absl::StatusOr<std::optional<Pending>> IssueGather(ChunkId group, bool started);
  // Waits for gathers_[0..index] in order, completing each (Note [Started gathers]).
  absl::Status FinishGathersThrough(size_t index);
  int FindStartedGather(ChunkId first) const;  // its index in gathers_, or -1
  ChunkId FirstOf(const Chunk& chunk) const;  // the first chunk of `chunk`'s group
  std::string Label(ChunkId first) const;
  // Waits for pending_.front(), makes its local chunk HOLD and drops its remote payloads.
  absl::Status FinishOldestReduceScatter();

  ChunkManager* manager_;
  Communicator* communicator_;
  GroupCollectiveOptions options_;
  std::deque<Pending> pending_;    // started reduce-scatters
  std::deque<Pending> gathers_;    // started gathers, in issue order
  std::deque<Pending> abandoned_;  // failed gathers and those queued behind them
  int64_t gathers_started_ = 0;
  int64_t gathers_declined_ = 0;
  int64_t collectives_issued_ = 0;
  int64_t bytes_communicated_ = 0;
};

}  // namespace ps
