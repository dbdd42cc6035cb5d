// The job runner's checkpoint committer: shards gathered by step, manifests written last (see
// checkpoint_committer.h).
#include "head/checkpoint_committer.h"

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/diloco_spec.h"
#include "model/checkpoint_files.h"
#include "model/config.h"

namespace geotrain::head {
namespace {

// The step's manifest: the model, the plan, and every shard's files, in group and stage order: the first stage's
// data position and optimizer step (of each DiLoCo group's first stage for groups > 0); a tied tensor (wte) from the first stage that holds it. The tensors map names
// group 0's files; DiLoCo groups > 0 hold the same tensors in files of their own (model::GroupFileFor).
// `snapshot` and `write` get the slowest shard's times.
CheckpointManifest Manifest(const std::string& job_id, const JobSpec& spec, const GPT2Config& config, int64_t step,
                            int64_t created_unix_ms, const std::map<std::string, CheckpointShard>& shards,
                            double* snapshot, double* write) {
  CheckpointManifest manifest;
  manifest.set_format(model::kCheckpointFormat);
  manifest.set_step(step);
  manifest.mutable_model()->set_n_layer(config.n_layer);
  manifest.mutable_model()->set_n_head(config.n_head);
  manifest.mutable_model()->set_n_embd(config.n_embd);
  manifest.mutable_model()->set_block_size(config.block_size);
  manifest.mutable_model()->set_vocab_size(config.vocab_size);
  manifest.set_job(job_id);
  manifest.set_plan(
      absl::StrFormat("dp %d x pp %d x tp %d", spec.parallel().dp(), spec.parallel().pp(), spec.parallel().tp()));
  manifest.set_created_unix_ms(created_unix_ms);
  std::vector<const CheckpointShard*> by_stage;
  int groups = 0;
  for (const auto& [actor, shard] : shards) {
    by_stage.push_back(&shard);
    groups = std::max(groups, shard.group() + 1);
  }
  std::sort(by_stage.begin(), by_stage.end(), [](const CheckpointShard* a, const CheckpointShard* b) {
    return std::pair(a->group(), a->stage()) < std::pair(b->group(), b->stage());
  });
  if (DilocoOn(spec)) manifest.set_diloco_groups(groups);
  for (const CheckpointShard* shard : by_stage) {
    if (shard == by_stage.front()) {
      *manifest.mutable_data_position() = shard->data_position();
      manifest.set_optimizer_step(shard->optimizer_step());
    } else if (shard->group() > 0 && !manifest.group_optimizer_step().contains(shard->group())) {
      // The group's first stage (shards are in group and stage order): its own position and step.
      (*manifest.mutable_group_data_position())[shard->group()] = shard->data_position();
      (*manifest.mutable_group_optimizer_step())[shard->group()] = shard->optimizer_step();
    }
    for (const CheckpointFile& f : shard->files()) {
      CheckpointFileEntry& entry = (*manifest.mutable_files())[f.name()];
      entry.set_bytes(f.bytes());
      entry.set_crc32(f.crc32());
      if (!shard->replica_worker().empty()) {  // checkpoint.replicate: a copy at another site
        (*manifest.mutable_replicas())[f.name()] = absl::StrCat(shard->replica_worker(), "@", shard->replica_address());
      }
    }
    if (shard->group() == 0) {
      for (const std::string& t : shard->tensors()) manifest.mutable_tensors()->insert({t, shard->model_file()});
    }
    *snapshot = std::max(*snapshot, shard->snapshot_seconds());
    *write = std::max(*write, shard->write_seconds());
  }
  return manifest;
}

}  // namespace

CheckpointCommitter::CheckpointCommitter(JobManager* jobs, const Clock* clock) : jobs_(jobs), clock_(clock) {}

CheckpointCommitter::Gathered CheckpointCommitter::Gather(JobRun& run, const StepReport& report) {
  Gathered gathered;
  for (const CheckpointShard& shard : report.checkpoints()) {
    // One shard per stage, or with DiLoCo per stage and group.
    const int writers = shard.writers() > 0 ? shard.writers() : run.spec.parallel().pp();
    if (!shard.error().empty()) {
      gathered.failed.push_back(shard);
      run.shards.erase(shard.step());
      continue;
    }
    if (shard.step() <= run.last_checkpoint_step) continue;
    auto& shards = run.shards[shard.step()];
    shards[shard.actor_id()] = shard;
    if (static_cast<int>(shards.size()) == writers) {
      gathered.ready.push_back({shard.step(), shards});
      run.shards.erase(shard.step());
      run.last_checkpoint_step = std::max(run.last_checkpoint_step, shard.step());
    }
  }
  if (report.checkpoints_size() > 0) {
    gathered.persist = true;
    for (const auto& [step, shards] : run.shards) {
      for (const auto& [actor, shard] : shards) gathered.pending.push_back(shard);
    }
  }
  return gathered;
}

void CheckpointCommitter::Commit(const std::string& job_id, const JobSpec& spec, const Gathered& gathered) {
  for (const CheckpointShard& shard : gathered.failed) {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("warning: checkpoint of step ", shard.step(), " abandoned: actor ",
                                                shard.actor_id(), " could not write its shard: ", shard.error(),
                                                "; training goes on, the next checkpoint is tried at its interval")),
                job_id, "logging");
  }
  for (const auto& [step, shards] : gathered.ready) CommitStep(job_id, spec, step, shards);
}

void CheckpointCommitter::CommitStep(const std::string& job_id, const JobSpec& spec, int64_t step,
                                     const std::map<std::string, CheckpointShard>& shards) {
  absl::StatusOr<GPT2Config> config = GPT2Config::FromSpec(spec.model());
  if (!config.ok()) return;
  double snapshot = 0, write = 0;
  const CheckpointManifest manifest =
      Manifest(job_id, spec, *config, step, clock_->UnixMillis(), shards, &snapshot, &write);
  const std::string& dir = spec.checkpoint().dir();
  if (absl::Status s = model::CommitCheckpoint(dir, manifest); !s.ok()) {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("warning: checkpoint of step ", step, " not committed: ", s.message(),
                                                "; training goes on")),
                job_id, "logging");
    return;
  }
  LogIfFailed(
      jobs_->Update(job_id, [&](JobInfo& j) { j.set_last_checkpoint_step(std::max(j.last_checkpoint_step(), step)); })
          .status(),
      job_id, "recording the checkpoint");
  LogIfFailed(jobs_->Log(job_id, absl::StrFormat("checkpoint of step %d complete: %s (snapshot %.3f s on the training "
                                                 "thread, written in the background in %.3f s)",
                                                 step, model::StepDirectory(dir, step), snapshot, write)),
              job_id, "logging");
  if (absl::Status s = model::PruneCheckpoints(dir, model::CheckpointsKept(spec.checkpoint())); !s.ok()) {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("warning: ", s.message())), job_id, "logging");
  }
}

}  // namespace geotrain::head
