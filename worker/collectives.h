// Which transport each of a stage actor's collective groups uses. Every member of a group decides from
// the same inputs (the job's actor list, where each actor's device kind comes from the head), so no group
// can have members on NCCL and members on gRPC, which would hang until the collective deadline.
//
//   - tensor parallelism: NCCL on device memory when the build has NCCL and every member of the group
//     runs on a CUDA device in one site; otherwise gRPC, a CUDA stage staging through host memory;
//   - data parallelism: when the build has NCCL and every replica of the stage (same stage, same TP
//     rank) runs on CUDA, the hierarchical all-reduce of docs/comm.md on device memory: NCCL among the
//     replicas of each site, gRPC with the WAN codec among one leader per site (the site's lowest
//     replica). Otherwise the gRPC all-reduce of host memory for the whole group.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "control.pb.h"

namespace geotrain::worker {

struct DataParallelNccl {
  bool use = false;
  std::string site;                  // this actor's site
  std::vector<int> site_replicas;    // the replicas of this stage in this site, ascending (NCCL ranks)
  int site_rank = 0;                 // this actor's index in site_replicas
  std::vector<int> leader_replicas;  // each site's lowest replica, ascending (the leaders' gRPC ring)
  int leader_index = -1;             // this actor's index in leader_replicas; -1 when not a leader
};

struct CollectivePlan {
  bool tp_nccl = false;
  DataParallelNccl dp;
  std::vector<std::string> notes;  // why a group of CUDA stages stays on gRPC, for the actor's log
};

// `peers` is the job's actor list (this actor included); (replica, stage, tp_rank) are this actor's
// coordinates in a dp x pp x tp plan; `nccl_built` says whether this build has NCCL. INVALID_ARGUMENT when
// the list lacks an actor of a group.
absl::StatusOr<CollectivePlan> PlanCollectives(const std::vector<ActorPeer>& peers, int dp, int pp, int tp, int replica,
                                               int stage, int tp_rank, bool nccl_built);

}  // namespace geotrain::worker
