// The in-process harness of the stage actor tests (stage_actor_test.cc: equivalences with the one-process trainer;
// stage_actor_faults_test.cc: stops, drains, failing peers, live regroups): every actor of a job in this process on
// real tensor streams (one gRPC server and mailbox per actor on loopback), an in-memory head that records the step
// reports and answers as the real head does (drains, regroups), and injectable collectives.
#pragma once

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/codec.h"
#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/data.h"
#include "model/trainer.h"
#include "worker/stage_actor.h"

namespace geotrain::worker::actor_testing {

inline constexpr char kToken[] = "stage-actor-test-token";

// The head as the actors see it: records every report; asks an actor to stop from a given step on; drains the job
// as the real head does (head/job_drain.h, in short): from a given step on, the actors leave two steps after the
// newest one reported, once every actor has reported knowing that step before passing it.
class RecordingHead : public HeadClient {
 public:
  absl::StatusOr<ReportStepReply> ReportStep(const StepReport& report, absl::Duration) override {
    absl::MutexLock lock(&mu_);
    reports_.push_back(report);
    ReportStepReply reply;
    reply.set_stop(stop_from_step_ > 0 && report.step() >= stop_from_step_);
    if (drain_from_step_ > 0) Drain(report, &reply);
    if (!regroup_replicas_.empty()) RegroupReply(report, &reply);
    return reply;
  }

  // Regroups the job as the real head does (head/job_regroup.h, in short): the first actor that waits for a regroup
  // starts membership 1 of `replicas`; once each of their `actors` waits in it at the same completed step, it is
  // confirmed, to resume at the step after.
  void RegroupTo(std::vector<int> replicas, int actors) {
    absl::MutexLock lock(&mu_);
    regroup_replicas_ = std::move(replicas);
    regroup_actors_ = actors;
  }
  int64_t regroup_epoch() const {
    absl::MutexLock lock(&mu_);
    return epoch_;
  }
  int64_t resume_step() const {
    absl::MutexLock lock(&mu_);
    return confirmed_ ? resume_ : 0;
  }
  internal::HeadControl::StubInterface* stub() override { return nullptr; }

  void StopFromStep(int64_t step) {
    absl::MutexLock lock(&mu_);
    stop_from_step_ = step;
  }
  // Drains the job of `actors` actors once a report of `step` comes in; with `move_once`, the first actor to reach
  // the target moves it two steps later (as when an actor passed it unaware), so the waiting actors train on.
  void DrainFromStep(int64_t step, int actors, bool move_once, const std::string& checkpoint_dir) {
    absl::MutexLock lock(&mu_);
    drain_from_step_ = step;
    actors_ = actors;
    move_once_ = move_once;
    checkpoint_dir_ = checkpoint_dir;
  }
  int64_t drain_target() const {
    absl::MutexLock lock(&mu_);
    return target_;
  }
  std::vector<StepReport> reports() const {
    absl::MutexLock lock(&mu_);
    return reports_;
  }

 private:
  void Drain(const StepReport& report, ReportStepReply* reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    newest_ = std::max(newest_, report.step());
    if (target_ == 0 && newest_ >= drain_from_step_) target_ = newest_ + 2;
    if (target_ > 0 && !report.drain_waiting() && !report.drained() && report.step() > 0) {
      if (report.drain_at_step() == target_ && report.step() <= target_) {
        if (move_once_ && report.step() == target_) {
          move_once_ = false;
          target_ += 2;
          bound_.clear();
        } else {
          bound_.insert(report.actor_id());
        }
      } else if (report.step() >= target_) {  // passed unaware: a later step, every binding starts over
        target_ = newest_ + 2;
        bound_.clear();
      }
    }
    reply->set_drain_at_step(target_);
    reply->set_drain_confirmed(target_ > 0 && static_cast<int>(bound_.size()) == actors_);
    reply->set_drain_checkpoint_dir(checkpoint_dir_);
  }

  void RegroupReply(const StepReport& report, ReportStepReply* reply) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (report.regroup_waiting()) {
      if (epoch_ == 0) epoch_ = 1;
      if (report.epoch() == epoch_ && !confirmed_) {
        ready_[report.actor_id()] = report.completed_step();
        if (static_cast<int>(ready_.size()) == regroup_actors_) {
          std::set<int64_t> steps;
          for (const auto& [actor, step] : ready_) steps.insert(step);
          confirmed_ = steps.size() == 1;
          resume_ = *steps.begin() + 1;
        }
      }
    }
    if (epoch_ == 0) return;
    Regroup* r = reply->mutable_regroup();
    r->set_epoch(epoch_);
    for (int x : regroup_replicas_) r->add_replicas(x);
    r->set_confirmed(confirmed_);
    r->set_resume_step(confirmed_ ? resume_ : 0);
  }

  mutable absl::Mutex mu_;
  std::vector<int> regroup_replicas_ ABSL_GUARDED_BY(mu_);
  int regroup_actors_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0, resume_ ABSL_GUARDED_BY(mu_) = 0;
  bool confirmed_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, int64_t> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<StepReport> reports_ ABSL_GUARDED_BY(mu_);
  int64_t stop_from_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t drain_from_step_ ABSL_GUARDED_BY(mu_) = 0, target_ ABSL_GUARDED_BY(mu_) = 0, newest_ ABSL_GUARDED_BY(mu_) = 0;
  int actors_ ABSL_GUARDED_BY(mu_) = 0;
  bool move_once_ ABSL_GUARDED_BY(mu_) = false;
  std::string checkpoint_dir_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> bound_ ABSL_GUARDED_BY(mu_);
};

// A head client for one actor, forwarding to the shared RecordingHead.
class HeadView : public HeadClient {
 public:
  explicit HeadView(RecordingHead* head) : head_(head) {}
  absl::StatusOr<ReportStepReply> ReportStep(const StepReport& report, absl::Duration timeout) override {
    return head_->ReportStep(report, timeout);
  }
  internal::HeadControl::StubInterface* stub() override { return nullptr; }

 private:
  RecordingHead* head_;
};

class StageActorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / absl::StrCat("geotrain_stage_actor_test_", ::getpid())).string();
    std::filesystem::create_directories(dir_);
    std::mt19937 rng(5);
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 20000; ++i) tokens.push_back(rng() % 10 == 0 ? rng() % 512 : (i * 7) % 97);
    ASSERT_TRUE(model::WriteTokenShard(dir_ + "/train_000000.bin", tokens).ok());
    std::vector<uint16_t> val;
    for (int i = 0; i < 4000; ++i) val.push_back(rng() % 10 == 0 ? rng() % 512 : (i * 5) % 89);
    ASSERT_TRUE(model::WriteTokenShard(dir_ + "/val_000000.bin", val).ok());
  }
  void TearDown() override {
    actors_.clear();
    for (auto& s : servers_) s->Shutdown();
    for (auto& m : mailboxes_) m->Shutdown();
    std::filesystem::remove_all(dir_);
  }

  JobSpec Spec(int dp, int pp, int tp, int microbatches, const std::string& schedule, int steps) {
    JobSpec spec;
    spec.set_name("in-process");
    spec.mutable_model()->set_preset("gpt2-tiny-test");
    spec.mutable_data()->set_train(dir_ + "/train_*.bin");
    TrainSpec* t = spec.mutable_train();
    t->set_global_batch(8);
    t->set_seq_len(16);
    t->set_steps(steps);
    t->set_lr(1e-3);
    t->set_warmup_steps(2);
    t->set_weight_decay(0.1);
    t->set_grad_clip(1.0);
    t->set_seed(11);
    ParallelSpec* p = spec.mutable_parallel();
    p->set_plan("manual");
    p->set_dp(dp);
    p->set_pp(pp);
    p->set_tp(tp);
    p->set_microbatches(microbatches);
    p->set_schedule(schedule);
    spec.mutable_comm()->set_wan_codec("none");
    spec.mutable_comm()->set_grad_bucket_mb(0.002);  // a bucket per block: overlapped all-reduces
    ApplyJobDefaults(&spec);
    return spec;
  }

  // With validation every `every` steps (and at the last) over `batches` batches of data.val.
  JobSpec WithValidation(JobSpec spec, int every, int batches) {
    spec.mutable_data()->set_val(dir_ + "/val_*.bin");
    spec.mutable_train()->set_eval_every(every);
    spec.mutable_train()->set_eval_batches(batches);
    return spec;
  }

  // DiLoCo over the test's two sites (replicas alternate between them, as StartJob places them).
  JobSpec WithDiloco(JobSpec spec, int inner_steps, int fragments, const std::string& codec) {
    DilocoSpec* d = spec.mutable_diloco();
    d->set_inner_steps(inner_steps);
    d->set_fragments(fragments);
    d->set_codec(codec);
    for (int r = 0; r < spec.parallel().dp(); ++r) {
      PlacementSpec* p = spec.mutable_parallel()->add_placement();
      p->set_replica(r);
      p->set_site(r % 2 == 0 ? "site-a" : "site-b");
    }
    ApplyJobDefaults(&spec);
    EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
    return spec;
  }

  // `spec` with DiLoCo paced by time (inner_steps 4) over the two sites, site-b's actors slowed 4x, run to its end.
  void RunTimePacedWithSiteBSlowed(const JobSpec& spec, const std::string& codec) {
    JobSpec paced = WithDiloco(spec, 4, 1, codec);
    paced.mutable_diloco()->set_sync("time");
    ASSERT_TRUE(ValidateJobSpec(paced).ok()) << ValidateJobSpec(paced);
    slowdown_by_site_["site-b"] = 4;
    StartJob(paced, 30000);
    ASSERT_TRUE(WaitFinished(120));
    for (auto& a : actors_) EXPECT_EQ(a->Record().message(), "finished");
  }

  // The reference: the same spec in one process (dp replicas' microbatches of the same size, simulated; DiLoCo's
  // pseudo-gradients rounded by its codec as `train --local` rounds them).
  std::vector<model::StepRecord> LocalHistory(JobSpec spec, model::LocalTrainOptions options = {}) {
    spec.mutable_parallel()->set_pp(1);
    spec.mutable_parallel()->set_tp(1);
    model::LocalTrainer trainer;
    absl::StatusOr<std::function<absl::Status(int, int, absl::Span<float>)>> outer_codec = SimulatedOuterCodec(spec);
    EXPECT_TRUE(outer_codec.ok()) << outer_codec.status();
    if (outer_codec.ok()) options.outer_codec = *outer_codec;
    options.out = std::fopen("/dev/null", "w");
    absl::Status s = trainer.Run(spec, options);
    std::fclose(options.out);
    EXPECT_TRUE(s.ok()) << s;
    return trainer.history();
  }
  std::vector<float> LocalLosses(const JobSpec& spec) {
    std::vector<float> out;
    for (const model::StepRecord& r : LocalHistory(spec)) out.push_back(r.loss);
    return out;
  }

  // A mailbox of its own on a loopback port (mailboxes_.back()), served until TearDown; returns the port (0: none).
  int StartMailbox() {
    auto mailbox = std::make_unique<comm::TensorStreamServer>(kToken);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    mailbox->Register(&builder);
    servers_.push_back(builder.BuildAndStart());
    mailboxes_.push_back(std::move(mailbox));
    return port;
  }

  // Starts every actor of `spec` in this process, two "sites" (replicas alternate between them);
  // `factory_for` may inject collectives per world rank.
  void StartJob(
      const JobSpec& spec, int64_t collective_timeout_ms,
      std::function<std::unique_ptr<CollectivesFactory>(int rank, comm::TensorStreamServer*)> factory_for = nullptr) {
    const int dp = spec.parallel().dp(), pp = spec.parallel().pp(), tp = spec.parallel().tp();
    std::vector<ActorPeer> peers;
    for (int r = 0; r < dp; ++r) {
      for (int s = 0; s < pp; ++s) {
        for (int t = 0; t < tp; ++t) {
          const int port = StartMailbox();
          ASSERT_NE(port, 0);
          ActorPeer p;
          p.set_actor_id(absl::StrCat("job-1-r", r, "s", s, "t", t));
          p.set_replica(r);
          p.set_stage(s);
          p.set_tp_rank(t);
          p.set_worker_id(p.actor_id());
          p.set_site(r % 2 == 0 ? "site-a" : "site-b");
          p.set_address(absl::StrCat("127.0.0.1:", port));
          p.set_device_kind(DEVICE_KIND_CPU);
          peers.push_back(p);
        }
      }
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      StageActorConfig config;
      config.actor.set_actor_id(peers[i].actor_id());
      config.actor.set_job_id("job-1");
      config.actor.set_replica(peers[i].replica());
      config.actor.set_stage(peers[i].stage());
      config.actor.set_tp_rank(peers[i].tp_rank());
      config.spec = spec;
      config.peers = peers;
      config.site = peers[i].site();
      config.token = kToken;
      config.collective_timeout_ms = collective_timeout_ms;
      config.device = device_;
      if (auto slowed = slowdown_by_site_.find(config.site); slowed != slowdown_by_site_.end()) {
        config.slowdown = slowed->second;
      }
      ActorServices services;
      services.mailbox = mailboxes_[i].get();
      services.head = std::make_unique<HeadView>(&head_);
      if (factory_for) services.collectives = factory_for(static_cast<int>(i), mailboxes_[i].get());
      actors_.push_back(std::make_unique<StageActor>(config, std::move(services)));
    }
    for (auto& a : actors_) a->Start();
  }

  // Waits until every actor's thread has finished; false at the timeout.
  bool WaitFinished(double timeout_seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      bool all = true;
      for (auto& a : actors_) all = all && a->finished();
      if (all) {
        for (auto& a : actors_) all = all && a->DrainReports(absl::Seconds(10));
        return all;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // The job's loss per step as the head computes it: the mean over the loss carriers' reports (one, or one
  // per replica with DiLoCo); the validation loss: the mean over the reports that have one (-1: none).
  std::vector<float> ReportedLosses(bool validation = false) const {
    std::map<int64_t, std::pair<double, int>> by_step;
    for (const StepReport& r : head_.reports()) {
      if (!r.error().empty() || r.step() == 0) continue;
      auto& [sum, n] = by_step[r.step()];
      if (!validation && r.carries_loss()) sum += r.figures().loss(), ++n;
      if (validation && r.figures().val_loss() >= 0) sum += r.figures().val_loss(), ++n;
    }
    std::vector<float> out;
    for (const auto& [step, agg] : by_step) out.push_back(agg.second > 0 ? agg.first / agg.second : -1.0f);
    return out;
  }

  // The job's losses (and validation losses) equal `train --local`'s on the same spec (or on `reference_spec`,
  // the same job under another plan), to `relative`.
  void ExpectEqualToLocal(const JobSpec& spec, double relative = 1e-5, const JobSpec* reference_spec = nullptr) {
    StartJob(spec, 30000);
    ASSERT_TRUE(WaitFinished(120));
    for (const StepReport& r : head_.reports()) EXPECT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    for (auto& a : actors_) EXPECT_EQ(a->Record().message(), "finished");
    const std::vector<model::StepRecord> reference = LocalHistory(reference_spec != nullptr ? *reference_spec : spec);
    const std::vector<float> losses = ReportedLosses(), val = ReportedLosses(/*validation=*/true);
    ASSERT_EQ(losses.size(), reference.size());
    ASSERT_EQ(val.size(), reference.size());
    int evaluated = 0;
    for (size_t i = 0; i < losses.size(); ++i) {
      const float want = reference[i].loss, want_val = reference[i].val_loss;
      EXPECT_NEAR(losses[i], want, std::max(relative * std::abs(want), 1e-6)) << "step " << i + 1;
      if (want_val < 0) {
        EXPECT_LT(val[i], 0) << "step " << i + 1 << ": evaluated on the cluster only";
        continue;
      }
      ++evaluated;
      EXPECT_NEAR(val[i], want_val, std::max(relative * std::abs(want_val), 1e-6)) << "validation, step " << i + 1;
    }
    if (!spec.data().val().empty()) EXPECT_GT(evaluated, 0);
  }

  // A DiLoCo job of two sites whose pseudo-gradients go through `codec` (int4, sparse: lossy, with error feedback)
  // equals the simulation that rounds them alike (to 5e-7, as int8's), trains, differs from the exact exchange (the
  // rounding is real), and each of the two leaders sends each outer exchange's bytes as the codec counts them
  // (common/codec_spec.h CodecRawPayloadBytes, what the planner costs) and little more.
  void ExpectLowBitOuter(const std::string& codec) {
    const JobSpec spec = WithValidation(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, codec), 3, 2);
    ExpectEqualToLocal(spec, 5e-7);
    const std::vector<float> losses = ReportedLosses(), rounded = LocalLosses(spec),
                             exact = LocalLosses(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, "none"));
    ASSERT_EQ(losses.size(), exact.size());
    EXPECT_LT(losses.back(), losses.front()) << codec;
    EXPECT_NEAR(losses.back(), exact.back(), 0.05 * exact.back()) << codec;
    EXPECT_NE(rounded.back(), exact.back()) << codec;
    double outer_bytes = 0;
    for (const StepReport& r : head_.reports()) {
      for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair()) outer_bytes += static_cast<double>(bytes);
    }
    absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset("gpt2-tiny-test");
    absl::StatusOr<comm::Codec> parsed = comm::ParseCodec(EffectiveDiloco(spec).codec());
    ASSERT_TRUE(config.ok() && parsed.ok());
    const double exchange =
        static_cast<double>(comm::kCodecHeaderBytes + CodecRawPayloadBytes(*parsed, config->NumParameters()));
    // Three outer steps in 6 steps (inner_steps 2), each leader sending its share once.
    EXPECT_GE(outer_bytes, 3 * 2 * exchange) << codec;
    EXPECT_LT(outer_bytes, 3 * 2 * exchange * 1.05) << codec;
  }

  // `spec`'s job equals local, and each step every parameter's gradient crosses the two sites once each way (wte
  // once, however many copies): twice the model's fp32 bytes (uncompressed: the spec's wan_codec is none).
  void ExpectEveryGradientAcrossOnceAndEqualToLocal(const JobSpec& spec) {
    ExpectEqualToLocal(spec);
    absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset("gpt2-tiny-test");
    ASSERT_TRUE(config.ok());
    const double model_bytes = 4.0 * static_cast<double>(config->NumParameters());
    std::map<int64_t, double> wan_per_step;
    for (const StepReport& r : head_.reports()) {
      for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair())
        wan_per_step[r.step()] += static_cast<double>(bytes);
    }
    ASSERT_EQ(wan_per_step.size(), static_cast<size_t>(spec.train().steps()));
    for (const auto& [step, bytes] : wan_per_step) {
      EXPECT_GE(bytes, 2 * model_bytes) << "step " << step;
      EXPECT_LT(bytes, 2.05 * model_bytes) << "step " << step << ": more than every gradient once each way";
    }
  }

  std::string dir_;
  RecordingHead head_;
  std::vector<std::unique_ptr<comm::TensorStreamServer>> mailboxes_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::unique_ptr<StageActor>> actors_;
  std::map<std::string, double> slowdown_by_site_;  // StageActorConfig::slowdown of the actors at a site
  std::string device_ = "cpu";                      // every actor's StageActorConfig::device
};

}  // namespace geotrain::worker::actor_testing
