// Placement of a job's actors: order, pins, TP groups inside a site, memory refusal with the numbers; and the
// planning of `plan: auto` jobs with the job's WAN codec.
#include "head/placement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/spec.h"

namespace geotrain::head {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

WorkerInfo Worker(const std::string& id, const std::string& site, double mem_gb, int devices = 1) {
  WorkerInfo w;
  w.set_worker_id(id);
  w.set_site(site);
  w.set_state(WORKER_ALIVE);
  for (int d = 0; d < devices; ++d) {
    Device* dev = w.add_devices();
    dev->set_name("T4");
    dev->set_tflops(65);
    dev->set_memory_bytes(static_cast<uint64_t>(mem_gb * 1e9));
  }
  return w;
}

JobInfo Job(int dp, int pp, int tp) {
  JobInfo job;
  job.set_job_id("job-000007");
  JobSpec* spec = job.mutable_spec();
  spec->mutable_model()->set_preset("gpt2-tiny-test");
  spec->mutable_train()->set_global_batch(8);
  spec->mutable_train()->set_seq_len(16);
  spec->mutable_parallel()->set_plan("manual");
  spec->mutable_parallel()->set_dp(dp);
  spec->mutable_parallel()->set_pp(pp);
  spec->mutable_parallel()->set_tp(tp);
  spec->mutable_parallel()->set_microbatches(1);
  ApplyJobDefaults(spec);
  return job;
}

// A placed job's precision: auto by the oldest GPU; what a device cannot run is refused by name; fp16 needs a codec
// that carries its overflow steps' infinities (auto falls back to fp32 then); a GPU older than Turing runs nothing.
TEST(ChoosePrecisionTest, AutoExplicitCodecsAndTooOldGpus) {
  auto with_cc = [](WorkerInfo w, const std::string& name, int cc) {
    for (Device& d : *w.mutable_devices()) {
      d.set_name(name);
      d.set_compute_capability(cc);
    }
    return w;
  };
  std::vector<WorkerInfo> workers = {with_cc(Worker("w1", "utah", 16), "RTX6000", 75),
                                     with_cc(Worker("w2", "tacc", 16), "A30", 80)};
  JobInfo job = Job(2, 1, 1);
  auto placed = PlaceActors(job, workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  auto choice = ChoosePrecision(job.spec(), *placed, workers);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->precision, model::Precision::kFp16);
  EXPECT_THAT(choice->explanation, HasSubstr("site utah's RTX6000 (7.5) has no bf16"));
  job.mutable_spec()->mutable_train()->set_precision("bf16");
  EXPECT_THAT(ChoosePrecision(job.spec(), *placed, workers).status().message(),
              HasSubstr("bf16 needs compute capability 8.0; site utah's RTX6000 (7.5) supports fp16 and fp32"));
  job.mutable_spec()->mutable_train()->set_precision("fp16");
  job.mutable_spec()->mutable_comm()->set_wan_codec("int8");
  EXPECT_THAT(ChoosePrecision(job.spec(), *placed, workers).status().message(),
              HasSubstr("fp16 cannot train through the int8 codec"));
  job.mutable_spec()->mutable_train()->set_precision("auto");
  choice = ChoosePrecision(job.spec(), *placed, workers);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->precision, model::Precision::kFp32);
  EXPECT_THAT(choice->explanation, HasSubstr("cannot go through the int8 codec"));
  // Every gradients-only codec refuses infinities too, on the WAN or inside a site.
  for (const char* codec : {"topk:0.01", "int4", "int4+zstd", "sparse:0.02:2"}) {
    for (bool wan : {true, false}) {
      job.mutable_spec()->mutable_comm()->set_wan_codec(wan ? codec : "bf16");
      job.mutable_spec()->mutable_comm()->set_lan_codec(wan ? "none" : codec);
      job.mutable_spec()->mutable_train()->set_precision("fp16");
      EXPECT_THAT(ChoosePrecision(job.spec(), *placed, workers).status().message(),
                  HasSubstr(absl::StrCat("fp16 cannot train through the ", codec, " codec")))
          << codec << (wan ? " on the WAN" : " inside a site");
      job.mutable_spec()->mutable_train()->set_precision("auto");
      choice = ChoosePrecision(job.spec(), *placed, workers);
      ASSERT_TRUE(choice.ok()) << choice.status();
      EXPECT_EQ(choice->precision, model::Precision::kFp32) << codec;
    }
  }
  job.mutable_spec()->mutable_comm()->set_wan_codec("bf16");
  job.mutable_spec()->mutable_comm()->set_lan_codec("none");
  choice = ChoosePrecision(job.spec(), *placed, workers);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->precision, model::Precision::kFp16);
  workers[0] = with_cc(workers[0], "V100", 70);
  EXPECT_THAT(ChoosePrecision(job.spec(), *placed, workers).status().message(),
              HasSubstr("site utah's V100 (7.0) is older than the oldest GPU geotrain's CUDA build runs"));
}

TEST(PlaceActorsTest, FillsDevicesInSiteOrderAndWaitsWhenShort) {
  std::vector<WorkerInfo> workers = {Worker("w2", "b", 16), Worker("w1", "a", 16), Worker("w3", "b", 16)};
  auto placed = PlaceActors(Job(3, 1, 1), workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  ASSERT_EQ(placed->size(), 3u);
  EXPECT_EQ((*placed)[0].actor.worker_id(), "w1");  // site a first
  EXPECT_EQ((*placed)[1].site, "b");
  EXPECT_EQ((*placed)[2].actor.actor_id(), "job-000007-r2s0t0");
  auto waiting = PlaceActors(Job(2, 2, 1), workers);
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(waiting.status().message(), HasSubstr("needs 4 devices"));
  workers[0].set_state(WORKER_DEAD);
  EXPECT_EQ(PlaceActors(Job(3, 1, 1), workers).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(PlaceActors(Job(1, 3, 1), workers).status().code(), absl::StatusCode::kInvalidArgument);  // 2 layers
}

// A draining worker (leaving on notice) is neither placed on nor planned on: a restart goes elsewhere, or waits.
TEST(PlaceActorsTest, SkipsDrainingWorkers) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "a", 16), Worker("w3", "b", 16)};
  workers[0].set_draining(true);
  EXPECT_FALSE(Placeable(workers[0]));
  EXPECT_TRUE(Placeable(workers[1]));
  auto placed = PlaceActors(Job(2, 1, 1), workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const ActorPlacement& p : *placed) EXPECT_NE(p.actor.worker_id(), "w1");
  EXPECT_EQ(PlaceActors(Job(3, 1, 1), workers).status().code(), absl::StatusCode::kUnavailable);
  const std::vector<WorkerInfo> free = FreeDevices(workers, {});
  ASSERT_EQ(free.size(), 2u);
  EXPECT_EQ(free[0].worker_id(), "w2");
  // The planner of `plan: auto` jobs sees the same two workers.
  JobSpec spec = Job(1, 1, 1).spec();
  spec.mutable_parallel()->set_plan("auto");
  auto plan = PlanAutoJob(spec, workers, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->parallel.dp() * plan->parallel.pp() * plan->parallel.tp(), 2);
  for (WorkerInfo& w : workers) w.set_draining(true);
  EXPECT_EQ(PlanAutoJob(spec, workers, {}).status().code(), absl::StatusCode::kUnavailable);
}

TEST(PlaceActorsTest, WorkerPinsWinOverSitePins) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "a", 16)};
  JobInfo job = Job(2, 1, 1);
  PlacementSpec* site_pin = job.mutable_spec()->mutable_parallel()->add_placement();
  site_pin->set_replica(0);
  site_pin->set_site("a");
  PlacementSpec* worker_pin = job.mutable_spec()->mutable_parallel()->add_placement();
  worker_pin->set_replica(1);
  worker_pin->set_worker("w1");
  auto placed = PlaceActors(job, workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ((*placed)[1].actor.worker_id(), "w1");
  EXPECT_EQ((*placed)[0].actor.worker_id(), "w2");
}

TEST(PlaceActorsTest, TensorParallelGroupsStayInsideASite) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "b", 16)};
  auto placed = PlaceActors(Job(1, 1, 2), workers);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(placed.status().message(), HasSubstr("inside a site"));
  workers = {Worker("w1", "a", 16, /*devices=*/2)};
  EXPECT_TRUE(PlaceActors(Job(1, 1, 2), workers).ok());
}

TEST(PlaceActorsTest, PlanThatDoesNotFitIsRefusedWithTheNumbers) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 0.0001)};
  auto placed = PlaceActors(Job(1, 1, 1), workers);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(placed.status().message(), HasSubstr("does not fit"));
  EXPECT_THAT(placed.status().message(), HasSubstr("GB"));
  EXPECT_GT(EstimateActorMemory(Job(1, 1, 1).spec(), 0), 16u * 100000);  // at least its parameters x 16
}

// A `plan: auto` job on two sites one slow link apart, with slow devices, so that the plan spreads over
// both sites and its WAN traffic counts.
JobSpec AutoSpec(const std::string& wan_codec) {
  JobSpec spec;
  spec.mutable_model()->set_preset("gpt2-small-test");
  spec.mutable_train()->set_global_batch(16);
  spec.mutable_train()->set_seq_len(64);
  spec.mutable_parallel()->set_plan("auto");
  spec.mutable_comm()->set_wan_codec(wan_codec);
  ApplyJobDefaults(&spec);
  return spec;
}

TEST(PlanAutoJobTest, PlansTheWanTrafficWithTheJobsCodecZstdIncluded) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "b", 16)};
  for (WorkerInfo& w : workers) w.mutable_devices(0)->set_tflops(0.001);
  std::vector<SiteLink> links(1);
  links[0].set_a("a");
  links[0].set_b("b");
  links[0].set_latency_ms(20);
  links[0].set_bandwidth_mbps(100);
  auto none = PlanAutoJob(AutoSpec("none"), workers, links);
  ASSERT_TRUE(none.ok()) << none.status();
  auto zstd = PlanAutoJob(AutoSpec("bf16+zstd"), workers, links);
  ASSERT_TRUE(zstd.ok()) << zstd.status();
  // Both sites are used, so the plan's traffic crosses the link: with bf16+zstd it is compressed (the head
  // used to drop a codec it could not parse and plan this job as if its traffic were uncompressed).
  EXPECT_EQ(zstd->parallel.dp() * zstd->parallel.pp(), 2);
  EXPECT_LT(zstd->predicted_step_seconds, none->predicted_step_seconds);
  EXPECT_THAT(absl::StrJoin(zstd->explanation, "\n"), HasSubstr("bf16+zstd"));
}

// A GPU without bf16 trains in fp32 when the job's codec refuses fp16's infinities (int8), at its CUDA cores' peak: the
// head's planner predicts that, so with int8 it leaves the Turing GPU out and trains on the Ampere one alone, where
// with bf16 (fp16 on the Turing GPU) both are worth using.
TEST(PlanAutoJobTest, PredictsThePrecisionTheDevicesResolve) {
  // The Turing GPU's worker sorts first: without the pin PlaceActors would take it.
  std::vector<WorkerInfo> workers = {Worker("a-turing", "a", 16), Worker("b-ampere", "a", 16)};
  for (WorkerInfo& w : workers) {
    Device* d = w.mutable_devices(0);
    d->set_kind(DEVICE_KIND_CUDA);
    d->set_tflops(0.001);  // milliseconds per microbatch, as the other tests
    d->set_fp32_tflops(0.001 / 8);
    d->set_compute_capability(w.worker_id() == "a-turing" ? 75 : 80);
  }
  JobSpec spec = AutoSpec("int8");
  auto int8 = PlanAutoJob(spec, workers, {});
  ASSERT_TRUE(int8.ok()) << int8.status();
  EXPECT_EQ(int8->parallel.dp() * int8->parallel.pp() * int8->parallel.tp(), 1);
  ASSERT_EQ(int8->parallel.placement_size(), 1);
  EXPECT_EQ(int8->parallel.placement(0).worker(), "b-ampere");  // pinned: the site's other GPU would train in fp32
  JobInfo job;
  job.set_job_id("job-000008");
  *job.mutable_spec() = spec;
  *job.mutable_spec()->mutable_parallel() = int8->parallel;
  auto placed = PlaceActors(job, workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ((*placed)[0].actor.worker_id(), "b-ampere");
  auto bf16 = PlanAutoJob(AutoSpec("bf16"), workers, {});
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->parallel.dp() * bf16->parallel.pp() * bf16->parallel.tp(), 2);
}

// A pipeline whose stages sit in two sites runs deeper than pp when the measured link is slow against the
// predicted microbatch time, and says why; inside one site, or with the spec's own depth, it does not.
TEST(ChoosePipelineDepthTest, CoversASlowLinkWithMoreMicrobatchesInFlight) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "b", 16), Worker("w3", "a", 16)};
  for (WorkerInfo& w : workers) w.mutable_devices(0)->set_tflops(0.001);  // milliseconds per microbatch
  std::vector<SiteLink> links(1);
  links[0].set_a("a");
  links[0].set_b("b");
  links[0].set_latency_ms(50);
  links[0].set_bandwidth_mbps(1000);
  JobInfo job = Job(1, 2, 1);
  job.mutable_spec()->mutable_parallel()->set_microbatches(8);
  job.mutable_spec()->mutable_parallel()->add_placement()->set_stage(1);
  job.mutable_spec()->mutable_parallel()->mutable_placement(0)->set_site("b");
  auto placed = PlaceActors(job, workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  auto depth = ChoosePipelineDepth(job.spec(), *placed, workers, links);
  ASSERT_TRUE(depth.ok()) << depth.status();
  EXPECT_GT(depth->depth, 2);
  EXPECT_LE(depth->depth, 8);
  EXPECT_THAT(depth->explanation, HasSubstr("50.0 ms one way"));

  job.mutable_spec()->mutable_parallel()->mutable_placement(0)->set_site("a");  // both stages in site a
  placed = PlaceActors(job, workers);
  ASSERT_TRUE(placed.ok()) << placed.status();
  depth = ChoosePipelineDepth(job.spec(), *placed, workers, links);
  ASSERT_TRUE(depth.ok()) << depth.status();
  EXPECT_EQ(depth->depth, 2);
  EXPECT_EQ(depth->explanation, "");

  job.mutable_spec()->mutable_parallel()->set_pipeline_depth(5);
  depth = ChoosePipelineDepth(job.spec(), *placed, workers, links);
  ASSERT_TRUE(depth.ok()) << depth.status();
  EXPECT_EQ(depth->depth, 5);
}

// allow_diloco: across a slow link the auto plan trains with DiLoCo on both sites and says why; without it,
// the same job stays synchronous.
TEST(PlanAutoJobTest, AllowDilocoTakesDilocoAcrossASlowLinkAndExplains) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "a", 16), Worker("w3", "b", 16),
                                     Worker("w4", "b", 16)};
  for (WorkerInfo& w : workers) w.mutable_devices(0)->set_tflops(0.001);
  std::vector<SiteLink> links(1);
  links[0].set_a("a");
  links[0].set_b("b");
  links[0].set_latency_ms(100);
  links[0].set_bandwidth_mbps(10);
  JobSpec spec = AutoSpec("bf16");
  spec.mutable_parallel()->set_allow_diloco(true);
  spec.mutable_diloco()->set_inner_steps(32);
  auto plan = PlanAutoJob(spec, workers, links);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->parallel.sync(), "diloco");
  const std::string why = absl::StrJoin(plan->explanation, "\n");
  EXPECT_EQ(plan->parallel.dp() * plan->parallel.pp() * plan->parallel.tp(), 4) << why;  // both sites
  EXPECT_THAT(why, HasSubstr("chose DiLoCo"));
  EXPECT_THAT(why, HasSubstr("MB across sites per step"));
  JobSpec check = spec;
  *check.mutable_parallel() = plan->parallel;
  EXPECT_TRUE(DilocoOn(check));
  EXPECT_TRUE(ValidateJobSpec(check).ok()) << ValidateJobSpec(check);

  spec.mutable_parallel()->set_allow_diloco(false);
  spec.clear_diloco();
  auto sync = PlanAutoJob(spec, workers, links);
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_EQ(sync->parallel.sync(), "");
  EXPECT_GT(sync->predicted_step_seconds, plan->predicted_step_seconds);
}

TEST(PlanAutoJobTest, SaysWhenThePredictionIsForEmulatedDevices) {
  std::vector<WorkerInfo> workers = {Worker("w1", "a", 16), Worker("w2", "a", 16)};
  auto real = PlanAutoJob(AutoSpec("none"), workers, {});
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_THAT(absl::StrJoin(real->explanation, "\n"), Not(HasSubstr("emulated")));
  for (WorkerInfo& w : workers) w.mutable_devices(0)->set_kind(DEVICE_KIND_EMULATED);
  auto emulated = PlanAutoJob(AutoSpec("none"), workers, {});
  ASSERT_TRUE(emulated.ok()) << emulated.status();
  EXPECT_THAT(emulated->explanation.back(), HasSubstr("devices planned on are emulated (T4)"));
  EXPECT_THAT(emulated->explanation.back(), HasSubstr("measured steps will take far longer"));
  // With timed compute the measured steps are the emulated GPUs' too: the note says they are emulated.
  for (WorkerInfo& w : workers) w.mutable_devices(0)->set_timed_compute(true);
  auto timed = PlanAutoJob(AutoSpec("none"), workers, {});
  ASSERT_TRUE(timed.ok()) << timed.status();
  EXPECT_THAT(timed->explanation.back(), HasSubstr("emulated with timed compute (T4)"));
  EXPECT_THAT(timed->explanation.back(), HasSubstr("measured step times are EMULATED"));
  EXPECT_THAT(timed->explanation.back(), Not(HasSubstr("far longer")));
}

}  // namespace
}  // namespace geotrain::head
