// Dynamic loss scaling (see loss_scaler.h).
#include "model/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace geotrain::model {
namespace {
constexpr double kMinScale = 1.0 / 16777216.0;  // 2^-24: fp16's smallest subnormal
}  // namespace

LossScaler::LossScaler(LossScaleOptions options) : options_(options) {
  state_.scale = options_.enabled ? options_.initial : 1.0;
  applied_ = state_.scale;
}

bool LossScaler::Update(bool finite) {
  applied_ = state_.scale;
  if (!options_.enabled) return true;
  if (!finite) {
    state_.scale = std::max(kMinScale, state_.scale / 2);
    state_.clean_steps = 0;
    ++state_.skipped;
    return false;
  }
  if (++state_.clean_steps >= options_.growth_interval) {
    // fp32 holds the scale; past 2^64 no fp16 gradient needs more.
    state_.scale = std::min(state_.scale * 2, 18446744073709551616.0);
    state_.clean_steps = 0;
  }
  return true;
}

absl::Status LossScaler::Restore(const LossScaleState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.clean_steps < 0 || state.skipped < 0) {
    return absl::InvalidArgumentError(absl::StrCat("loss scale state (scale ", state.scale, ", clean steps ",
                                                   state.clean_steps, ", skipped ", state.skipped,
                                                   ") is not valid: the scale must be a positive finite number"));
  }
  state_ = state;
  if (!options_.enabled) state_.scale = 1;
  applied_ = state_.scale;
  return absl::OkStatus();
}

}  // namespace geotrain::model
