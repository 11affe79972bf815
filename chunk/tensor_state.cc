#include "chunk/tensor_state.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace ps {
namespace {

struct Transition {
  TensorState from;
  TensorState to;
};

// Note [Tensor state machine] explains each state; this table is the whole machine.
constexpr Transition kLegalTransitions[] = {
    {TensorState::kFree, TensorState::kCompute},
    {TensorState::kCompute, TensorState::kHold},
    {TensorState::kCompute, TensorState::kHoldAfterFwd},
    {TensorState::kCompute, TensorState::kHoldAfterBwd},
    {TensorState::kCompute, TensorState::kFree},
    {TensorState::kHold, TensorState::kCompute},
    {TensorState::kHold, TensorState::kFree},
    {TensorState::kHold, TensorState::kReleased},
    {TensorState::kHoldAfterFwd, TensorState::kCompute},
    {TensorState::kHoldAfterFwd, TensorState::kHold},
    {TensorState::kHoldAfterFwd, TensorState::kFree},
    {TensorState::kHoldAfterFwd, TensorState::kReleased},
    {TensorState::kHoldAfterBwd, TensorState::kCompute},
    {TensorState::kHoldAfterBwd, TensorState::kHold},
    {TensorState::kHoldAfterBwd, TensorState::kFree},
    {TensorState::kHoldAfterBwd, TensorState::kReleased},
    {TensorState::kReleased, TensorState::kCompute},
    {TensorState::kReleased, TensorState::kHold},
    {TensorState::kReleased, TensorState::kFree},
};

}  // namespace

absl::string_view TensorStateName(TensorState state) {
  switch (state) {
    case TensorState::kFree:
      return "FREE";
    case TensorState::kCompute:
      return "COMPUTE";
    case TensorState::kHold:
      return "HOLD";
    case TensorState::kHoldAfterFwd:
      return "HOLD_AFTER_FWD";
    case TensorState::kHoldAfterBwd:
      return "HOLD_AFTER_BWD";
    case TensorState::kReleased:
      return "RELEASED";
  }
  return "UNKNOWN";
}

bool IsLegalTransition(TensorState from, TensorState to) {
  for (const Transition& transition : kLegalTransitions) {
    if (transition.from == from && transition.to == to) return true;
  }
  return false;
}

absl::Status CheckTransition(absl::string_view tensor_name, TensorState from, TensorState to) {
  if (IsLegalTransition(from, to)) return absl::OkStatus();
  std::string allowed;
  for (const Transition& transition : kLegalTransitions) {
    if (transition.from != from) continue;
    absl::StrAppend(&allowed, allowed.empty() ? "" : ", ", TensorStateName(transition.to));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "tensor '", tensor_name, "': illegal state transition ", TensorStateName(from), " -> ",
      TensorStateName(to), " (from ", TensorStateName(from), " it may go to ", allowed, ")"));
}

}  // namespace ps
