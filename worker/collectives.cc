// Transport of each collective group of a stage actor (see collectives.h).
#include "worker/collectives.h"

#include <algorithm>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace geotrain::worker {

absl::StatusOr<CollectivePlan> PlanCollectives(const std::vector<ActorPeer>& peers, int dp, int pp, int tp, int replica,
                                               int stage, int tp_rank, bool nccl_built) {
  std::map<std::tuple<int, int, int>, const ActorPeer*> by_coordinates;
  for (const ActorPeer& p : peers) by_coordinates[{p.replica(), p.stage(), p.tp_rank()}] = &p;
  auto find = [&](int r, int s, int t) -> absl::StatusOr<const ActorPeer*> {
    auto it = by_coordinates.find({r, s, t});
    if (it == by_coordinates.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the job's actor list has no actor for replica ", r, ", stage ", s,
                                                     ", tp rank ", t, " of a ", dp, " x ", pp, " x ", tp, " plan"));
    }
    return it->second;
  };
  auto on_cuda = [](const ActorPeer& p) { return p.device_kind() == DEVICE_KIND_CUDA; };
  // The n members of a group, member i at coordinates(i).
  auto members = [&](int n, const std::function<std::tuple<int, int, int>(int)>& coordinates)
      -> absl::StatusOr<std::vector<const ActorPeer*>> {
    std::vector<const ActorPeer*> group;
    for (int i = 0; i < n; ++i) {
      const auto [r, s, t] = coordinates(i);
      ASSIGN_OR_RETURN(const ActorPeer* p, find(r, s, t));
      group.push_back(p);
    }
    return group;
  };
  auto all_on_cuda = [&](const std::vector<const ActorPeer*>& group) {
    return std::all_of(group.begin(), group.end(), [&](const ActorPeer* p) { return on_cuda(*p); });
  };

  CollectivePlan plan;
  if (tp > 1) {
    ASSIGN_OR_RETURN(const std::vector<const ActorPeer*> group,
                     members(tp, [&](int i) { return std::make_tuple(replica, stage, i); }));
    const bool all_cuda = all_on_cuda(group);
    const bool one_site =
        std::all_of(group.begin(), group.end(), [&](const ActorPeer* p) { return p->site() == group.front()->site(); });
    plan.tp_nccl = nccl_built && all_cuda && one_site;
    if (!plan.tp_nccl && on_cuda(*group[tp_rank])) {
      plan.notes.push_back(!nccl_built ? "tensor-parallel group on gRPC: this build has no NCCL"
                           : !all_cuda ? "tensor-parallel group on gRPC: some of its actors do not run on CUDA"
                                       : "tensor-parallel group on gRPC: its actors are in several sites");
    }
  }
  if (dp > 1) {
    ASSIGN_OR_RETURN(const std::vector<const ActorPeer*> group,
                     members(dp, [&](int i) { return std::make_tuple(i, stage, tp_rank); }));
    if (nccl_built && all_on_cuda(group)) {
      DataParallelNccl& d = plan.dp;
      d.use = true;
      d.site = group[replica]->site();
      std::map<std::string, int> lowest_replica_of_site;
      for (int r = 0; r < dp; ++r) {
        lowest_replica_of_site.emplace(group[r]->site(), r);  // r ascends: the first is the lowest
        if (group[r]->site() == d.site) d.site_replicas.push_back(r);
      }
      d.site_rank = static_cast<int>(std::find(d.site_replicas.begin(), d.site_replicas.end(), replica) -
                                     d.site_replicas.begin());
      for (const auto& [site, r] : lowest_replica_of_site) d.leader_replicas.push_back(r);
      std::sort(d.leader_replicas.begin(), d.leader_replicas.end());
      auto leader = std::find(d.leader_replicas.begin(), d.leader_replicas.end(), replica);
      d.leader_index = leader == d.leader_replicas.end() ? -1 : static_cast<int>(leader - d.leader_replicas.begin());
    } else if (on_cuda(*group[replica])) {
      plan.notes.push_back(!nccl_built ? "data-parallel all-reduce on gRPC: this build has no NCCL"
                                       : "data-parallel all-reduce on gRPC through host memory: some replicas "
                                         "do not run on CUDA");
    }
  }
  return plan;
}

}  // namespace geotrain::worker
