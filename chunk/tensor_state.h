// The state machine of a tensor packed in a chunk.
//
// Note [Tensor state machine]
// A tensor's state says whether its bytes are in use, meaningful, or gone:
//   FREE            never written, or its contents were dropped; the chunk zero-fills on access
//   COMPUTE         an operator is using it: its chunk is pinned where it was accessed
//   HOLD            holds data, not in use (after initialization or an optimizer step)
//   HOLD_AFTER_FWD  holds data, used by this iteration's forward pass
//   HOLD_AFTER_BWD  holds data, used by this iteration's backward pass
//   RELEASED        the data lives on its owner rank only; it must be gathered before use
//                   (a gather brings it back to HOLD, or an access to COMPUTE)
// Only the transitions in kLegalTransitions exist; everything else (self-transitions included)
// is a FailedPrecondition naming the tensor and both states. COMPUTE is entered only through
// ChunkManager::Access and left only through ChunkManager::Release, because entering it pins the
// chunk in a tier and leaving it unpins it.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ps {

enum class TensorState : uint8_t {
  kFree = 0,
  kCompute = 1,
  kHold = 2,
  kHoldAfterFwd = 3,
  kHoldAfterBwd = 4,
  kReleased = 5,
};

inline constexpr int kNumTensorStates = 6;
inline constexpr std::array<TensorState, kNumTensorStates> kAllTensorStates = {
    TensorState::kFree,         TensorState::kCompute,      TensorState::kHold,
    TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd, TensorState::kReleased};

absl::string_view TensorStateName(TensorState state);  // "FREE", "COMPUTE", ...

// Whether `from -> to` is one of the legal transitions of Note [Tensor state machine].
bool IsLegalTransition(TensorState from, TensorState to);

// OkStatus for a legal transition; otherwise FailedPrecondition naming `tensor_name` and both
// states, and listing the states `from` may go to.
absl::Status CheckTransition(absl::string_view tensor_name, TensorState from, TensorState to);

// Whether a tensor in this state holds meaningful bytes in its chunk's payload.
constexpr bool HoldsData(TensorState state) {
  return state != TensorState::kFree && state != TensorState::kReleased;
}

}  // namespace ps
