// Where a stage actor sits in its job's plan: its (replica, stage, tensor rank), the shape of its
// microbatches, its peers by world rank and the rank lists of the groups it takes part in.
//
//   ASSIGN_OR_RETURN(ActorRanks ranks, ActorRanks::Create(spec, actor, peers, /*my_site=*/"utah"));
//   comm::PeerInfo next = ranks.peers[ranks.next_rank];   // the next stage of this replica
//   std::vector<int> dp_group = ranks.DataParallelGroup();  // this stage in every replica
//
// World rank of (replica r, stage s, tensor rank t) in a dp x pp x tp plan: (r * pp + s) * tp + t. Every
// actor of a job computes the same numbering from the same actor list, so groups agree without talking.
// Pure data; safe to copy and share between threads once made.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "control.pb.h"

namespace geotrain::worker {

// The key every tensor of run `attempt` of job `job_id` travels under in membership `epoch` (see
// ActorRanks::comm_job_id).
std::string CommJobId(const std::string& job_id, int64_t attempt, int64_t epoch = 0);

struct ActorRanks {
  // The plan.
  int dp = 1, pp = 1, tp = 1;
  int microbatches = 1;     // M
  int seq_len = 0;          // T
  int replica_batch = 0;    // sequences per step of one replica (global_batch / dp)
  int microbatch_size = 0;  // Bm = replica_batch / M
  bool one_f_one_b = true;  // the schedule: 1F1B, or GPipe
  // This actor.
  std::string job_id;
  int64_t attempt = 0;  // which run of the job (0 first; each restart raises it)
  int replica = 0, stage = 0, tp_rank = 0;
  bool first_stage = true, last_stage = true;
  int my_rank = 0;
  int next_rank = -1;  // the next stage of this replica and tensor rank; -1 on the last stage
  int prev_rank = -1;  // the previous one; -1 on the first stage
  std::string site;    // the hosting worker's site
  // The key every tensor of this run of the job travels under: the job id, plus "/attempt<N>" after a
  // restart and "/epoch<E>" after a live regroup, so that a run never receives an earlier run's tensors, nor a
  // membership an earlier one's.
  std::string comm_job_id;
  // Live regroups (head/job_regroup.h): the membership the groups are built for (0: the run's first) and the
  // replicas in it, ascending (every replica in the first). The plan (dp, the data each replica reads, the world
  // ranks) stays; the data-parallel groups hold the present replicas only.
  int64_t epoch = 0;
  std::vector<int> present;
  // Every actor of the job by world rank, with the address this actor dials it at (per its site).
  std::vector<comm::PeerInfo> peers;

  int world_size() const { return dp * pp * tp; }
  int WorldRank(int r, int s, int t) const { return (r * pp + s) * tp + t; }
  // The lowest replica present: its actors write the checkpoints and carry the job's loss.
  int lead_replica() const { return present.front(); }
  // The same actor in membership `epoch` of `replicas` (ascending, this actor's among them).
  ActorRanks Regrouped(int64_t new_epoch, std::vector<int> replicas) const;
  // This stage and tensor rank in every present replica, by replica.
  std::vector<int> DataParallelGroup() const;
  // Every stage and tensor rank of this replica, stage-major.
  std::vector<int> ReplicaGroup() const;
  // The tensor-parallel ranks of this stage in this replica.
  std::vector<int> TensorParallelGroup() const;
  // The first and last stage at this tensor rank of each of `replicas` (ascending), which all hold a copy of the
  // tied embedding: by replica, its first stage first. Empty unless pp > 1 and this actor is one of them.
  std::vector<int> TiedEmbeddingGroup(const std::vector<int>& replicas) const;

  // INVALID_ARGUMENT when the batch does not split into dp x microbatches, or when the actor list does
  // not hold exactly one actor per (replica, stage, tensor rank) of the plan.
  static absl::StatusOr<ActorRanks> Create(const JobSpec& spec, const ActorRecord& me,
                                           const std::vector<ActorPeer>& actors, const std::string& my_site,
                                           int64_t attempt = 0);
};

}  // namespace geotrain::worker
