// DiLoCo's outer loop (see diloco.h).
#include "model/diloco.h"

#include <algorithm>
#include <cmath>

namespace geotrain::model {

int64_t DilocoSchedule::Offset(int fragment) const {
  return static_cast<int64_t>(fragment + 1) * inner_steps / std::max(1, fragments);
}

std::vector<int> DilocoSchedule::DueAfter(int64_t step) const {
  std::vector<int> out;
  for (int f = 0; f < fragments; ++f) {
    const int64_t off = Offset(f);
    if (step >= off && (step - off) % inner_steps == 0) out.push_back(f);
  }
  return out;
}

std::vector<int> DilocoSchedule::StartAtBeginning(int64_t step) const {
  if (!overlapped() || step < 2 || step > total_steps) return {};
  return DueAfter(step - 1);
}

std::vector<int> DilocoSchedule::BlockingAfter(int64_t step) const {
  if (step == total_steps) {
    std::vector<int> all(fragments);
    for (int f = 0; f < fragments; ++f) all[f] = f;
    return all;
  }
  if (overlapped()) return {};
  return DueAfter(step);
}

int DilocoSchedule::PeriodLength(int64_t step) const {
  const int64_t start = PeriodStart(step);
  return static_cast<int>(std::min<int64_t>(inner_steps, total_steps - start + 1));
}

std::vector<int> PlanPacedPeriod(const std::vector<double>& step_seconds, int period_steps, int max_factor) {
  std::vector<int> out(step_seconds.size(), period_steps);
  double slowest = 0;
  for (double t : step_seconds) {
    if (!(t > 0) || !std::isfinite(t)) return out;
    slowest = std::max(slowest, t);
  }
  for (size_t g = 0; g < step_seconds.size(); ++g) {
    const double fit = std::floor(period_steps * slowest / step_seconds[g]);
    out[g] = static_cast<int>(
        std::clamp(fit, static_cast<double>(period_steps), static_cast<double>(period_steps) * max_factor));
  }
  return out;
}

int PacedInnerSteps(int inner, int period_steps, int j) {
  const int64_t n = inner, l = std::max(1, period_steps);
  return static_cast<int>((j + 1) * n / l - j * n / l);
}

std::vector<int> DilocoGroups(const std::vector<std::string>& replica_sites) {
  std::vector<int> out;
  std::vector<std::string> seen;
  for (const std::string& site : replica_sites) {
    auto it = std::find(seen.begin(), seen.end(), site);
    out.push_back(static_cast<int>(it - seen.begin()));
    if (it == seen.end()) seen.push_back(site);
  }
  if (out.empty()) out.push_back(0);
  return out;
}

int FragmentOfBlock(int block, int n_layer, int fragments) {
  return std::clamp(static_cast<int>(static_cast<int64_t>(block) * fragments / std::max(1, n_layer)), 0, fragments - 1);
}

std::vector<std::vector<ParamRange>> FragmentRanges(GPT2Stage& stage, int fragments) {
  std::vector<std::vector<ParamRange>> out(std::max(1, fragments));
  const float* base = stage.grads();
  auto add = [&](int f, absl::Span<float> span) {
    if (span.empty()) return;
    std::vector<ParamRange>& ranges = out[f];
    const int64_t offset = span.data() - base;
    const int64_t count = static_cast<int64_t>(span.size());
    if (!ranges.empty() && ranges.back().offset + ranges.back().count == offset) {
      ranges.back().count += count;  // adjacent: merge
    } else {
      ranges.push_back({offset, count});
    }
  };
  const ParameterTensors& g = stage.grad_tensors();
  for (absl::Span<float> span : stage.NonLayerGradientSpans()) {
    const bool final_norm = span.data() == g.lnfw || span.data() == g.lnfb;
    add(final_norm ? static_cast<int>(out.size()) - 1 : 0, span);
  }
  for (int l = 0; l < stage.num_layers(); ++l) {
    const int f = FragmentOfBlock(stage.first_layer() + l, stage.config().n_layer, static_cast<int>(out.size()));
    for (absl::Span<float> span : stage.LayerGradientSpans(l)) add(f, span);
  }
  for (std::vector<ParamRange>& ranges : out) {
    std::sort(ranges.begin(), ranges.end(),
              [](const ParamRange& a, const ParamRange& b) { return a.offset < b.offset; });
  }
  return out;
}

OuterOptimizer::OuterOptimizer(std::vector<std::vector<ParamRange>> fragments, int64_t num_params, OuterOptions options)
    : fragments_(std::move(fragments)),
      options_(options),
      outer_(static_cast<size_t>(num_params)),
      momentum_(static_cast<size_t>(num_params)) {}

int64_t OuterOptimizer::FragmentSize(int f) const {
  int64_t n = 0;
  for (const ParamRange& r : fragments_[f]) n += r.count;
  return n;
}

void OuterOptimizer::Initialize(const float* params) {
  std::copy(params, params + outer_.size(), outer_.begin());
  std::fill(momentum_.begin(), momentum_.end(), 0.0f);
}

void OuterOptimizer::PseudoGradient(int f, const float* params, std::vector<float>* delta) const {
  delta->resize(static_cast<size_t>(FragmentSize(f)));
  float* out = delta->data();
  for (const ParamRange& r : fragments_[f]) {
    for (int64_t i = 0; i < r.count; ++i) *out++ = outer_[r.offset + i] - params[r.offset + i];
  }
}

void OuterOptimizer::Pack(int f, const float* params, std::vector<float>* out) const {
  PackRanges(fragments_[f], params, out);
}

void PackRanges(const std::vector<ParamRange>& ranges, const float* from, std::vector<float>* out) {
  int64_t n = 0;
  for (const ParamRange& r : ranges) n += r.count;
  out->resize(static_cast<size_t>(n));
  float* o = out->data();
  for (const ParamRange& r : ranges) o = std::copy(from + r.offset, from + r.offset + r.count, o);
}

void UnpackRanges(const std::vector<ParamRange>& ranges, const float* packed, float* to) {
  for (const ParamRange& r : ranges) {
    std::copy(packed, packed + r.count, to + r.offset);
    packed += r.count;
  }
}

ReplicatedSplit SplitReplicated(const GPT2Stage& stage, const std::vector<ParamRange>& ranges) {
  ReplicatedSplit split;
  int64_t packed = 0;
  for (const ParamRange& r : ranges) {
    int64_t at = r.offset;  // the next element of r not yet assigned
    for (const ParameterSegment& seg : stage.segments()) {
      const int64_t lo = std::max(r.offset, seg.offset), hi = std::min(r.offset + r.count, seg.offset + seg.count);
      if (!seg.replicated || lo >= hi) continue;
      if (lo > at) split.rest.push_back({packed + at - r.offset, lo - at});
      split.replicated.push_back({packed + lo - r.offset, hi - lo});
      split.replicated_count += hi - lo;
      at = hi;
    }
    if (at < r.offset + r.count) split.rest.push_back({packed + at - r.offset, r.offset + r.count - at});
    packed += r.count;
  }
  return split;
}

void OuterOptimizer::Step(int f, const float* delta) {
  const float lr = static_cast<float>(options_.lr), mu = static_cast<float>(options_.momentum);
  for (const ParamRange& r : fragments_[f]) {
    float* theta = outer_.data() + r.offset;
    float* v = momentum_.data() + r.offset;
    for (int64_t i = 0; i < r.count; ++i) {
      const float d = *delta++;
      v[i] = mu * v[i] + d;
      const float u = options_.nesterov ? d + mu * v[i] : v[i];
      theta[i] -= lr * u;
    }
  }
}

void OuterOptimizer::Apply(int f, float* params, const float* snapshot) const {
  for (const ParamRange& r : fragments_[f]) {
    for (int64_t i = 0; i < r.count; ++i) {
      float& p = params[r.offset + i];
      p = snapshot != nullptr ? outer_[r.offset + i] + (p - *snapshot++) : outer_[r.offset + i];
    }
  }
}

}  // namespace geotrain::model
