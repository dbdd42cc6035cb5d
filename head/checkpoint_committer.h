// The job runner's checkpoint committer. Replica 0's actors (with DiLoCo, each group's leader) write their stage's
// shard of a checkpoint into <checkpoint.dir>/step_N/ in the background and report it with a step report; the
// committer gathers the shards of each step, and when every stage's (and group's) shard of a step is in, writes the
// step's manifest and `latest` (model/checkpoint_files.h CommitCheckpoint), so that a checkpoint is complete or
// absent, and prunes to the newest checkpoint.keep. A shard that could not be written abandons that step's
// checkpoint with a warning event; training goes on.
//
//   CheckpointCommitter::Gathered gathered;
//   {  // under JobRuns::mu, the run of the report
//     gathered = CheckpointCommitter::Gather(run, report);
//   }
//   if (gathered.persist) ...record gathered.pending in the job (what a restarted head resumes gathering from)
//   committer.Commit(job_id, spec, gathered);
//
// Threads: Gather runs on the reporting gRPC handler's thread under JobRuns::mu and touches only the run it is given
// (JobRun's committer section); Commit runs on the same thread without the lock and writes files and the job table.
// The committer holds no state of its own.
// Errors: none returned. A manifest that cannot be written leaves the step uncommitted with a warning in the job's
// events, and a failed prune is a warning too; the job goes on and its next checkpoint is tried at its interval.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "head/job_manager.h"
#include "head/job_run.h"

namespace geotrain::head {

class CheckpointCommitter {
 public:
  // `jobs` outlives the committer; `clock` dates the manifests.
  CheckpointCommitter(JobManager* jobs, const Clock* clock);
  CheckpointCommitter(const CheckpointCommitter&) = delete;
  CheckpointCommitter& operator=(const CheckpointCommitter&) = delete;

  // What one report's shards did to the run's checkpoints.
  struct Gathered {
    // Steps whose every shard is in, each with its shards by actor: to commit.
    std::vector<std::pair<int64_t, std::map<std::string, CheckpointShard>>> ready;
    std::vector<CheckpointShard> failed;   // shards that could not be written: their checkpoints are abandoned
    bool persist = false;                  // the report carried shards: the job record's pending shards change
    std::vector<CheckpointShard> pending;  // then: every shard of checkpoints not yet complete
  };
  // Files the report's shards (any report may carry them, an error report too) into run.shards: one shard per
  // stage, or with DiLoCo per stage and group; moves run.last_checkpoint_step on when a step is complete.
  static Gathered Gather(JobRun& run, const StepReport& report);

  // Logs the abandoned checkpoints, then commits the complete ones of job `job_id` (spec: the run's).
  void Commit(const std::string& job_id, const JobSpec& spec, const Gathered& gathered);

 private:
  // Writes one step's manifest from its shards, records the step in the job and prunes old checkpoints.
  void CommitStep(const std::string& job_id, const JobSpec& spec, int64_t step,
                  const std::map<std::string, CheckpointShard>& shards);

  JobManager* jobs_;
  const Clock* clock_;
};

}  // namespace geotrain::head
