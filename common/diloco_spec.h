// The `diloco` block of a job spec (proto/spec.proto DilocoSpec): whether a job trains with DiLoCo and the
// block with its defaults. No gRPC: the planner (scheduler/) and the model's local trainer link it too.
//
//   if (DilocoOn(spec)) { const DilocoSpec d = EffectiveDiloco(spec); ... d.inner_steps() ... d.codec() ... }
//
// Thread safety: pure functions.
#pragma once

#include "spec.pb.h"

namespace geotrain {

// Whether the job trains with DiLoCo: parallel.sync "diloco", or a diloco block that sets inner_steps and no
// parallel.sync "sync".
bool DilocoOn(const JobSpec& spec);
// The diloco block with every default filled in: inner_steps 32, outer_lr 0.7, outer_momentum 0.9, nesterov,
// codec int8, fragments 1, sync steps; inner_lr_scale stays absent (DilocoInnerLrScale: sqrt of the groups). A sparse codec comes out with its settings in its name, which every
// user of the codec parses (ParseCodecSpec): "sparse" (+zstd) takes diloco.sparse's fraction and bits (absent: 0.02
// and 2) and becomes "sparse:F:B"; a name that gives them ("sparse:0.05:4") keeps them, and diloco.sparse's absent
// fields are filled from it (ValidateJobSpec refuses a diloco.sparse that disagrees with it, or one beside another
// codec). Other codecs leave diloco.sparse as it is.
DilocoSpec EffectiveDiloco(const JobSpec& spec);
// The inner AdamW's learning-rate scale of a job whose replicas form `groups` DiLoCo groups: diloco.inner_lr_scale,
// absent sqrt(groups) (each group's AdamW normalises by its part of the batch: docs/diloco.md); 1 without DiLoCo.
double DilocoInnerLrScale(const JobSpec& spec, int groups);
// Whether the job's outer steps are paced by time (diloco.sync time) rather than by a count of inner steps.
bool DilocoTimePaced(const JobSpec& spec);

}  // namespace geotrain
