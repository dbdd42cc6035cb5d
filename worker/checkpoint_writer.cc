// Background checkpoint writes (see checkpoint_writer.h).
#include "worker/checkpoint_writer.h"

#include <chrono>

#include "common/log.h"

namespace geotrain::worker {

CheckpointWriter::CheckpointWriter(std::function<absl::Status(CheckpointShard*)> publish)
    : publish_(std::move(publish)), thread_([this] { Loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  WaitIdle();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::Duration CheckpointWriter::Write(CheckpointShard shard, std::string step_dir, std::string suffix,
                                       model::CheckpointSnapshot snapshot) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return !w->has_job_; }, this));
  const absl::Duration waited = absl::Now() - start;
  job_ = Job{std::move(shard), std::move(step_dir), std::move(suffix), std::move(snapshot)};
  has_job_ = true;
  return waited;
}

std::vector<CheckpointShard> CheckpointWriter::TakeFinished() {
  absl::MutexLock lock(&mu_);
  std::vector<CheckpointShard> out;
  out.swap(finished_);
  return out;
}

void CheckpointWriter::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return !w->has_job_; }, this));
}

void CheckpointWriter::Loop() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || w->has_job_; },
          this));
      if (!has_job_) return;  // stopping with nothing to write
      job = std::move(job_);
    }
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<model::WrittenShard> written = model::WriteCheckpointShard(job.step_dir, job.suffix, job.snapshot);
    CheckpointShard& shard = job.shard;
    shard.set_dir(job.step_dir);
    shard.set_write_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (written.ok()) {
      shard.set_model_file(written->model_file);
      for (const model::WrittenShard::File& f : written->files) {
        CheckpointFile* file = shard.add_files();
        file->set_name(f.name);
        file->set_bytes(f.bytes);
        file->set_crc32(f.crc32);
      }
      for (const std::string& t : written->tensors) shard.add_tensors(t);
      if (publish_) {
        if (absl::Status published = publish_(&shard); !published.ok()) {
          shard.set_error(std::string(published.message()));
          GT_LOG(WARNING) << "checkpoint of step " << shard.step() << " by actor " << shard.actor_id()
                          << " not copied: " << published.message();
        }
      }
      shard.set_write_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    } else {
      shard.set_error(std::string(written.status().message()));
      GT_LOG(WARNING) << "checkpoint of step " << shard.step() << " by actor " << shard.actor_id()
                      << " failed: " << written.status().message();
    }
    absl::MutexLock lock(&mu_);
    finished_.push_back(std::move(shard));
    has_job_ = false;
  }
}

}  // namespace geotrain::worker
