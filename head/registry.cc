// Worker registry and heartbeat failure detector.
#include "head/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"

namespace geotrain::head {

WorkerRegistry::WorkerRegistry(const Clock* clock, Options options, std::string head_id)
    : clock_(clock), options_(options), head_id_(std::move(head_id)) {}

void WorkerRegistry::Restore(const std::vector<WorkerInfo>& workers) {
  absl::MutexLock lock(&mu_);
  for (const WorkerInfo& w : workers) {
    workers_[w.worker_id()] = w;
    last_seen_ms_[w.worker_id()] = clock_->NowMillis();
  }
}

RegisterWorkerReply WorkerRegistry::Register(const RegisterWorkerRequest& request, WorkerInfo* stored) {
  absl::MutexLock lock(&mu_);
  std::string id = request.worker_id();
  if (id.empty()) {
    do {
      id = GenerateId("w");
    } while (workers_.count(id));
  }
  WorkerInfo& w = workers_[id];
  const uint64_t incarnation = w.incarnation() + 1;
  const bool returning = w.incarnation() > 0;
  // A draining worker stays draining when the same process registers again (the head restarted); a new process
  // under its id joins afresh.
  if (w.pid() != request.pid() || w.hostname() != request.hostname()) w.set_draining(false);
  w.set_worker_id(id);
  w.set_site(request.site());
  w.set_address(request.address());
  w.set_listen_address(request.listen_address());
  *w.mutable_devices() = request.devices();
  w.set_state(WORKER_ALIVE);
  w.set_hostname(request.hostname());
  w.set_pid(request.pid());
  w.set_metrics_address(request.metrics_address());
  *w.mutable_address_for_site() = request.address_for_site();
  w.set_incarnation(incarnation);
  w.set_registered_unix_ms(clock_->UnixMillis());
  w.set_last_heartbeat_unix_ms(clock_->UnixMillis());
  w.clear_dead_reason();
  last_seen_ms_[id] = clock_->NowMillis();
  GT_LOG(INFO) << (returning ? "worker re-registered: " : "worker joined: ") << id << " site " << w.site() << " at "
               << w.address() << " with " << w.devices_size() << " device(s)";
  if (stored != nullptr) *stored = w;
  RegisterWorkerReply reply;
  reply.set_worker_id(id);
  reply.set_incarnation(incarnation);
  reply.set_heartbeat_interval_ms(static_cast<int32_t>(options_.heartbeat_interval_ms));
  reply.set_head_id(head_id_);
  return reply;
}

HeartbeatReply WorkerRegistry::Heartbeat(const HeartbeatRequest& request) {
  HeartbeatReply reply;
  reply.set_head_id(head_id_);
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end() || it->second.state() != WORKER_ALIVE || it->second.incarnation() != request.incarnation()) {
    reply.set_reregister(true);
    return reply;
  }
  last_seen_ms_[request.worker_id()] = clock_->NowMillis();
  it->second.set_last_heartbeat_unix_ms(clock_->UnixMillis());
  actors_[request.worker_id()].assign(request.actors().begin(), request.actors().end());
  reply.set_draining(it->second.draining());
  RecordSent(request);
  for (const LinkMeasurement& link : request.links()) {
    if (link.rtt_ms() < 0 || link.bandwidth_mbps() < 0 || !workers_.count(link.dst_worker())) continue;
    LinkMeasurement& stored = links_[{request.worker_id(), link.dst_worker()}];
    stored = link;
    stored.set_src_worker(request.worker_id());
    stored.set_src_site(it->second.site());
    stored.set_dst_site(workers_[link.dst_worker()].site());
  }
  const std::string& my_site = it->second.site();
  for (const auto& [id, peer] : workers_) {
    if (id == request.worker_id() || peer.state() != WORKER_ALIVE) continue;
    PeerInfo* p = reply.add_peers();
    p->set_worker_id(id);
    p->set_site(peer.site());
    auto via = peer.address_for_site().find(my_site);
    p->set_address(via != peer.address_for_site().end() ? via->second : peer.address());
  }
  return reply;
}

absl::StatusOr<WorkerInfo> WorkerRegistry::SetDraining(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no worker '", worker_id, "'; `geotrain status` lists the workers"));
  }
  if (it->second.state() != WORKER_ALIVE) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " is dead (", it->second.dead_reason(),
                                                      "): its jobs restart without it already"));
  }
  if (!it->second.draining()) GT_LOG(INFO) << "worker " << worker_id << " drains: nothing is placed on it again";
  it->second.set_draining(true);
  return it->second;
}

void WorkerRegistry::Suspect(const std::vector<std::string>& worker_ids, const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : worker_ids) peer_suspects_.emplace(id, why);
  }
  if (on_suspect_) on_suspect_();
}

std::vector<WorkerInfo> WorkerRegistry::CheckLiveness(const Probe& probe) {
  // Which silent workers answer a connection, asked without the lock (a probe takes up to a second).
  std::vector<std::string> silent_ids, addresses;
  std::map<std::string, std::string> peer_suspects;  // probed although not silent (Suspect): id -> why
  if (probe) {
    const int64_t now = clock_->NowMillis();
    absl::MutexLock lock(&mu_);
    for (const auto& [id, w] : workers_) {
      const bool silent = now - last_seen_ms_[id] > options_.timeout_ms;
      auto suspect = peer_suspects_.find(id);
      if (w.state() == WORKER_ALIVE && (silent || suspect != peer_suspects_.end())) {
        silent_ids.push_back(id);
        addresses.push_back(w.address());
        if (!silent) peer_suspects.insert(*suspect);
      }
    }
    peer_suspects_.clear();
  }
  std::map<std::string, Reachability> reach;
  if (!silent_ids.empty()) {
    const std::vector<Reachability> found = probe(addresses);
    for (size_t i = 0; i < silent_ids.size() && i < found.size(); ++i) reach[silent_ids[i]] = found[i];
  }
  std::vector<WorkerInfo> dead;
  const int64_t now = clock_->NowMillis();
  absl::MutexLock lock(&mu_);
  for (auto& [id, w] : workers_) {
    if (w.state() != WORKER_ALIVE) continue;
    const int64_t silent = now - last_seen_ms_[id];
    std::string reason = absl::StrCat("no heartbeat for ", silent, " ms (timeout ", options_.timeout_ms, " ms)");
    if (silent <= options_.timeout_ms) {
      suspected_.erase(id);
      // A worker its job's peers lost: dead only if its port refuses connections (a heartbeat may be on its way).
      auto r = reach.find(id);
      auto suspect = peer_suspects.find(id);
      if (suspect == peer_suspects.end() || r == reach.end() || r->second != Reachability::kRefused) continue;
      reason = absl::StrCat(suspect->second, " and its port refuses connections: the process is gone (last heartbeat ",
                            silent, " ms ago)");
    }
    if (probe && silent > options_.timeout_ms) {
      auto r = reach.find(id);
      if (r == reach.end()) continue;  // went silent after the probe: the next check probes it
      if (r->second != Reachability::kRefused) {
        if (silent <= options_.unreachable_timeout_ms) {
          if (suspected_.insert({id, r->second}).second) {
            GT_LOG(WARNING) << "worker " << id << " (site " << w.site() << ") silent for " << silent << " ms; "
                            << (r->second == Reachability::kListening ? "its port answers"
                                                                      : "it cannot be reached (a partition?)")
                            << ": declared dead after " << options_.unreachable_timeout_ms << " ms of silence";
          }
          continue;
        }
        reason = absl::StrCat("no heartbeat for ", silent, " ms; ",
                              r->second == Reachability::kListening ? "its port answers (hung?)"
                                                                    : "unreachable (a partition, or the host is down)",
                              " past the unreachable timeout of ", options_.unreachable_timeout_ms, " ms");
      } else {
        reason += "; its port refuses connections: the process is gone";
      }
    }
    suspected_.erase(id);
    w.set_state(WORKER_DEAD);
    w.set_dead_reason(reason);
    for (ActorRecord& actor : actors_[id]) {
      if (actor.state() == ACTOR_DEAD) continue;
      actor.set_state(ACTOR_DEAD);
      actor.set_message(absl::StrCat("worker ", id, " died: ", w.dead_reason()));
    }
    GT_LOG(WARNING) << "worker " << id << " (site " << w.site() << ") declared dead: " << w.dead_reason();
    dead.push_back(w);
  }
  return dead;
}

std::vector<WorkerInfo> WorkerRegistry::Workers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) out.push_back(w);
  return out;
}

void WorkerRegistry::RecordSent(const HeartbeatRequest& request) {
  const int64_t now = clock_->NowMillis();
  for (const LinkSent& sent : request.sent()) {
    if (sent.bytes() < 0 || !(sent.seconds() >= 0) || !workers_.count(sent.dst_worker())) continue;
    SentSample& sample = sent_[{request.worker_id(), sent.dst_worker()}];
    const int64_t bytes = sent.bytes() - sample.bytes;
    const double seconds = sent.seconds() - sample.seconds;
    // Totals that shrank belong to a restarted worker: they start again from here.
    if (bytes > 0 && seconds > 0) {
      sample.goodput_mbps = static_cast<double>(bytes) * 8 / 1e6 / seconds;
      sample.goodput_at_ms = now;
    }
    sample.bytes = sent.bytes();
    sample.seconds = sent.seconds();
  }
}

std::vector<SiteLink> WorkerRegistry::SiteLinks() const {
  absl::MutexLock lock(&mu_);
  std::map<std::pair<std::string, std::string>, std::pair<std::vector<double>, std::vector<double>>> by_pair;
  // Goodput: each worker pair's latest, if it is from the last minute.
  std::map<std::pair<std::string, std::string>, std::vector<double>> goodput;
  const int64_t now = clock_->NowMillis();
  for (const auto& [key, sample] : sent_) {
    auto src = workers_.find(key.first);
    auto dst = workers_.find(key.second);
    if (sample.goodput_at_ms == 0 || now - sample.goodput_at_ms > 60'000 || src == workers_.end() ||
        dst == workers_.end() || src->second.site() == dst->second.site()) {
      continue;
    }
    goodput[std::minmax(src->second.site(), dst->second.site())].push_back(sample.goodput_mbps);
  }
  for (const auto& [key, link] : links_) {
    auto src = workers_.find(key.first);
    auto dst = workers_.find(key.second);
    if (src == workers_.end() || dst == workers_.end() || src->second.state() != WORKER_ALIVE ||
        dst->second.state() != WORKER_ALIVE) {
      continue;
    }
    auto sites = std::minmax(link.src_site(), link.dst_site());
    auto& samples = by_pair[{sites.first, sites.second}];
    samples.first.push_back(link.rtt_ms());
    if (link.bandwidth_mbps() > 0) samples.second.push_back(link.bandwidth_mbps());
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  std::vector<SiteLink> out;
  for (const auto& [sites, samples] : by_pair) {
    SiteLink link;
    link.set_a(sites.first);
    link.set_b(sites.second);
    link.set_latency_ms(median(samples.first) / 2);
    link.set_bandwidth_mbps(median(samples.second));
    link.set_samples(static_cast<int32_t>(samples.first.size()));
    if (auto it = goodput.find(sites); it != goodput.end()) link.set_goodput_mbps(median(it->second));
    out.push_back(link);
  }
  return out;
}

std::vector<ActorRecord> WorkerRegistry::Actors() const {
  absl::MutexLock lock(&mu_);
  std::vector<ActorRecord> out;
  for (const auto& [id, actors] : actors_) out.insert(out.end(), actors.begin(), actors.end());
  return out;
}

}  // namespace geotrain::head
