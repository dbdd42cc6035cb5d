// The diloco block's defaults (see diloco_spec.h).
#include "common/diloco_spec.h"

namespace geotrain {

bool DilocoOn(const JobSpec& spec) {
  const std::string& sync = spec.parallel().sync();
  return sync == "diloco" || (sync.empty() && spec.diloco().inner_steps() > 0);
}

DilocoSpec EffectiveDiloco(const JobSpec& spec) {
  DilocoSpec d = spec.diloco();
  if (d.inner_steps() <= 0) d.set_inner_steps(32);
  if (d.outer_lr() == 0) d.set_outer_lr(0.7);
  if (!d.has_outer_momentum()) d.set_outer_momentum(0.9);
  if (!d.has_nesterov()) d.set_nesterov(true);
  if (d.codec().empty()) d.set_codec("int8");
  if (d.fragments() <= 0) d.set_fragments(1);
  if (!d.has_inner_lr_scale()) d.set_inner_lr_scale(1.0);
  return d;
}

}  // namespace geotrain
