// A stage actor's part in a heal (head/job_heal.h): the membership with the joining replicas, and a joining actor's
// wait for its state. The rest of the actor is in stage_actor.cc.
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/stage_actor.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {

absl::StatusOr<ActorRanks> StageActor::MembershipRanks(const Regroup& g) const {
  // After a heal, the joining replicas' actors are new, on other workers: the ranks are made from the list again.
  ASSIGN_OR_RETURN(ActorRanks fresh,
                   ActorRanks::Create(config_.spec, config_.actor, peers_, config_.site, config_.attempt));
  return fresh.Regrouped(g.epoch(), std::vector<int>(g.replicas().begin(), g.replicas().end()));
}

absl::StatusOr<int64_t> StageActor::Join(StageTrainer& trainer, const ActorRanks& ranks) {
  // The others train on while this actor sets up; once every joining actor said it is set up, the head picks the
  // step they all stop after, and moves the job to this actor's membership once they did. Then the donor's actor of
  // this stage sends its state here, and this actor says it is ready at that step; the head confirms once all are.
  const std::string& id = config_.actor.actor_id();
  const int donor = config_.join.donor();
  GT_LOG(INFO) << "actor " << id << ": set up to join the job (membership " << ranks.epoch << ", replicas ["
               << absl::StrJoin(ranks.present, ", ") << "]); waiting for its state from replica " << donor;
  // The others reach the step boundary within a few of their steps once it is picked; the head gives the heal up
  // (stopping this actor) when it cannot finish.
  const auto deadline = std::chrono::steady_clock::now() + 4 * std::chrono::milliseconds(config_.collective_timeout_ms);
  bool received = false;
  while (!stop_) {
    Regroup regroup;
    {
      absl::MutexLock lock(&mu_);
      regroup = regroup_;
    }
    if (regroup.epoch() > ranks.epoch) {
      return absl::AbortedError(absl::StrCat("the job moved to membership ", regroup.epoch(), " before membership ",
                                             ranks.epoch, " that this actor joins had formed"));
    }
    if (regroup.epoch() == ranks.epoch && !received) {
      const auto start = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(const uint64_t bytes, trainer.ReceiveState(donor));
      received = true;
      GT_LOG(INFO) << "actor " << id << ": received its stage's state from replica " << donor << " (" << bytes
                   << " bytes in " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                   << " s), at step " << trainer.completed_step();
    }
    if (received && regroup.epoch() == ranks.epoch && regroup.confirmed()) {
      if (regroup.resume_step() != trainer.completed_step() + 1) {
        return absl::InternalError(absl::StrCat("the head resumes the job at step ", regroup.resume_step(),
                                                " but the state this actor received is of step ",
                                                trainer.completed_step()));
      }
      return regroup.resume_step();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("actor ", id, " did not join the job within ", 4 * config_.collective_timeout_ms / 1000,
                       " s: ", received ? "the head did not confirm its membership" : "no state came"));
    }
    StepReport probe = Probe();
    if (received) {  // ready in the membership, at the donor's step
      probe.set_regroup_waiting(true);
      probe.set_epoch(ranks.epoch);
      probe.set_completed_step(trainer.completed_step());
      probe.set_regroup_cause("joining for a heal");
    } else {
      probe.set_heal_ready(true);
    }
    reporter_->Enqueue(probe);
    reporter_->Drain(absl::Milliseconds(config_.collective_timeout_ms));
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::CancelledError("stop requested");
}

}  // namespace geotrain::worker
