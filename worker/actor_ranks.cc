// A stage actor's ranks and groups (see actor_ranks.h).
#include "worker/actor_ranks.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace geotrain::worker {

std::string CommJobId(const std::string& job_id, int64_t attempt, int64_t epoch) {
  std::string key = attempt > 0 ? absl::StrCat(job_id, "/attempt", attempt) : job_id;
  if (epoch > 0) absl::StrAppend(&key, "/epoch", epoch);
  return key;
}

ActorRanks ActorRanks::Regrouped(int64_t new_epoch, std::vector<int> replicas) const {
  ActorRanks out = *this;
  out.epoch = new_epoch;
  out.present = std::move(replicas);
  out.comm_job_id = CommJobId(job_id, attempt, new_epoch);
  return out;
}

std::vector<int> ActorRanks::DataParallelGroup() const {
  std::vector<int> out;
  for (int r : present) out.push_back(WorldRank(r, stage, tp_rank));
  return out;
}

std::vector<int> ActorRanks::ReplicaGroup() const {
  std::vector<int> out;
  for (int s = 0; s < pp; ++s) {
    for (int t = 0; t < tp; ++t) out.push_back(WorldRank(replica, s, t));
  }
  return out;
}

std::vector<int> ActorRanks::TensorParallelGroup() const {
  std::vector<int> out;
  for (int t = 0; t < tp; ++t) out.push_back(WorldRank(replica, stage, t));
  return out;
}

std::vector<int> ActorRanks::TiedEmbeddingGroup(const std::vector<int>& replicas) const {
  if (pp == 1 || !(first_stage || last_stage)) return {};
  std::vector<int> out;
  for (int r : replicas) {
    out.push_back(WorldRank(r, 0, tp_rank));
    out.push_back(WorldRank(r, pp - 1, tp_rank));
  }
  return out;
}

absl::StatusOr<ActorRanks> ActorRanks::Create(const JobSpec& spec, const ActorRecord& me,
                                              const std::vector<ActorPeer>& actors, const std::string& my_site,
                                              int64_t attempt) {
  ActorRanks r;
  r.job_id = me.job_id();
  r.attempt = attempt;
  r.comm_job_id = CommJobId(me.job_id(), attempt);
  r.dp = spec.parallel().dp();
  r.pp = spec.parallel().pp();
  r.tp = spec.parallel().tp();
  r.microbatches = spec.parallel().microbatches();
  r.seq_len = spec.train().seq_len();
  if (r.dp <= 0 || r.pp <= 0 || r.tp <= 0 || r.microbatches <= 0) {
    return absl::InvalidArgumentError("parallel.dp, pp, tp and microbatches must be positive");
  }
  r.replica_batch = spec.train().global_batch() / r.dp;
  r.microbatch_size = r.replica_batch / r.microbatches;
  if (r.microbatch_size <= 0 || r.replica_batch % r.microbatches != 0 || spec.train().global_batch() % r.dp != 0) {
    return absl::InvalidArgumentError("global_batch must be a multiple of dp x microbatches");
  }
  r.one_f_one_b = spec.parallel().schedule() == "1f1b";
  r.replica = me.replica();
  r.stage = me.stage();
  r.tp_rank = me.tp_rank();
  if (r.replica < 0 || r.replica >= r.dp || r.stage < 0 || r.stage >= r.pp || r.tp_rank < 0 || r.tp_rank >= r.tp) {
    return absl::InvalidArgumentError(absl::StrCat("actor ", me.actor_id(), " (replica ", r.replica, ", stage ",
                                                   r.stage, ", tp rank ", r.tp_rank, ") is outside the plan"));
  }
  r.present.resize(r.dp);
  std::iota(r.present.begin(), r.present.end(), 0);
  r.first_stage = r.stage == 0;
  r.last_stage = r.stage == r.pp - 1;
  r.site = my_site;
  const int world = r.world_size();
  r.peers.resize(world);
  std::vector<bool> seen(world, false);
  for (const ActorPeer& p : actors) {
    const bool inside = p.replica() >= 0 && p.replica() < r.dp && p.stage() >= 0 && p.stage() < r.pp &&
                        p.tp_rank() >= 0 && p.tp_rank() < r.tp;
    const int w = inside ? r.WorldRank(p.replica(), p.stage(), p.tp_rank()) : -1;
    if (w < 0 || seen[w]) {
      return absl::InvalidArgumentError(
          absl::StrCat("actor list of job ", me.job_id(), " is inconsistent at ", p.actor_id()));
    }
    seen[w] = true;
    auto via = p.address_for_site().find(my_site);
    r.peers[w] = {p.actor_id(), via != p.address_for_site().end() ? via->second : p.address(), p.site()};
  }
  if (std::count(seen.begin(), seen.end(), false) > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", me.job_id(), " lists ", actors.size(), " actors; its plan needs ", world));
  }
  r.my_rank = r.WorldRank(r.replica, r.stage, r.tp_rank);
  r.next_rank = r.last_stage ? -1 : r.WorldRank(r.replica, r.stage + 1, r.tp_rank);
  r.prev_rank = r.first_stage ? -1 : r.WorldRank(r.replica, r.stage - 1, r.tp_rank);
  return r;
}

}  // namespace geotrain::worker
