// Stage actors of one job in one process: real tensor streams (one gRPC server and mailbox per actor on
// loopback), an in-memory head that records the step reports, and injected collectives. The job's losses
// must equal the single-process LocalTrainer's; a stop ends every actor; a peer that fails makes the job
// end with its error, by the collective deadline at the latest.
#include "worker/stage_actor.h"

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

namespace geotrain::worker {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "stage-actor-test-token";

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
    return reply;
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

  mutable absl::Mutex mu_;
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

// A communicator whose sends fail from the n-th on: a peer whose link or process failed.
class FailingCommunicator : public comm::Communicator {
 public:
  FailingCommunicator(comm::Communicator* inner, int fail_from_send) : inner_(inner), fail_from_(fail_from_send) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(absl::Span<float> d, std::string_view tag) override { return inner_->AllReduceSum(d, tag); }
  absl::Status ReduceScatter(absl::Span<const float> in, absl::Span<float> out, std::string_view tag) override {
    return inner_->ReduceScatter(in, out, tag);
  }
  absl::Status AllGather(absl::Span<const float> in, absl::Span<float> out, std::string_view tag) override {
    return inner_->AllGather(in, out, tag);
  }
  absl::Status Broadcast(absl::Span<float> d, int root, std::string_view tag) override {
    return inner_->Broadcast(d, root, tag);
  }
  absl::Status Send(int peer, absl::Span<const float> d, std::string_view tag) override {
    if (++sends_ >= fail_from_) return absl::UnavailableError("injected: the link to the next stage is down");
    return inner_->Send(peer, d, tag);
  }
  absl::Status Recv(int peer, absl::Span<float> d, std::string_view tag) override { return inner_->Recv(peer, d, tag); }

 private:
  comm::Communicator* inner_;
  const int fail_from_;
  std::atomic<int> sends_{0};
};

// The gRPC collectives, with the pipeline's sends failing from the n-th on.
class FailingFactory : public CollectivesFactory {
 public:
  FailingFactory(std::unique_ptr<CollectivesFactory> inner, int fail_from_send)
      : inner_(std::move(inner)), fail_from_(fail_from_send) {}
  absl::StatusOr<std::unique_ptr<StageCollectives>> Create(const ActorRanks& ranks, const JobSpec& spec,
                                                           const std::vector<ActorPeer>& actors,
                                                           model::Backend* backend, int device_index) override {
    auto made = inner_->Create(ranks, spec, actors, backend, device_index);
    if (!made.ok()) return made.status();
    return std::unique_ptr<StageCollectives>(new Wrapped(std::move(*made), fail_from_));
  }

 private:
  class Wrapped : public StageCollectives {
   public:
    Wrapped(std::unique_ptr<StageCollectives> inner, int fail_from) : inner_(std::move(inner)) {
      static_cast<StageCollectives&>(*this) = *inner_;  // copy the pointers and flags
      failing_ = std::make_unique<FailingCommunicator>(inner_->pipeline, fail_from);
      pipeline = failing_.get();
    }
    uint64_t BytesSent(TrafficClass traffic) const override { return inner_->BytesSent(traffic); }
    void CancelReceives(bool stopped) override { inner_->CancelReceives(stopped); }

   private:
    std::unique_ptr<StageCollectives> inner_;
    std::unique_ptr<FailingCommunicator> failing_;
  };
  std::unique_ptr<CollectivesFactory> inner_;
  const int fail_from_;
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
  std::vector<model::StepRecord> LocalHistory(JobSpec spec) {
    spec.mutable_parallel()->set_pp(1);
    spec.mutable_parallel()->set_tp(1);
    model::LocalTrainer trainer;
    model::LocalTrainOptions options;
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
          auto mailbox = std::make_unique<comm::TensorStreamServer>(kToken);
          grpc::ServerBuilder builder;
          int port = 0;
          builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
          mailbox->Register(&builder);
          servers_.push_back(builder.BuildAndStart());
          ASSERT_NE(port, 0);
          mailboxes_.push_back(std::move(mailbox));
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

TEST_F(StageActorTest, PipelineGPipeEqualsLocal) { ExpectEqualToLocal(Spec(1, 2, 1, 4, "gpipe", 4)); }

TEST_F(StageActorTest, PipelineOneFOneBEqualsLocal) { ExpectEqualToLocal(Spec(1, 2, 1, 4, "1f1b", 4)); }

TEST_F(StageActorTest, DeeperOneFOneBEqualsLocal) {
  JobSpec spec = Spec(1, 2, 1, 4, "1f1b", 3);
  spec.mutable_parallel()->set_pipeline_depth(4);
  ExpectEqualToLocal(spec);
}

TEST_F(StageActorTest, DataParallelBucketsEqualLocal) { ExpectEqualToLocal(Spec(2, 1, 1, 2, "1f1b", 4)); }

TEST_F(StageActorTest, DataAndPipelineAcrossTwoSitesEqualLocal) { ExpectEqualToLocal(Spec(2, 2, 1, 2, "1f1b", 3)); }

// Four replicas in two sites (alternating, so that a flat ring over them would cross the sites at every hop): the
// gradient all-reduce is hierarchical, each site's sum crossing once each way per step (twice the model's fp32
// bytes over both directions, where the ring of four would send six times them), and training equals local.
TEST_F(StageActorTest, DataParallelAcrossTwoSitesSendsEachSitesSumAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(4, 1, 1, 1, "1f1b", 3));
}

// Two pipelines of two stages, one per site: the tied embedding's four copies are summed by one all-reduce, each
// site's two copies crossing once each way, and the stages' buckets leave wte out (it used to cross once per
// stage: 1.5x the model's bytes each way for this model).
TEST_F(StageActorTest, TiedEmbeddingOfPipelinesInTwoSitesCrossesOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 2, 1, 2, "1f1b", 3));
}

// Two replicas of two tensor-parallel ranks, one replica per site: each tp rank's data-parallel pair sums only its
// half of the replicated tensors (the embeddings above all) and gathers the other half from its tp peer inside the
// site, so every gradient crosses once each way (each tp rank's pair used to send all of them: 1.4x the model's
// bytes each way for this model).
TEST_F(StageActorTest, TensorParallelReplicasInTwoSitesSendEachGradientAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 1, 2, 2, "1f1b", 3));
}

// The same with pipelines of two stages: the tied all-reduce of wte sums each tp rank's half of it too.
TEST_F(StageActorTest, TensorParallelPipelinesInTwoSitesSendEachGradientAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 2, 2, 2, "1f1b", 3));
}

TEST_F(StageActorTest, TensorParallelEqualsLocal) { ExpectEqualToLocal(Spec(1, 1, 2, 2, "1f1b", 3)); }

// Validation on the cluster: each replica's last stage evaluates its slice of data.val through the
// pipeline; the mean over replicas equals `train --local`'s validation loss.
TEST_F(StageActorTest, ValidationLossOfDataAndPipelineEqualsLocal) {
  ExpectEqualToLocal(WithValidation(Spec(2, 2, 1, 2, "1f1b", 4), 2, 3));
}

// The validation set does not depend on the plan: two pipelined replicas of two microbatches each report the
// validation loss that one process without microbatches computes (eval_batches global batches of data.val).
TEST_F(StageActorTest, ValidationLossEqualsLocalUnderAnotherPlan) {
  const JobSpec reference = WithValidation(Spec(1, 1, 1, 1, "1f1b", 4), 2, 3);
  ExpectEqualToLocal(WithValidation(Spec(2, 2, 1, 2, "1f1b", 4), 2, 3), 1e-4, &reference);
}

TEST_F(StageActorTest, ValidationLossWithTensorParallelEqualsLocal) {
  ExpectEqualToLocal(WithValidation(Spec(1, 1, 2, 2, "1f1b", 3), 3, 2));
}

// DiLoCo across the two sites equals the one-process simulation of the same algorithm (train --local with
// the same diloco block): one replica per site (exact up to summation order), with momentum and Nesterov.
TEST_F(StageActorTest, DilocoAcrossTwoSitesEqualsLocalSimulation) {
  ExpectEqualToLocal(WithValidation(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 7), 3, 1, "none"), 2, 2));
}

// diloco.inner_lr_scale: the stages' inner AdamW takes the scaled (capped) schedule, as the simulation does, and the
// scale changes the training (so the equality above is not of two runs that ignore it).
TEST_F(StageActorTest, DilocoInnerLearningRateScaleEqualsLocalSimulation) {
  const JobSpec plain = WithDiloco(Spec(2, 1, 1, 2, "1f1b", 7), 3, 1, "none");
  JobSpec scaled = plain;
  scaled.mutable_diloco()->set_inner_lr_scale(1.5);
  ExpectEqualToLocal(scaled);
  const std::vector<float> with = LocalLosses(scaled), without = LocalLosses(plain);
  ASSERT_EQ(with.size(), without.size());
  EXPECT_EQ(with[0], without[0]);  // the first step's loss comes before any update
  EXPECT_GT(std::abs(with.back() - without.back()), 1e-4);
}

// Two replicas per site: synchronous inside each site, outer steps across; pipelines of two stages.
TEST_F(StageActorTest, DilocoGroupsOfTwoPipelinedEqualLocalSimulation) {
  ExpectEqualToLocal(WithDiloco(Spec(4, 2, 1, 1, "1f1b", 4), 2, 1, "none"), 1e-4);
}

// Streaming DiLoCo: two fragments synced in turn, each exchange overlapped with the next step.
TEST_F(StageActorTest, DilocoFragmentsOverlappedEqualLocalSimulation) {
  ExpectEqualToLocal(WithValidation(WithDiloco(Spec(2, 2, 1, 2, "1f1b", 8), 4, 2, "none"), 4, 1));
}

// Tensor parallelism inside the sites: each tp rank's leaders exchange their shard's pseudo-gradient, and tp rank
// 0's the replicated tensors' too, which it hands to the other rank inside the site; the job equals the simulation.
// With int8 the replicated part is rounded once, by tp rank 0: the outer bytes across are the model's once each
// way per outer step (in int8: 1 + 4/256 bytes a value), where every tp rank sent the replicated tensors before.
TEST_F(StageActorTest, DilocoWithTensorParallelismEqualsLocalSimulation) {
  ExpectEqualToLocal(WithDiloco(Spec(2, 1, 2, 2, "1f1b", 4), 2, 1, "none"), 1e-5);
}

TEST_F(StageActorTest, DilocoWithTensorParallelismSendsTheReplicatedTensorsOnce) {
  const JobSpec spec = WithDiloco(Spec(2, 1, 2, 2, "1f1b", 4), 2, 1, "int8");
  StartJob(spec, 30000);
  ASSERT_TRUE(WaitFinished(120));
  double outer_bytes = 0;
  for (const StepReport& r : head_.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.error();
    for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair()) outer_bytes += static_cast<double>(bytes);
  }
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset("gpt2-tiny-test");
  ASSERT_TRUE(config.ok());
  const double int8_model = static_cast<double>(config->NumParameters()) * (1 + 4.0 / 256);
  // Two outer steps in 4 steps (inner_steps 2), each sending the model once each way.
  EXPECT_GE(outer_bytes, 2 * 2 * int8_model);
  EXPECT_LT(outer_bytes, 2 * 2 * int8_model * 1.05);
  const std::vector<float> losses = ReportedLosses();
  const std::vector<float> rounded = LocalLosses(spec);
  ASSERT_EQ(losses.size(), rounded.size());
  EXPECT_NEAR(losses.back(), rounded.back(), 1e-3 * rounded.back());  // tp packs the fragments otherwise
}

// A lossy codec for the pseudo-gradients (int8): the job equals the simulation that rounds each site's
// pseudo-gradient as the cluster's pair exchange does, trains (loss falls), and stays near the exact run; the
// rounding is real (the simulation with it differs from the exact one).
TEST_F(StageActorTest, DilocoWithInt8PseudoGradientsEqualsTheRoundingSimulation) {
  const JobSpec spec = WithValidation(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, "int8"), 3, 2);
  // To 5e-7: the rounding moves the losses by about 2e-6 of themselves from step 3 (the first after an outer step),
  // the cluster stays within 1e-7 of the simulation that rounds.
  ExpectEqualToLocal(spec, 5e-7);
  const std::vector<float> losses = ReportedLosses(), rounded = LocalLosses(spec),
                           exact = LocalLosses(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, "none"));
  ASSERT_EQ(losses.size(), exact.size());
  EXPECT_LT(losses.back(), losses.front());
  EXPECT_NEAR(losses.back(), exact.back(), 0.02 * exact.back());
  EXPECT_NE(rounded.back(), exact.back());
  uint64_t outer_bytes = 0;
  for (const StepReport& r : head_.reports()) {
    for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair()) outer_bytes += bytes;
  }
  EXPECT_GT(outer_bytes, 0u);  // the outer exchanges cross the sites, and are counted
}

// int4 and sparse pseudo-gradients, with their error feedback (kept per fragment by the leaders' communicator, per
// group and fragment by the simulation): the job equals the simulation that rounds them alike (ExpectLowBitOuter).
TEST_F(StageActorTest, DilocoWithInt4PseudoGradientsEqualsTheRoundingSimulation) { ExpectLowBitOuter("int4"); }

TEST_F(StageActorTest, DilocoWithSparsePseudoGradientsEqualsTheRoundingSimulation) { ExpectLowBitOuter("sparse"); }

// diloco.sync time with site-b's CPU slowed 4x (the worker's --slowdown): the first two steps are count-paced (nothing
// measured yet), then the groups' times of those two plan the rest of the first period, and each outer step plans the
// next period: the group measured slower takes one inner step a step, and each step's tokens are every group's inner
// steps' tokens. The groups meet after step 2 (to plan) and at every outer step. Every actor ends
// cleanly.
TEST_F(StageActorTest, DilocoPacedByTimePlansFromMeasuredTimesAndCountsEveryGroupsTokens) {
  RunTimePacedWithSiteBSlowed(Spec(2, 1, 1, 2, "1f1b", 8), "none");
  std::map<int64_t, std::map<std::string, StepFigures>> by_step;  // step -> site -> figures
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() > 0) by_step[r.step()][r.actor_id().find("r0") != std::string::npos ? "a" : "b"] = r.figures();
  }
  ASSERT_EQ(by_step.size(), 8u);
  const int64_t replica_tokens = 4 * 16;  // global batch 8 over two replicas, 16 tokens each
  int inner_a = 0, inner_b = 0;           // over steps 3-8, the planned ones
  for (const auto& [step, sites] : by_step) {
    ASSERT_EQ(sites.size(), 2u) << step;
    const StepFigures &a = sites.at("a"), &b = sites.at("b");
    // Whichever group the plan found slower (the times are measured, on a machine that may be busy) takes one.
    EXPECT_EQ(std::min(a.inner_steps(), b.inner_steps()), 1) << step;
    EXPECT_EQ(b.slowdown(), 4) << step;
    EXPECT_EQ(a.slowdown(), 0) << step;
    if (step <= 2) EXPECT_EQ(a.inner_steps(), 1) << step;
    if (step > 2) inner_a += a.inner_steps(), inner_b += b.inner_steps();
    EXPECT_GE(a.inner_steps(), 1) << step;
    EXPECT_EQ(a.replica_tokens(), a.inner_steps() * replica_tokens) << step;
    EXPECT_EQ(a.tokens(), (a.inner_steps() + b.inner_steps()) * replica_tokens) << step;
    EXPECT_EQ(b.tokens(), a.tokens()) << step;
    EXPECT_TRUE(std::isfinite(a.loss()) && std::isfinite(b.loss())) << step;
    EXPECT_EQ(a.outer_sync_seconds() > 0, step == 2 || step % 4 == 0) << step;
  }
  // Which site takes more depends on the times measured (this test runs beside others; runtime_unequal_sites checks
  // that a site 6x slower takes fewer, with real processes): here only the cap of 8x holds whatever they were.
  EXPECT_LE(inner_a + inner_b, 6 * 9);
}

// The same with two pipeline stages per replica and a short last period (10 steps, inner_steps 4): a replica's
// stages take the same inner steps in every step (they share one plan), or the pipeline would hang.
TEST_F(StageActorTest, DilocoPacedByTimeKeepsAReplicasStagesInStep) {
  RunTimePacedWithSiteBSlowed(Spec(2, 2, 1, 2, "1f1b", 10), "int8");
  std::map<std::pair<int64_t, char>, std::set<int>> inner;  // (step, replica) -> the inner steps its stages took
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() > 0) inner[{r.step(), r.actor_id()[7]}].insert(r.figures().inner_steps());  // "job-1-r0s1t0"
  }
  ASSERT_EQ(inner.size(), 20u);
  std::map<int64_t, int> fewest;  // step -> the fewer inner steps of the two replicas
  for (const auto& [key, counts] : inner) {
    EXPECT_EQ(counts.size(), 1u) << "step " << key.first << " replica " << key.second;
    auto [it, first] = fewest.try_emplace(key.first, *counts.begin());
    if (!first) it->second = std::min(it->second, *counts.begin());
  }
  // Whichever group the plan found slower (measured times, on a machine that may be busy) takes one a step.
  for (const auto& [step, n] : fewest) EXPECT_EQ(n, 1) << step;
}

// Timed compute takes DiLoCo jobs for their timing: the steps are emulated (no loss), and the outer steps send the
// (zero) pseudo-gradients across the sites at their real size, every inner_steps steps only.
TEST_F(StageActorTest, DilocoOnTimedComputeExchangesAtTheOuterStepsOnly) {
  device_ = "timed:H100@400:2680:5";
  StartJob(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 3, 1, "int8"), 30000);
  ASSERT_TRUE(WaitFinished(120));
  for (auto& a : actors_) EXPECT_EQ(a->Record().message(), "finished");
  int reports = 0;
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() == 0) continue;
    ++reports;
    EXPECT_TRUE(r.figures().timed_compute()) << r.step();
    EXPECT_EQ(r.figures().wan_bytes() > 0, r.step() % 3 == 0) << r.actor_id() << " step " << r.step();
  }
  EXPECT_EQ(reports, 12);
}

// fp16 with a scale far too large (2^40) on DP2 x PP2 across two "sites": the first steps overflow; every actor of
// the job skips exactly those steps and halves the scale each time (one decision, from the all-reduced gradient
// norm), then the job trains; its losses equal the single-process simulation's, which skips the same steps.
TEST_F(StageActorTest, Fp16OverflowSkipsTheSameStepsOnEveryActorAndEqualsLocal) {
  JobSpec spec = WithValidation(Spec(2, 2, 1, 2, "1f1b", 20), 10, 1);
  spec.mutable_train()->set_precision("fp16");
  spec.mutable_train()->mutable_loss_scale()->set_initial(std::ldexp(1.0, 40));
  ExpectEqualToLocal(spec, 1e-5);
  const std::vector<model::StepRecord> local = LocalHistory(spec);
  int skips = 0;
  for (const model::StepRecord& r : local) skips += r.skipped;
  ASSERT_GE(skips, 2);
  std::map<std::string, int> reports_of;
  for (const StepReport& r : head_.reports()) {
    if (r.step() == 0 || !r.error().empty()) continue;
    const model::StepRecord& want = local[r.step() - 1];
    EXPECT_EQ(r.figures().skipped(), want.skipped) << r.actor_id() << " step " << r.step();
    EXPECT_EQ(r.figures().loss_scale(), want.loss_scale) << r.actor_id() << " step " << r.step();
    ++reports_of[r.actor_id()];
  }
  EXPECT_EQ(reports_of.size(), 4u);
  for (const auto& [actor, n] : reports_of) EXPECT_EQ(n, 20) << actor;
  for (int i = 0; i < skips; ++i) EXPECT_EQ(local[i].loss_scale, std::ldexp(1.0, 40 - i));
  EXPECT_FALSE(local.back().skipped);
}

TEST_F(StageActorTest, AStopInTheMiddleEndsEveryActorWithoutAnError) {
  head_.StopFromStep(2);  // the head answers step 2's reports with stop
  StartJob(Spec(1, 2, 1, 2, "1f1b", 50), 5000);
  ASSERT_TRUE(WaitFinished(30));
  int64_t last_step = 0;
  for (const StepReport& r : head_.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.error();  // a stopped actor reports no error
    last_step = std::max(last_step, r.step());
  }
  EXPECT_LT(last_step, 50);
  for (auto& a : actors_) {
    EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
    EXPECT_THAT(a->Record().message(), HasSubstr("stop"));
  }
}

// A drain: every actor stops after the same step T, the last report of each says so (drained), replica 0's carry
// their stage's checkpoint shard of T, written into the directory the head named (the job has none of its own), and
// no actor trains past T. With the target moved once (an actor passed it unaware), the actors waiting at the first
// target train on to the second.
void ExpectDrainedAtOneStep(const RecordingHead& head, int64_t target, const std::string& dir) {
  std::map<std::string, const StepReport*> last;
  std::map<std::string, int64_t> newest_step;
  for (const StepReport& r : head.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    newest_step[r.actor_id()] = std::max(newest_step[r.actor_id()], r.step());
  }
  const std::vector<StepReport> reports = head.reports();
  for (const StepReport& r : reports) last[r.actor_id()] = &r;
  ASSERT_EQ(last.size(), 4u);
  int shards = 0;
  for (const auto& [actor, report] : last) {
    EXPECT_EQ(newest_step[actor], target) << actor << " trained past the drain's step";
    EXPECT_TRUE(report->drained()) << actor;
    EXPECT_EQ(report->drain_at_step(), target) << actor;
    for (const CheckpointShard& shard : report->checkpoints()) {
      EXPECT_EQ(shard.step(), target);
      EXPECT_TRUE(shard.error().empty()) << shard.error();
      EXPECT_EQ(shard.dir(), model::StepDirectory(dir, target));
      ++shards;
    }
  }
  EXPECT_EQ(shards, 2) << "replica 0's two stages";
  EXPECT_TRUE(std::filesystem::exists(model::StepDirectory(dir, target) + "/model-s0.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(model::StepDirectory(dir, target) + "/model-s1.safetensors"));
}

TEST_F(StageActorTest, ADrainEndsEveryActorAfterOneStepWithItsCheckpoint) {
  const std::string dir = dir_ + "/drain-ckpt";
  head_.DrainFromStep(3, 4, /*move_once=*/false, dir);
  StartJob(Spec(2, 2, 1, 2, "1f1b", 40), 20000);
  ASSERT_TRUE(WaitFinished(60));
  const int64_t target = head_.drain_target();
  ASSERT_GE(target, 5);
  ExpectDrainedAtOneStep(head_, target, dir);
  for (auto& a : actors_) {
    EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
    EXPECT_THAT(a->Record().message(), HasSubstr(absl::StrCat("stopped after step ", target, " for a drain")));
  }
}

TEST_F(StageActorTest, ADrainWhoseStepMovesOnTrainsOnToTheNextOne) {
  const std::string dir = dir_ + "/drain-ckpt";
  head_.DrainFromStep(3, 4, /*move_once=*/true, dir);
  StartJob(Spec(2, 2, 1, 2, "1f1b", 40), 20000);
  ASSERT_TRUE(WaitFinished(60));
  const int64_t target = head_.drain_target();
  ASSERT_GE(target, 7);
  ExpectDrainedAtOneStep(head_, target, dir);
}

TEST_F(StageActorTest, APeerThatFailsEndsTheJobWithItsErrorByTheDeadline) {
  const auto start = std::chrono::steady_clock::now();
  // Stage 0 can send 3 tensors (1.5 steps of 2 microbatches), then its link fails.
  StartJob(Spec(1, 2, 1, 2, "1f1b", 20), 2000, [](int rank, comm::TensorStreamServer* mailbox) {
    std::unique_ptr<CollectivesFactory> grpc =
        std::make_unique<GrpcCollectivesFactory>(mailbox, kToken, nullptr, absl::Milliseconds(2000));
    if (rank != 0) return grpc;
    return std::unique_ptr<CollectivesFactory>(new FailingFactory(std::move(grpc), 4));
  });
  ASSERT_TRUE(WaitFinished(30));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::map<std::string, std::string> errors;
  for (const StepReport& r : head_.reports()) {
    if (!r.error().empty()) errors[r.actor_id()] = r.error();
  }
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_THAT(errors["job-1-r0s0t0"], HasSubstr("injected"));
  EXPECT_THAT(errors["job-1-r0s1t0"], HasSubstr("job-1"));  // waited for stage 0's activations: a deadline
  EXPECT_LT(seconds, 20.0);
  for (auto& a : actors_) EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
}

}  // namespace
}  // namespace geotrain::worker
