// A simulated training loop (forward over N layers, backward in reverse, an optimizer sweep)
// under device budgets from generous down to the minimum feasible: it always completes, keeps
// every byte, never exceeds a budget at any step, and below the largest working set fails with
// ResourceExhausted naming the numbers.
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunk/chunk_manager.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/status.h"
#include "tests/cpp/chunk_test_util.h"

namespace ps {
namespace {

using ::ps::testing::Spec;

constexpr int kLayers = 6;
constexpr int64_t kChunkElements = 8192;  // 16 KiB fp16 compute chunks, 32 KiB fp32 state
constexpr int64_t kSlabBytes = 16 << 10;
constexpr int kIterations = 3;

// Activations grow through forward and shrink through backward.
int64_t Activations(int layer) { return (layer + 1) * (16 << 10); }

struct Param {
  std::string name;
  TensorId compute, master, momentum, variance;
};

struct Scenario {
  int prefetch_moments = 0;
  bool nvme = false;  // a small host budget pushes state on to NVMe
};

class TrainingLoop {
 public:
  TrainingLoop(int64_t device_budget, const Scenario& scenario, testing::TempDir* nvme_dir)
      : device_budget_(device_budget),
        host_budget_(scenario.nvme ? 6 * (32 << 10) : 0),
        hierarchy_(testing::MakeHierarchy(device_budget, host_budget_, kSlabBytes,
                                          scenario.nvme ? &nvme_dir->path() : nullptr)) {
    ChunkManagerOptions options;
    options.prefetch_moments = scenario.prefetch_moments;
    manager_ = testing::MakeManager(hierarchy_, options);
    for (int layer = 0; layer < kLayers; ++layer) {
      for (const char* part : {"weight", "bias"}) {
        std::vector<int64_t> shape =
            std::string(part) == "weight" ? std::vector<int64_t>{64, 64} : std::vector<int64_t>{64};
        const std::string name = absl::StrCat("layer", layer, ".", part);
        Param param{name, Register(name, shape, ChunkKind::kComputeParam, DType::kFloat16),
                    Register(name + ".master", shape, ChunkKind::kMasterParam, DType::kFloat32),
                    Register(name + ".momentum", shape, ChunkKind::kMomentum, DType::kFloat32),
                    Register(name + ".variance", shape, ChunkKind::kVariance, DType::kFloat32)};
        params_.push_back(param);
      }
    }
    auto report = manager_->BuildChunkLists(kChunkElements);
    EXPECT_TRUE(report.ok()) << report.status();
  }

  // Runs the loop; returns the first error. `largest_working_set` gets the peak over steps of
  // (bytes of the chunks in COMPUTE together) + non-model bytes.
  absl::Status Run() {
    for (int iteration = 0; iteration < kIterations; ++iteration) {
      for (int layer = 0; layer < kLayers; ++layer) {
        PS_RETURN_IF_ERROR(Step(Activations(layer), LayerTensors(layer), TensorState::kHoldAfterFwd,
                                iteration, /*update=*/false));
      }
      for (int layer = kLayers - 1; layer >= 0; --layer) {
        PS_RETURN_IF_ERROR(Step(Activations(layer), LayerTensors(layer), TensorState::kHoldAfterBwd,
                                iteration, /*update=*/false));
      }
      for (const Param& param : params_) {
        PS_RETURN_IF_ERROR(Step(0, {param.compute, param.master, param.momentum, param.variance},
                                TensorState::kHold, iteration, /*update=*/true));
      }
      PS_RETURN_IF_ERROR(manager_->EndIteration());
      CheckBudgets("end of iteration");
    }
    return absl::OkStatus();
  }

  int64_t largest_working_set() const { return largest_working_set_; }
  int64_t failed_step_working_set() const { return current_working_set_; }
  const ChunkManager& manager() const { return *manager_; }

 private:
  TensorId Register(const std::string& name, std::vector<int64_t> shape, ChunkKind kind,
                    DType dtype) {
    auto id = manager_->RegisterTensor(Spec(name, std::move(shape), kind, dtype));
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : -1;
  }

  std::vector<TensorId> LayerTensors(int layer) const {
    return {params_[2 * layer].compute, params_[2 * layer + 1].compute};
  }

  // Every tier's reservation plus its non-model data fits its budget, and the manager's chunk
  // bytes fit the reservation.
  void CheckBudgets(const std::string& where) {
    const std::vector<TierChunkStats> stats = manager_->Stats();
    for (int tier = 0; tier < manager_->num_tiers(); ++tier) {
      const int64_t budget = tier == 0 ? device_budget_ : tier == 1 ? host_budget_ : 0;
      const TierStats raw = manager_->tier(tier).stats();
      EXPECT_LE(stats[tier].chunk_bytes, raw.reserved_bytes) << where;
      if (budget == 0) continue;
      const int64_t non_model = tier == 0 ? reported_device_non_model_ : 0;
      EXPECT_LE(raw.reserved_bytes + non_model, budget)
          << where << ": tier " << stats[tier].name << " over budget";
      EXPECT_LE(raw.peak_reserved_bytes, budget) << where;
    }
  }

  absl::Status Step(int64_t non_model, const std::vector<TensorId>& tensors, TensorState after,
                    int iteration, bool update) {
    const std::string where =
        absl::StrCat("iteration ", iteration, " moment ", manager_->tracer().moment());
    PS_RETURN_IF_ERROR(manager_->Tick());
    CheckBudgets(where + " after tick");
    std::set<ChunkId> chunks;
    for (TensorId t : tensors) chunks.insert((*manager_->tensor(t))->chunk);
    current_working_set_ = non_model;
    for (ChunkId c : chunks) current_working_set_ += (*manager_->chunk(c))->bytes();
    largest_working_set_ = std::max(largest_working_set_, current_working_set_);

    PS_RETURN_IF_ERROR(manager_->ReportNonModelData(TierKind::kDevice, non_model));
    reported_device_non_model_ = non_model;
    CheckBudgets(where + " after report");
    std::vector<TensorView> views;
    for (TensorId t : tensors) {
      PS_ASSIGN_OR_RETURN(TensorView view, manager_->Access(t, TierKind::kDevice));
      CheckBudgets(where + " after access");
      views.push_back(view);
    }
    // Every tensor's first element counts the optimizer steps applied to it so far, so a byte
    // lost or misplaced in any move shows up here.
    const int expected = iteration;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorInfo& info = **manager_->tensor(tensors[i]);
      const int64_t value =
          info.dtype == DType::kFloat16
              ? *static_cast<const uint16_t*>(testing::ComputePointer(views[i]))
              : static_cast<int64_t>(*static_cast<const float*>(testing::ComputePointer(views[i])));
      EXPECT_EQ(value, expected) << info.name << " at " << where;
      const int64_t last = info.numel - 1;
      const int64_t tail =
          info.dtype == DType::kFloat16
              ? static_cast<const uint16_t*>(testing::ComputePointer(views[i]))[last]
              : static_cast<int64_t>(
                    static_cast<const float*>(testing::ComputePointer(views[i]))[last]);
      EXPECT_EQ(tail, expected) << info.name << " (last element) at " << where;
      if (update) {
        if (info.dtype == DType::kFloat16) {
          static_cast<uint16_t*>(testing::ComputePointer(views[i]))[0] += 1;
          static_cast<uint16_t*>(testing::ComputePointer(views[i]))[last] += 1;
        } else {
          static_cast<float*>(testing::ComputePointer(views[i]))[0] += 1;
          static_cast<float*>(testing::ComputePointer(views[i]))[last] += 1;
        }
      }
    }
    for (TensorId t : tensors) {
      PS_RETURN_IF_ERROR(manager_->Release(t, after));
      CheckBudgets(where + " after release");
    }
    return absl::OkStatus();
  }

  int64_t device_budget_;
  int64_t host_budget_;
  testing::Hierarchy hierarchy_;
  std::unique_ptr<ChunkManager> manager_;
  std::vector<Param> params_;
  int64_t reported_device_non_model_ = 0;
  int64_t largest_working_set_ = 0;
  int64_t current_working_set_ = 0;
};

class ChunkTrainingTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(ChunkTrainingTest, CompletesWithinEveryFeasibleBudgetAndFailsBelowIt) {
  testing::TempDir nvme_dir;
  // Unlimited device: measures the largest working set.
  TrainingLoop unlimited(0, GetParam(), &nvme_dir);
  ASSERT_TRUE(unlimited.Run().ok());
  const int64_t working_set = unlimited.largest_working_set();
  // The last layer's two chunks (32 KiB) with its 96 KiB of activations.
  EXPECT_EQ(working_set, 128 << 10);
  const int64_t model_bytes = 4 * (16 << 10) + 12 * (32 << 10);

  for (int64_t budget : {model_bytes + Activations(kLayers - 1), int64_t{320} << 10,
                         int64_t{224} << 10, int64_t{176} << 10, int64_t{144} << 10, working_set}) {
    SCOPED_TRACE(absl::StrCat("device budget ", budget));
    TrainingLoop loop(budget, GetParam(), &nvme_dir);
    absl::Status status = loop.Run();
    ASSERT_TRUE(status.ok()) << status;
    const std::vector<TierChunkStats> stats = loop.manager().Stats();
    EXPECT_LE(stats[0].peak_chunk_bytes, budget);
    if (budget < model_bytes) {
      EXPECT_GT(stats[0].evictions, 0);
    }
    if (GetParam().nvme && budget + 6 * (32 << 10) < model_bytes) {
      EXPECT_GT(stats[2].bytes_in, 0) << "device and host cannot hold the model together";
    }
  }

  const int64_t too_small = working_set - 4096;
  TrainingLoop starved(too_small, GetParam(), &nvme_dir);
  absl::Status status = starved.Run();
  ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), ::testing::HasSubstr(absl::StrCat("budget ", too_small, " bytes")));
  EXPECT_THAT(status.message(), ::testing::HasSubstr("'device'"));
  EXPECT_GT(starved.failed_step_working_set(), too_small)
      << "failed at a step that should have fit: " << status;
}

TEST(ChunkTrainingPrefetchTest, PrefetchHitsAfterWarmupAndStaysWithinBudget) {
  testing::TempDir nvme_dir;
  TrainingLoop loop(int64_t{224} << 10, Scenario{/*prefetch_moments=*/2, /*nvme=*/false},
                    &nvme_dir);
  ASSERT_TRUE(loop.Run().ok());
  const TierChunkStats device = loop.manager().Stats()[0];
  TrainingLoop without(int64_t{224} << 10, Scenario{0, false}, &nvme_dir);
  ASSERT_TRUE(without.Run().ok());
  const TierChunkStats baseline = without.manager().Stats()[0];
  // Prefetching never evicts, so here it only turns synchronous copies into early ones: the
  // accesses that needed data moved are the same, and fewer of them waited for a copy.
  EXPECT_EQ(baseline.prefetch_hits, 0);
  EXPECT_LT(device.prefetch_misses, baseline.prefetch_misses);
  EXPECT_EQ(device.prefetch_hits + device.prefetch_misses, baseline.prefetch_misses);
  EXPECT_GT(device.prefetch_issued, 0);
  EXPECT_GT(device.prefetch_hits, 0);
  EXPECT_LE(device.prefetch_hits, device.prefetch_issued);
  const nlohmann::json dump = nlohmann::json::parse(loop.manager().DumpJson());
  EXPECT_EQ(dump["tiers"][0]["prefetch_hits"], device.prefetch_hits);
  EXPECT_EQ(dump["tracer"]["warming_up"], false);
  EXPECT_EQ(dump["layout"]["chunks"].size(), 16u);
  EXPECT_FALSE(dump["tracer"]["accesses"].empty());
  // The trace recorded the activations the loop reported at the last forward layer.
  int64_t peak_non_model = 0;
  for (const auto& moment : dump["tracer"]["moments"]) {
    peak_non_model = std::max<int64_t>(peak_non_model, moment["non_model_bytes"][0]);
  }
  EXPECT_EQ(peak_non_model, Activations(kLayers - 1));
}

INSTANTIATE_TEST_SUITE_P(Scenarios, ChunkTrainingTest,
                         ::testing::Values(Scenario{0, false}, Scenario{2, false},
                                           Scenario{0, true}, Scenario{3, true}),
                         [](const ::testing::TestParamInfo<Scenario>& info) {
                           return absl::StrCat("prefetch", info.param.prefetch_moments,
                                               info.param.nvme ? "_nvme" : "_host");
                         });

}  // namespace
}  // namespace ps
