// One job's shards staged onto a worker in walk order (see job_staging.h).
#include "worker/job_staging.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace geotrain::worker {

ShardServer SiteRelay(const JobSpec& spec, const std::vector<ActorPeer>& peers, const std::string& site,
                      const std::string& worker_id, const ShardServer& head) {
  const int last_stage = std::max(1, spec.parallel().pp()) - 1;
  const ActorPeer* relay = nullptr;
  for (const ActorPeer& p : peers) {
    if (p.site() != site || (p.stage() != 0 && p.stage() != last_stage)) continue;
    if (relay == nullptr || p.worker_id() < relay->worker_id()) relay = &p;
  }
  if (relay == nullptr || relay->worker_id() == worker_id) return head;
  return ShardServer{relay->address(), absl::StrCat("worker ", relay->worker_id()), ShardOrigin::kPeer};
}

JobStaging::JobStaging(ShardCache* cache, Options options) : cache_(cache), options_(std::move(options)) {}

absl::StatusOr<std::shared_ptr<JobStaging>> JobStaging::Start(ShardCache* cache, Options options) {
  std::shared_ptr<JobStaging> staging(new JobStaging(cache, std::move(options)));
  const Options& o = staging->options_;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(o.head.address, o.tls));
  staging->head_ = DataStaging::NewStub(channel);
  ListShardsRequest request;
  request.set_job_id(o.job_id);
  request.set_pattern(o.pattern);
  ListShardsReply reply;
  // The listing is small, but the head may be a WAN away and hashing nothing: a generous deadline, a few tries.
  grpc::Status s;
  for (int attempt = 0; attempt < 3; ++attempt) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, o.token);
    SetDeadlineMillis(&ctx, 20000);
    s = staging->head_->ListShards(&ctx, request, &reply);
    if (s.ok() || s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  if (!s.ok()) {
    return FromGrpc(s, absl::StrCat("listing the job's shards '", o.pattern, "' on the head for worker ", o.worker_id,
                                    " (site ", o.site, ")"));
  }
  if (reply.shards().empty()) {
    return absl::NotFoundError(absl::StrCat("no token shards match '", o.pattern,
                                            "' on the head's machine; data paths in a spec are paths there (write "
                                            "the shards with `geotrain data prepare` on the head's machine)"));
  }
  staging->shards_.assign(reply.shards().begin(), reply.shards().end());
  for (const ShardInfo& shard : staging->shards_) staging->total_bytes_ += shard.bytes();
  staging->self_ = staging;
  staging->thread_ = std::thread([raw = staging.get()] { raw->Run(); });
  GT_LOG(INFO) << "job " << o.job_id << ": staging " << staging->shards_.size() << " shard(s), "
               << staging->total_bytes_ << " bytes, from " << o.source.name;
  return staging;
}

JobStaging::~JobStaging() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

model::ShardSource JobStaging::Source() {
  model::ShardSource source;
  for (const ShardInfo& shard : shards_) {
    source.names.push_back(shard.path());
    source.token_counts.push_back(model::ShardTokensForBytes(shard.bytes()));
  }
  source.wait_for_shard = [self = self_.lock()](int index) -> absl::StatusOr<std::string> {
    absl::MutexLock lock(&self->mu_);
    while (static_cast<int>(self->paths_.size()) <= index && self->error_.ok()) self->staged_cv_.Wait(&self->mu_);
    if (static_cast<int>(self->paths_.size()) > index) return self->paths_[index];
    return self->error_;
  };
  return source;
}

void JobStaging::Run() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto last_report = start;
  double network_seconds = 0;
  const ShardCache::OnBytes on_bytes = [&](uint64_t bytes, ShardOrigin origin) {
    {
      absl::MutexLock lock(&mu_);
      staged_ += bytes;
      (origin == ShardOrigin::kHead ? from_head_ : origin == ShardOrigin::kPeer ? from_peer_ : from_cache_) += bytes;
      network_seconds_ = network_seconds + std::chrono::duration<double>(Clock::now() - shard_start_).count();
    }
    if (Clock::now() - last_report >= std::chrono::milliseconds(options_.report_every_ms)) {
      last_report = Clock::now();
      Report(false, "");
    }
  };
  for (size_t i = 0; i < shards_.size() && !stop_; ++i) {
    {
      absl::MutexLock lock(&mu_);
      shard_start_ = Clock::now();
    }
    absl::StatusOr<std::string> path =
        cache_->Get(options_.job_id, shards_[i], options_.source, options_.head, &stop_, on_bytes);
    {
      absl::MutexLock lock(&mu_);
      network_seconds = network_seconds_;
    }
    if (!path.ok()) {
      if (stop_) break;
      GT_LOG(WARNING) << "job " << options_.job_id << ": " << path.status();
      {
        absl::MutexLock lock(&mu_);
        error_ = path.status();
        staged_cv_.SignalAll();
      }
      Report(true, std::string(path.status().message()));
      return;
    }
    absl::MutexLock lock(&mu_);
    paths_.push_back(*path);
    staged_cv_.SignalAll();
  }
  if (stop_) {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = absl::CancelledError("staging stopped: the actor is stopping");
    staged_cv_.SignalAll();
    return;
  }
  GT_LOG(INFO) << "job " << options_.job_id << ": staged " << total_bytes_ << " bytes in "
               << std::chrono::duration<double>(Clock::now() - start).count() << " s";
  Report(true, "");
}

void JobStaging::Report(bool done, const std::string& error) {
  StagingProgress progress;
  progress.set_job_id(options_.job_id);
  progress.set_worker_id(options_.worker_id);
  progress.set_site(options_.site);
  progress.set_total_bytes(total_bytes_);
  progress.set_source(options_.source.origin == ShardOrigin::kHead ? "head" : options_.source.name);
  progress.set_done(done);
  progress.set_error(error);
  {
    absl::MutexLock lock(&mu_);
    progress.set_staged_bytes(staged_);
    progress.set_from_head_bytes(from_head_);
    progress.set_from_peer_bytes(from_peer_);
    progress.set_from_cache_bytes(from_cache_);
    const uint64_t network = from_head_ + from_peer_;
    progress.set_bytes_per_second(network_seconds_ > 0 ? network / network_seconds_ : 0);
  }
  grpc::ClientContext ctx;
  AttachToken(&ctx, options_.token);
  SetDeadlineMillis(&ctx, 3000);
  StagingProgressReply reply;
  // Progress is for people: a lost report is not an error.
  if (grpc::Status s = head_->ReportStaging(&ctx, progress, &reply); !s.ok()) {
    GT_LOG(DEBUG) << "staging progress of job " << options_.job_id << " not delivered: " << s.error_message();
  }
}

}  // namespace geotrain::worker
