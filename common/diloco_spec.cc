// The diloco block's defaults (see diloco_spec.h).
#include "common/diloco_spec.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "common/codec_spec.h"

namespace geotrain {
namespace {

// codec sparse: its settings into its name (and the block's absent fields from the name; see EffectiveDiloco).
void FillSparse(DilocoSpec* d) {
  absl::StatusOr<CodecSpec> codec = ParseCodecSpec(d->codec());
  if (!codec.ok() || codec->kind != CodecKind::kSparse) return;  // validation names a bad codec
  std::string base = absl::AsciiStrToLower(d->codec());
  absl::StripAsciiWhitespace(&base);
  const bool named = base.rfind("sparse:", 0) == 0;  // "sparse:F[:B]": the name gives its settings
  DilocoSparseSpec* s = d->mutable_sparse();
  if (!named) {
    if (s->has_fraction()) codec->sparse_fraction = s->fraction();
    if (s->has_bits()) codec->sparse_bits = s->bits();
  }
  if (!s->has_fraction()) s->set_fraction(codec->sparse_fraction);
  if (!s->has_bits()) s->set_bits(codec->sparse_bits);
  d->set_codec(codec->ToString());
}

}  // namespace

bool DilocoOn(const JobSpec& spec) {
  const std::string& sync = spec.parallel().sync();
  return sync == "diloco" || (sync.empty() && spec.diloco().inner_steps() > 0);
}

double DilocoInnerLrScale(const JobSpec& spec, int groups) {
  if (!DilocoOn(spec)) return 1.0;
  if (spec.diloco().has_inner_lr_scale()) return spec.diloco().inner_lr_scale();
  return std::sqrt(static_cast<double>(std::max(1, groups)));
}

bool DilocoTimePaced(const JobSpec& spec) { return DilocoOn(spec) && spec.diloco().sync() == "time"; }

DilocoSpec EffectiveDiloco(const JobSpec& spec) {
  DilocoSpec d = spec.diloco();
  if (d.inner_steps() <= 0) d.set_inner_steps(32);
  if (d.outer_lr() == 0) d.set_outer_lr(0.7);
  if (!d.has_outer_momentum()) d.set_outer_momentum(0.9);
  if (!d.has_nesterov()) d.set_nesterov(true);
  if (d.codec().empty()) d.set_codec("int8");
  if (d.fragments() <= 0) d.set_fragments(1);
  if (d.sync().empty()) d.set_sync("steps");
  FillSparse(&d);
  return d;
}

}  // namespace geotrain
