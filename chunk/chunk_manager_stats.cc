// ChunkManager: per-tier statistics, JSON dumps and profiling samples.
#include "chunk/chunk_manager.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace ps {

// ---- Statistics ------------------------------------------------------------------------------

std::vector<TierChunkStats> ChunkManager::Stats() const {
  std::vector<TierChunkStats> result;
  for (int tier = 0; tier < num_tiers(); ++tier) {
    TierChunkStats stats = tiers_[tier].stats;
    stats.chunk_bytes = tiers_[tier].chunk_bytes;
    stats.non_model_bytes = tracer_.NonModelBytes(tier);
    stats.reserved_bytes = tiers_[tier].tier->stats().reserved_bytes;
    result.push_back(std::move(stats));
  }
  return result;
}

void ChunkManager::ResetPeakStats() {
  for (TierSlot& slot : tiers_) slot.stats.peak_chunk_bytes = slot.chunk_bytes;
  peak_total_chunk_bytes_ = total_chunk_bytes_;
}

nlohmann::json ChunkManager::TierStatsJson() const {
  nlohmann::json tiers = nlohmann::json::array();
  for (const TierChunkStats& stats : Stats()) {
    tiers.push_back({{"name", stats.name},
                     {"kind", std::string(TierKindName(stats.kind))},
                     {"budget_bytes", stats.budget_bytes},
                     {"non_model_bytes", stats.non_model_bytes},
                     {"chunk_bytes", stats.chunk_bytes},
                     {"peak_chunk_bytes", stats.peak_chunk_bytes},
                     {"reserved_bytes", stats.reserved_bytes},
                     {"bytes_in", stats.bytes_in},
                     {"bytes_out", stats.bytes_out},
                     {"chunks_in", stats.chunks_in},
                     {"chunks_out", stats.chunks_out},
                     {"evictions", stats.evictions},
                     {"zero_fills", stats.zero_fills},
                     {"prefetch_issued", stats.prefetch_issued},
                     {"prefetch_hits", stats.prefetch_hits},
                     {"prefetch_misses", stats.prefetch_misses},
                     {"copy_wait_ns", stats.copy_wait_ns}});
  }
  return tiers;
}

nlohmann::json ChunkManager::ChunksJson(bool with_placement) const {
  nlohmann::json chunks = nlohmann::json::array();
  for (const Chunk& chunk : chunks_) {
    nlohmann::json tensors = nlohmann::json::array();
    for (TensorId id : chunk.tensors_) {
      const TensorInfo& tensor = tensors_[id];
      nlohmann::json entry = {{"id", id},
                              {"name", tensor.name},
                              {"offset", tensor.offset},
                              {"numel", tensor.numel},
                              {"shape", tensor.shape}};
      if (with_placement) entry["state"] = std::string(TensorStateName(tensor.state));
      tensors.push_back(std::move(entry));
    }
    nlohmann::json entry = {{"id", chunk.id_},
                            {"kind", std::string(ChunkKindName(chunk.kind_))},
                            {"dtype", std::string(DTypeName(chunk.dtype_))},
                            {"capacity_elements", chunk.capacity_elements_},
                            {"bytes", chunk.bytes()},
                            {"owner_rank", chunk.owner_rank_},
                            {"group", chunk.group_},
                            {"oversize", chunk.oversize_},
                            {"padding", chunk.padding_}};
    if (with_placement) {
      entry["tier"] = chunk.tier_index_ < 0 ? nlohmann::json(nullptr)
                                            : nlohmann::json(tiers_[chunk.tier_index_].stats.name);
    }
    entry["tensors"] = std::move(tensors);
    chunks.push_back(std::move(entry));
  }
  return chunks;
}

nlohmann::json ChunkManager::LayoutJson() const {
  return {{"world_size", options_.world_size},
          {"rank", options_.rank},
          {"hash", absl::StrFormat("%016x", layout_hash_)},
          {"chunks", ChunksJson(/*with_placement=*/false)}};
}

nlohmann::json ChunkManager::ToJson() const {
  nlohmann::json chunks = ChunksJson(/*with_placement=*/true);
  nlohmann::json tiers = TierStatsJson();
  nlohmann::json evictions = nlohmann::json::array();
  for (const EvictionRecord& record : eviction_log_) {
    evictions.push_back({{"iteration", record.iteration},
                         {"moment", record.moment},
                         {"position", record.position},
                         {"chunk", record.chunk},
                         {"from_tier", record.from_tier},
                         {"to_tier", record.to_tier}});
  }
  std::vector<std::string> oversize;
  for (int64_t index : plan_.oversize_tensors) oversize.push_back(specs_[index].name);
  return {{"world_size", options_.world_size},
          {"rank", options_.rank},
          {"eviction_policy", options_.eviction_policy == EvictionPolicy::kLru ? "lru" : "opt"},
          {"prefetch_moments", options_.prefetch_moments},
          {"layout",
           {{"built", built_},
            {"chunk_elements", plan_.chunk_elements},
            {"wasted_bytes", plan_.wasted_bytes},
            {"hash", absl::StrFormat("%016x", layout_hash_)},
            {"oversize_tensors", oversize},
            {"chunks", chunks}}},
          {"tiers", tiers},
          {"evictions", evictions},
          {"tracer", tracer_.ToJson()}};
}

std::string ChunkManager::DumpJson(int indent) const { return ToJson().dump(indent); }

// ---- Profiling -------------------------------------------------------------------------------

void ChunkManager::RecordMoment(bool end_of_iteration) {
  if (!events_.enabled()) return;
  std::vector<TierSample> samples;
  for (int tier = 0; tier < num_tiers(); ++tier) {
    samples.push_back(TierSample{tiers_[tier].chunk_bytes, tracer_.NonModelBytes(tier),
                                 tiers_[tier].budget_bytes});
  }
  events_.Moment(end_of_iteration, samples);
}

}  // namespace ps
