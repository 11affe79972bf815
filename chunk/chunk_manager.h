// The chunk manager: registers tensors, packs them into chunk lists, runs the tensor state
// machine, places chunks in a hierarchy of tiers within their budgets (OPT eviction from the
// warm-up trace, LRU before it), prefetches ahead of use, keeps the multi-rank bookkeeping and
// the statistics. Not thread-safe: one caller (the training loop) drives it; copies run on the
// copy engine's threads and are only observed through their handles.
//
// Note [Budgets and non-model data]
// Each tier's configured budget B (its Tier budget when the manager is created; 0 = unlimited)
// is shared between chunks and the non-model data N that the tracer reports for that tier
// (Note [Moments and the warm-up trace]). The manager keeps the tier's *reserved* bytes (what the
// slab pool really holds) within B - N: it sets the Tier's own budget to B - N, so slab growth
// can never overshoot, and whenever N grows it evicts and trims until the reserved bytes fit.
// Chunk bytes on a tier are therefore <= reserved bytes <= B - N at every step.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "chunk/chunk.h"
#include "chunk/chunk_layout.h"
#include "chunk/event_log.h"
#include "chunk/memory_tracer.h"
#include "nlohmann/json.hpp"
#include "runtime/copy_engine.h"
#include "runtime/tier.h"

namespace ps {

enum class EvictionPolicy {
  kOptAfterWarmup,  // LRU during warm-up, then OPT (Belady) over the recorded access sequence
  kLru,             // LRU always (the baseline OPT is measured against)
};

struct ChunkManagerOptions {
  // The hierarchy, fastest first: at most one tier per TierKind, in the order device, host,
  // NVMe; at least one memory (device or host) tier. Eviction moves chunks one tier down.
  std::vector<std::shared_ptr<Tier>> tiers;
  std::shared_ptr<CopyEngine> copy_engine;  // required
  int world_size = 1;
  int rank = 0;
  // After warm-up, copies for the accesses of the next `prefetch_moments` moments are started
  // at every Tick() (0 disables prefetching).
  int prefetch_moments = 0;
  EvictionPolicy eviction_policy = EvictionPolicy::kOptAfterWarmup;
};

struct LayoutReport {
  int64_t chunk_elements = 0;
  int64_t wasted_bytes = 0;
  int64_t candidates = 1;  // chunk sizes evaluated (1 when the size was given)
  int64_t num_chunks = 0;
  std::vector<std::string> oversize_tensors;
  uint64_t layout_hash = 0;
};

// Where an accessed tensor's bytes are, for torch::from_blob. Valid while the tensor is COMPUTE.
struct TensorView {
  uint64_t address = 0;
  TierKind tier_kind = TierKind::kHost;
  AddressSpace address_space = AddressSpace::kHostMemory;  // host or device memory
  std::string tier_name;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

// The communication group of a tensor's chunk and what this rank must receive to use it.
struct GatherPlan {
  ChunkKind kind = ChunkKind::kComputeParam;
  int64_t group = 0;
  std::vector<ChunkId> chunks;      // the group, chunk r owned by rank r
  ChunkId local_chunk = -1;         // the chunk this rank owns (and sends)
  std::vector<ChunkId> to_receive;  // remote chunks whose data lives only on their owner
  // Whether the group's collective must run now. The same on every rank at the same point of
  // the access sequence, even on a rank with nothing to receive (it still sends its chunk).
  bool needs_gather = false;
};

struct TierChunkStats {
  std::string name;
  TierKind kind = TierKind::kHost;
  int64_t budget_bytes = 0;  // as configured; 0 = unlimited
  int64_t non_model_bytes = 0;
  int64_t chunk_bytes = 0;  // payloads resident now (prefetch destinations included)
  int64_t peak_chunk_bytes = 0;
  int64_t reserved_bytes = 0;  // the tier's slab reservation now
  int64_t bytes_in = 0;        // copied into this tier
  int64_t bytes_out = 0;       // copied out of this tier
  int64_t chunks_in = 0;
  int64_t chunks_out = 0;
  int64_t evictions = 0;  // chunks evicted from this tier to make room
  int64_t zero_fills = 0;
  int64_t prefetch_issued = 0;
  int64_t prefetch_hits = 0;    // accesses served by a prefetch into this tier
  int64_t prefetch_misses = 0;  // post-warm-up accesses that had to copy synchronously
  int64_t copy_wait_ns = 0;     // time Access/MoveChunk spent waiting for copies into this tier
};

struct EvictionRecord {
  int64_t iteration = 0;
  int64_t moment = 0;
  int64_t position = 0;  // access position in the iteration when the victim was chosen
  ChunkId chunk = -1;
  int from_tier = 0;
  int to_tier = 0;
};

class ChunkManager {
 public:
  static absl::StatusOr<std::unique_ptr<ChunkManager>> Create(ChunkManagerOptions options);
  ~ChunkManager();  // waits for prefetches in flight and returns every payload block
  ChunkManager(const ChunkManager&) = delete;
  ChunkManager& operator=(const ChunkManager&) = delete;

  // ---- Registration and layout -------------------------------------------------------------
  // Before BuildChunkLists only; names are unique.
  absl::StatusOr<TensorId> RegisterTensor(TensorSpec spec);
  absl::StatusOr<LayoutReport> BuildChunkLists(int64_t chunk_elements);
  absl::StatusOr<LayoutReport> BuildChunkListsSearched(const ChunkSizeSearch& search);
  bool built() const { return built_; }

  // ---- Tensor states and placement --------------------------------------------------------
  // Brings the tensor's chunk to `tier` (a memory tier) and marks the tensor COMPUTE.
  absl::StatusOr<TensorView> Access(TensorId tensor, TierKind tier);
  // COMPUTE -> `state` (HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD or FREE).
  absl::Status Release(TensorId tensor, TensorState state);
  // A transition that neither enters nor leaves COMPUTE (e.g. HOLD_AFTER_BWD -> HOLD, or
  // dropping a tensor's contents to FREE). RELEASED only for tensors of remote chunks.
  absl::Status SetTensorState(TensorId tensor, TensorState state);
  // The view of a COMPUTE tensor.
  absl::StatusOr<TensorView> View(TensorId tensor) const;
  // Moves an unpinned chunk with a payload to `tier` (any tier, NVMe included).
  absl::Status MoveChunk(ChunkId chunk, TierKind tier);
  // Starts copying a chunk to `tier` without waiting (Note [Started moves] in chunk_manager_moves.cc):
  // the read-ahead and write-back of the optimizer sweep. No-op (returns false) for a chunk that
  // is pinned, has no payload, or is already there or on its way somewhere.
  absl::StatusOr<bool> StartMove(ChunkId chunk, TierKind tier);
  // The kind of tier holding the chunk's payload (its destination while a move is in flight is
  // not counted); nullopt when it has none.
  absl::StatusOr<std::optional<TierKind>> ChunkTier(ChunkId chunk) const;

  // ---- Moments and the tracer -------------------------------------------------------------
  absl::Status Tick();
  absl::Status ReportNonModelData(TierKind tier, int64_t bytes);
  absl::Status SetNonModelDataProbe(TierKind tier, NonModelDataProbe probe);
  // Waits for prefetches; the first call ends warm-up.
  absl::Status EndIteration();
  // Before the first EndIteration: drops the trace recorded so far (MemoryTracer::RestartWarmup),
  // e.g. the accesses of initialization; FailedPrecondition once warm-up has ended.
  absl::Status RestartWarmup();
  const MemoryTracer& tracer() const { return tracer_; }
  // Chunk bytes `tier` may hold at `moment` of an iteration: its budget minus the non-model
  // bytes the warm-up trace recorded there (during warm-up: the latest report).
  // std::numeric_limits<int64_t>::max() for a tier without a budget.
  absl::StatusOr<int64_t> ChunkBytesAllowedAt(TierKind tier, int64_t moment) const;
  // Chunk bytes `tier` may take now without evicting anything: AllowedChunkBytes minus what it
  // holds; std::numeric_limits<int64_t>::max() for a tier without a budget.
  absl::StatusOr<int64_t> FreeChunkBytes(TierKind tier) const;

  // ---- Communication groups (Note [Communication groups] in chunk_manager_groups.cc) --------------
  int world_size() const { return options_.world_size; }
  int rank() const { return options_.rank; }
  bool IsLocal(ChunkId chunk) const;
  absl::StatusOr<GatherPlan> PlanGather(TensorId tensor) const;
  // Groups (named by their first chunk) whose tensors were all used in this pass
  // (HOLD_AFTER_FWD / HOLD_AFTER_BWD), none COMPUTE, and that are not released yet.
  std::vector<ChunkId> ReleasableGroups() const;
  // Releases the group of `chunk` on this rank: drops the payloads of its remote chunks, and of
  // its local one when Remakeable (their tensors holding data become RELEASED), and marks the
  // group as needing a gather. Every rank
  // calls it at the same point (also after initialization: release_after_init).
  absl::Status ReleaseGroup(ChunkId chunk);
  // Writes zeros over the FREE tensors of a chunk that has a payload in memory (Note [FREE
  // tensors in a reduced chunk]): a reduce-scatter adds every byte of its buffers. No-op
  // without a payload; FailedPrecondition when the payload is a file range.
  absl::Status ZeroFreeTensors(ChunkId chunk);
  // For a remote chunk without a payload (one of PlanGather's to_receive): places a payload on
  // `tier`, lets `fill` write the chunk's bytes into it (the collective, or a test's fake one),
  // and turns its RELEASED tensors back to HOLD. A failed fill drops the payload again. With
  // `evict` false it takes only room that is free on `tier` now: when there is none it evicts
  // nothing and returns ResourceExhausted with the chunk unchanged (Note [Receiving where the
  // group is computed on] in group_collectives.h).
  absl::Status MaterializeGathered(ChunkId chunk, TierKind tier,
                                   absl::FunctionRef<absl::Status(void* data, int64_t bytes)> fill,
                                   bool evict = true);
  // Marks the group of `chunk` gathered after its collective; FailedPrecondition if a chunk this
  // rank had to receive is still missing.
  absl::Status CompleteGather(ChunkId chunk);

  // ---- Compute chunks re-made from their masters (Note [Compute chunks re-made from the master]
  // in chunk_manager_remake.cc) ---------------------------------------------------------------
  // Converts `count` fp32 values into `dtype` (kFloat16 or kBFloat16) on the host: the
  // optimizer's own conversion (kernels::CastFloatTo16AsUpdate), passed in because the kernels
  // library is built on this one.
  using CastToCompute = absl::Status (*)(const float* src, uint16_t* dst, int64_t count,
                                         DType dtype);
  // Declares which of this rank's compute-param chunks ReleaseGroup drops like a remote one,
  // from (16-bit compute tensor, its fp32 master tensor) pairs: a local chunk each of whose
  // tensors is paired, at the same offset of one master chunk of this rank. Chunks with an
  // unpaired tensor (a frozen 16-bit parameter) keep their payload as before. Replaces any
  // earlier declaration; returns how many chunks it names. Needs a host tier (the conversion
  // runs there).
  absl::StatusOr<int64_t> SetRemakeSources(absl::Span<const std::pair<TensorId, TensorId>> pairs,
                                           CastToCompute cast);
  bool Remakeable(ChunkId chunk) const { return remake_sources_.contains(chunk); }
  // For a remakeable chunk without a payload whose tensors are RELEASED: places a payload in
  // `tier` when the host can write it (with `evict` false only into free room there), else in
  // the host tier, and writes each RELEASED tensor from its master (staged in the host tier by
  // an access, from NVMe if need be), which turns it HOLD. Returns whether it did; false (no-op)
  // for any other chunk. Access and GroupCollectives' gathers call it; no collective.
  absl::StatusOr<bool> Remake(ChunkId chunk, std::optional<TierKind> tier = std::nullopt,
                              bool evict = true);
  int64_t remakes() const { return remakes_; }  // chunks Remake re-made (a counter)

  // ---- Introspection ----------------------------------------------------------------------
  int64_t num_tensors() const { return static_cast<int64_t>(tensors_.size()); }
  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  absl::StatusOr<TensorId> FindTensor(absl::string_view name) const;
  absl::StatusOr<const TensorInfo*> tensor(TensorId tensor) const;
  absl::StatusOr<const Chunk*> chunk(ChunkId chunk) const;
  std::vector<ChunkId> ChunksOfKind(ChunkKind kind) const;
  uint64_t layout_hash() const { return layout_hash_; }
  int num_tiers() const { return static_cast<int>(tiers_.size()); }
  const Tier& tier(int index) const { return *tiers_[index].tier; }
  // The engine that moves this manager's chunks (device work that writes a chunk orders the
  // copies after it: CopyEngine::OrderAfter).
  CopyEngine& copy_engine() const { return *options_.copy_engine; }
  std::vector<TierChunkStats> Stats() const;
  // Each tier's peak_chunk_bytes starts again from its current chunk bytes (torch's
  // reset_peak_memory_stats): the peak of a phase, training after initialization say.
  void ResetPeakStats();
  // The peak of the chunk bytes of all tiers together (model data in the process): summing the
  // tiers' own peaks counts a chunk twice when it moves between tiers at different moments
  // (device in backward, host in a CPU optimizer step).
  int64_t peak_total_chunk_bytes() const { return peak_total_chunk_bytes_; }
  // The most recent evictions: at least the last kEvictionLogKeep (all of them before that).
  static constexpr size_t kEvictionLogKeep = 1 << 14;
  const std::vector<EvictionRecord>& eviction_log() const { return eviction_log_; }
  // Per-tier statistics alone: cheap enough to read every step (ToJson carries the trace).
  nlohmann::json TierStatsJson() const;
  // The layout alone (chunks and their tensors, world, hash): what checkpoints record; its cost
  // does not grow with the run, unlike ToJson's trace and eviction log.
  nlohmann::json LayoutJson() const;
  nlohmann::json ToJson() const;
  std::string DumpJson(int indent = 2) const;

  // ---- Profiling (chunk/event_log.h; off unless enabled) ------------------------------------
  EventLog& events() { return events_; }
  const EventLog& events() const { return events_; }

 private:
  struct TierSlot {
    std::shared_ptr<Tier> tier;
    int64_t budget_bytes = 0;  // configured B; 0 = unlimited
    int64_t chunk_bytes = 0;   // resident payloads and pending prefetch destinations
    TierChunkStats stats;
  };

  int64_t total_chunk_bytes_ = 0;  // over all tiers
  int64_t peak_total_chunk_bytes_ = 0;

  explicit ChunkManager(ChunkManagerOptions options);
  absl::StatusOr<LayoutReport> Adopt(LayoutPlan plan, int64_t candidates);
  absl::Status CheckBuilt(absl::string_view operation) const;
  absl::StatusOr<TensorInfo*> MutableTensor(TensorId tensor);
  absl::StatusOr<int> TierIndex(TierKind kind) const;
  std::string DescribeChunk(const Chunk& chunk) const;
  ChunkId FirstOfGroup(const Chunk& chunk) const;
  TensorView ViewOf(const TensorInfo& tensor) const;
  // Every chunk with its tensors; `with_placement` adds each chunk's tier and tensor states.
  nlohmann::json ChunksJson(bool with_placement) const;

  // Chunk bytes `tier` should hold now: B - N with N the trace's forecast or the report,
  // whichever is larger, or "unlimited". Eviction aims at this.
  int64_t AllowedChunkBytes(int tier) const;
  // Chunk bytes `tier` can hold now: B - the reported N, or "unlimited". Only this fails an
  // access (Note [The trace forecasts, the report bounds] in chunk_manager_placement.cc).
  int64_t ChunkBytesLimit(int tier) const;
  // Applies B - N (forecast) to the Tier and evicts/trims until its reservation fits it, or at
  // least B - N (reported) when nothing is left to evict.
  absl::Status EnforceBudget(int tier);
  // A block of `bytes` on `tier`, evicting unpinned chunks not in `exclude` as needed (with
  // `evict` false: ResourceExhausted instead of evicting or settling a copy into the tier).
  absl::StatusOr<Block> AllocateWithEviction(int tier, int64_t bytes,
                                             absl::Span<const ChunkId> exclude,
                                             absl::string_view purpose, bool evict = true);
  Chunk* ChooseVictim(int tier, absl::Span<const ChunkId> exclude);
  // A chunk outside `exclude` with a copy in flight into `tier` (`into`) or out of it.
  Chunk* PendingCopy(int tier, absl::Span<const ChunkId> exclude, bool into);
  absl::Status Evict(Chunk& victim, absl::Span<const ChunkId> exclude);
  // Starts copying the chunk's payload into `destination`, a block of `tier` (its bytes counted
  // there from now on), and logs the issue; a refused copy frees the block again, its error
  // annotated with `purpose`.
  absl::StatusOr<CopyHandle> IssueCopy(Chunk& chunk, const Block& destination, int tier,
                                       bool prefetch, absl::string_view purpose);
  // Copies the payload to `tier` (synchronously) and frees the old block.
  absl::Status MoveTo(Chunk& chunk, int tier, absl::Span<const ChunkId> exclude);
  absl::Status MakeResident(Chunk& chunk, int tier, bool evict = true);
  // Waits for a copy of `chunk` into `destination` on `tier`; on success the destination becomes
  // the payload and the old block is freed, on failure the destination is freed.
  absl::Status SettleCopy(Chunk& chunk, const Block& destination, int tier,
                          const CopyHandle& handle, absl::string_view what);
  void AbandonDestination(const Block& destination, int tier);
  absl::Status FinishPrefetch(Chunk& chunk);
  absl::Status FinishAllPrefetches();
  absl::Status IssuePrefetches();
  absl::Status DropPayload(Chunk& chunk);
  void AddChunkBytes(int tier, int64_t delta);
  void SetPayload(Chunk& chunk, Block block, int tier);
  absl::Status AfterStateChange(Chunk& chunk);
  absl::Status Transition(TensorInfo& tensor, TensorState to);

  ChunkManagerOptions options_;
  std::vector<TierSlot> tiers_;
  MemoryTracer tracer_;

  std::vector<TensorSpec> specs_;
  std::vector<TensorInfo> tensors_;
  absl::flat_hash_map<std::string, TensorId> tensor_by_name_;
  std::vector<Chunk> chunks_;
  LayoutPlan plan_;
  uint64_t layout_hash_ = 0;
  bool built_ = false;

  absl::flat_hash_set<ChunkId> released_groups_;  // first chunk of each released group
  // Note [Compute chunks re-made from the master]: local compute chunk -> its master chunk,
  // compute tensor -> its master tensor, and the conversion.
  absl::flat_hash_map<ChunkId, ChunkId> remake_sources_;
  absl::flat_hash_map<TensorId, TensorId> master_of_;
  CastToCompute cast_ = nullptr;
  int64_t remakes_ = 0;
  int64_t lru_clock_ = 0;
  std::vector<EvictionRecord> eviction_log_;

  // Profiling: a tier sample when a moment closes (no-op unless the log is enabled).
  void RecordMoment(bool end_of_iteration);
  EventLog events_{&tracer_};
};

}  // namespace ps
