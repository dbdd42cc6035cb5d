// Tests of the cluster description and the step-time simulator: formulas, limits, memory accounting
// against hand-computed numbers, codec choice, calibration.
#include "scheduler/cost_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/spec.h"
#include "scheduler/cluster.h"
#include "spec.pb.h"

namespace geotrain::scheduler {
namespace {

// Two sites with `per_site` devices each, joined by one link.
Cluster TwoSites(const std::string& device, int per_site, double latency_ms, double mbps) {
  Topology t;
  for (const char* name : {"utah", "amsterdam"}) {
    TopologySite* site = t.add_sites();
    site->set_name(name);
    TopologyWorker* w = site->add_workers();
    w->set_device(device);
    w->set_count(per_site);
  }
  TopologyLink* link = t.add_links();
  link->set_a("utah");
  link->set_b("amsterdam");
  link->set_latency_ms(latency_ms);
  link->set_bandwidth_mbps(mbps);
  EXPECT_TRUE(ValidateTopology(&t).ok());
  absl::StatusOr<Cluster> c = ClusterFromTopology(t);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

ModelCosts Costs(const std::string& preset, int seq_len) {
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset(preset);
  EXPECT_TRUE(config.ok());
  return ModelCosts::FromConfig(*config, seq_len);
}

// The cluster with every site's inside bandwidth multiplied by `factor`.
Cluster InsideBandwidthTimes(const Cluster& c, double factor) {
  Cluster out = c;
  for (int a = 0; a < out.num_sites(); ++a) out.links[a][a].bandwidth_bytes_per_s *= factor;
  return out;
}

// Two stages on devices 0 and 1, split before layer `split`: one replica of `microbatches` microbatches of
// `microbatch_size` sequences.
Plan TwoStages(const ModelCosts& model, int split, int microbatches, int microbatch_size = 1) {
  Plan p;
  p.pp = 2;
  p.microbatch_size = microbatch_size;
  p.stage_begin = {0, split, model.num_layers()};
  p.devices = {{{0}, {1}}};
  p.microbatches = {microbatches};
  return p;
}

// Pure data parallelism over the first n devices, equal shares.
Plan DataParallel(const ModelCosts& model, int n, int microbatches_per_replica) {
  Plan p;
  p.dp = n;
  p.stage_begin = {0, model.num_layers()};
  for (int r = 0; r < n; ++r) {
    p.devices.push_back({{r}});
    p.microbatches.push_back(microbatches_per_replica);
  }
  return p;
}

TEST(ClusterTest, FromTopologyExpandsWorkersAndMirrorsLinks) {
  Cluster c = TwoSites("RTX6000", 3, 51.5, 1000);
  ASSERT_EQ(c.devices.size(), 6u);
  EXPECT_EQ(c.devices[4].site, 1);
  EXPECT_EQ(c.devices[4].slot, 1);
  EXPECT_DOUBLE_EQ(c.devices[0].tflops, 130.5);
  EXPECT_DOUBLE_EQ(c.devices[0].mem_bytes, 24e9);
  EXPECT_DOUBLE_EQ(c.Link(0, 1).latency_s, 0.0515);
  EXPECT_DOUBLE_EQ(c.Link(1, 0).bandwidth_bytes_per_s, 125e6);
  EXPECT_DOUBLE_EQ(c.Link(0, 0).bandwidth_bytes_per_s, 100e9 / 8);
}

TEST(ClusterTest, MissingLinkIsAnErrorThatNamesThePair) {
  Topology t;
  for (const char* name : {"a", "b"}) {
    TopologySite* site = t.add_sites();
    site->set_name(name);
    site->add_workers()->set_device("T4");
  }
  ASSERT_TRUE(ValidateTopology(&t).ok());
  absl::StatusOr<Cluster> c = ClusterFromTopology(t);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), testing::HasSubstr("no link between sites 'a' and 'b'"));
}

TEST(CostModelTest, RingAllReduceFormula) {
  const LinkSpec link{0.01, 1e9};
  // 2(n-1)/n * bytes / bw + 2(n-1) * latency, n = 4, 1 GB.
  EXPECT_DOUBLE_EQ(RingAllReduceSeconds(1e9, 4, link), 1.5 + 0.06);
  EXPECT_EQ(RingAllReduceSeconds(1e9, 1, link), 0);
  // Two members exchange a tensor of up to 32 MiB in one round; a larger one goes as a ring of two's two rounds.
  EXPECT_DOUBLE_EQ(RingAllReduceSeconds(1e6, 2, link), 1e6 / 1e9 + 0.01);
  EXPECT_DOUBLE_EQ(RingAllReduceSeconds(1e9, 2, link), 1.0 + 0.02);
  EXPECT_EQ(AllReduceRounds(2, kPairAllReduceMaxBytes), 1);
  EXPECT_EQ(AllReduceRounds(2, kPairAllReduceMaxBytes + 4), 2);
  EXPECT_EQ(AllReduceRounds(3, 4), 4);
}

TEST(CostModelTest, PipelineBubbleMatchesTheFormulaForEqualStages) {
  for (Schedule schedule : {Schedule::k1F1B, Schedule::kGPipe}) {
    for (int p : {1, 2, 4, 8}) {
      for (int m : {1, 4, 16, 64}) {
        std::vector<double> f(p, 1.0), b(p, 2.0), x(p - 1 > 0 ? p - 1 : 0, 0.0);
        PipelineTimeline t = SimulatePipeline(f, b, x, x, m, schedule);
        EXPECT_NEAR(t.makespan, (m + p - 1) * 3.0, 1e-9) << ScheduleName(schedule) << " p=" << p << " m=" << m;
        const double bubble = 1 - t.busy[0] / t.makespan;
        EXPECT_NEAR(bubble, (p - 1.0) / (m + p - 1.0), 1e-9);
      }
    }
  }
}

TEST(CostModelTest, PipelineIsPacedByItsSlowestStageAndLatencyAddsPerBoundary) {
  // Unequal stages: the slowest stage sets the steady state.
  PipelineTimeline t = SimulatePipeline({1, 3, 1}, {2, 6, 2}, {0, 0}, {0, 0}, 32, Schedule::k1F1B);
  EXPECT_GE(t.makespan, 32 * 9.0);
  EXPECT_LT(t.makespan, 32 * 9.0 + 2 * 9.0 + 1e-9);
  // One microbatch: every boundary is crossed twice (forward and backward), each adds its latency
  // and its serialisation.
  PipelineTimeline base = SimulatePipeline({1, 1, 1, 1}, {2, 2, 2, 2}, {0, 0, 0}, {0, 0, 0}, 1, Schedule::k1F1B);
  PipelineTimeline slow =
      SimulatePipeline({1, 1, 1, 1}, {2, 2, 2, 2}, {0.5, 0.5, 0.5}, {0.1, 0.1, 0.1}, 1, Schedule::k1F1B);
  EXPECT_NEAR(slow.makespan - base.makespan, 2 * 3 * 0.6, 1e-9);
}

// Plain 1F1B across a slow boundary idles while a microbatch crosses and its gradient comes back; the
// depth PipelineDepthFor chooses keeps the first stage computing, so the step approaches the compute.
TEST(CostModelTest, DeeperOneFOneBCoversASlowBoundary) {
  const std::vector<double> f = {1, 1}, b = {2, 2}, transfer = {0}, latency = {5};
  const int m = 32;
  const PipelineTimeline plain = SimulatePipeline(f, b, transfer, latency, m, Schedule::k1F1B);
  const PipelineTimeline deep = SimulatePipeline(f, b, transfer, latency, m, Schedule::k1F1B, {}, 2 + 4);
  const PipelineTimeline fast = SimulatePipeline(f, b, transfer, {0}, m, Schedule::k1F1B);
  // Plain: each pair of microbatches waits the round trip (2 x 5 + stage 1's 3): about m / 2 x 13.
  EXPECT_GT(plain.makespan, m / 2 * 13.0 * 0.9);
  // Deep: the compute of m microbatches plus one round trip.
  EXPECT_LT(deep.makespan, fast.makespan + 2 * 5 + 3 + 1e-9);
  EXPECT_LT(deep.makespan, 0.6 * plain.makespan);
}

// A deep pipeline's sends overlap only when a stage sends to one site (the runtime's AsyncSender): a middle stage
// whose neighbours sit in two sites alternates between them and waits each acknowledgement.
TEST(CostModelTest, AMiddleStageBetweenTwoSitesDoesNotOverlapItsSends) {
  const std::vector<double> f = {1, 1, 1}, b = {2, 2, 2}, transfer = {0, 0}, latency = {5, 5}, trips = {1, 1};
  const int m = 32, depth = 12;
  const PipelineTimeline one_site_each =
      SimulatePipeline(f, b, transfer, latency, m, Schedule::k1F1B, trips, depth, {0, 1, 0});
  const PipelineTimeline unknown = SimulatePipeline(f, b, transfer, latency, m, Schedule::k1F1B, trips, depth);
  const PipelineTimeline two_sites =
      SimulatePipeline(f, b, transfer, latency, m, Schedule::k1F1B, trips, depth, {0, 1, 2});
  EXPECT_DOUBLE_EQ(one_site_each.makespan, unknown.makespan);
  // In 1F1B's steady phase stage 1 alternates a forward and a backward, its sends alternate sites, and each
  // waits for the ack of the one before (2 x 5): two round trips per microbatch, as on the runtime's one sender.
  // The warm-up's forwards and the drain's backwards go one way each and overlap: less than two round trips for
  // every microbatch.
  EXPECT_GT(two_sites.makespan, (m - depth) * 2 * 10.0);
  EXPECT_LT(two_sites.makespan, m * 2 * 10.0);
  EXPECT_LT(one_site_each.makespan, 0.75 * two_sites.makespan);
}

// Simulate chooses the depth (Plan::pipeline_depth 0) from the boundary's latency and the stages' microbatch
// time, reports it, and predicts the shorter step; a plan's own depth is simulated as given.
TEST(CostModelTest, SimulateChoosesTheDepthThatCoversTheLink) {
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 32;
  job.seq_len = 1024;
  const Cluster cluster = TwoSites("A100", 1, 50.0, 10000);
  Plan plan = TwoStages(model, model.num_layers() / 2, 32);
  absl::StatusOr<Prediction> chosen = Simulate(cluster, model, job, plan);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  const double microbatch = chosen->stage_forward_s[0] + chosen->stage_backward_s[0];
  EXPECT_GT(chosen->pipeline_depth, 2);
  EXPECT_GE(chosen->pipeline_depth,
            2 + 2 * 0.050 / std::max(microbatch, chosen->stage_forward_s[1] + chosen->stage_backward_s[1]));
  plan.pipeline_depth = 2;
  absl::StatusOr<Prediction> plain = Simulate(cluster, model, job, plan);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->pipeline_depth, 2);
  EXPECT_LT(chosen->step_time_s, plain->step_time_s);
  // Fast links: no extra depth.
  const Cluster near = TwoSites("A100", 1, 0.0, 400000);
  plan.pipeline_depth = 0;
  absl::StatusOr<Prediction> local = Simulate(near, model, job, plan);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(local->pipeline_depth, 2);
}

TEST(CostModelTest, MoreLatencyNeverSpeedsUpDataParallelism) {
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 32;
  job.seq_len = 1024;
  double previous = 0;
  for (double latency_ms : {0.0, 1.0, 10.0, 30.0, 100.0, 300.0}) {
    Cluster c = TwoSites("A100", 2, latency_ms, 10000);
    absl::StatusOr<Prediction> p = Simulate(c, model, job, DataParallel(model, 4, 8));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GE(p->step_time_s, previous) << latency_ms << " ms";
    previous = p->step_time_s;
  }
}

TEST(CostModelTest, MemoryOfOneDeviceMatchesHandComputedNumbers) {
  // GPT-2 124M, T = 1024, one sequence, one device, fp32 with Adam.
  // N = 50304*768 + 1024*768 + 12*7,087,872 + 2*768 = 124,475,904 parameters; 16 bytes each.
  // Activations per sequence: embedding 1024*768*4 = 3,145,728; 12 blocks of
  // (18*768 + 4 + 12*1024) floats * 1024 tokens * 4 = 106,971,136 each; head (768 + 2 +
  // 2*50304)*1024*4 = 415,244,288. Plus 1 GB fixed.
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 1;
  job.seq_len = 1024;
  Topology t;
  TopologySite* site = t.add_sites();
  site->set_name("lab");
  site->add_workers()->set_device("A100");
  ASSERT_TRUE(ValidateTopology(&t).ok());
  absl::StatusOr<Cluster> c = ClusterFromTopology(t);
  ASSERT_TRUE(c.ok());
  absl::StatusOr<Prediction> p = Simulate(*c, model, job, DataParallel(model, 1, 1));
  ASSERT_TRUE(p.ok());
  const double expected = 124475904.0 * 16 + 3145728.0 + 12 * 106971136.0 + 415244288.0 + 1e9;
  EXPECT_DOUBLE_EQ(p->device_memory_bytes[0], expected);
  EXPECT_TRUE(p->fits);
  EXPECT_NEAR(p->max_memory_fraction, expected / (80e9 * 0.9), 1e-12);
  // 1F1B holds min(pp - stage, m) microbatches; GPipe holds all m.
  EXPECT_DOUBLE_EQ(StageMemoryBytes(model, job, 1, 7, 0, 2, 1, 1, 1, 8, Schedule::k1F1B),
                   6 * 7087872.0 * 16 + 2 * 106971136.0 * 6 + 2.0 * 1024 * 768 * 4 + 1e9);
  EXPECT_DOUBLE_EQ(StageMemoryBytes(model, job, 1, 7, 0, 2, 1, 1, 1, 8, Schedule::kGPipe),
                   6 * 7087872.0 * 16 + 8 * 106971136.0 * 6 + 2.0 * 1024 * 768 * 4 + 1e9);
  // Tensor parallelism divides activations, and the state of the sharded parameters: each rank holds the
  // replicated ones (6 x 768 per block: LayerNorms, the projections' biases) whole.
  EXPECT_DOUBLE_EQ(
      StageMemoryBytes(model, job, 1, 7, 1, 2, 2, 1, 1, 8, Schedule::k1F1B),
      6 * ((7087872.0 - 6 * 768) / 2 + 6 * 768) * 16 + 1 * 106971136.0 * 6 / 2 + 2.0 * 1024 * 768 * 4 + 1e9);
  // Data parallelism adds the gradient buckets' copy of the gradients: 4 more bytes per parameter.
  EXPECT_DOUBLE_EQ(StageMemoryBytes(model, job, 1, 7, 0, 2, 1, 2, 1, 8, Schedule::k1F1B),
                   6 * 7087872.0 * 20 + 2 * 106971136.0 * 6 + 2.0 * 1024 * 768 * 4 + 1e9);
}

TEST(CostModelTest, PlanThatDoesNotFitIsRejectedWithTheNumbers) {
  const ModelCosts model = Costs("gpt2-xl", 1024);
  JobOptions job;
  job.global_batch = 4;
  job.seq_len = 1024;
  Cluster c = TwoSites("T4", 2, 10, 1000);
  absl::StatusOr<Prediction> p = Simulate(c, model, job, DataParallel(model, 4, 1));
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->fits);
  EXPECT_GT(p->max_memory_fraction, 1);
  EXPECT_THAT(p->reject_reason, testing::HasSubstr("on T4 at site utah needs"));
  EXPECT_THAT(p->reject_reason, testing::HasSubstr("GB usable"));
}

TEST(CostModelTest, CodecChoiceFollowsTheLink) {
  JobOptions job;
  for (const char* name : {"bf16", "int8", "topk:0.01"}) job.codecs.push_back(*ParseCodec(name));
  // 100 Gbit/s: compressing costs more than it saves.
  EXPECT_EQ(ChooseCodec(job, LinkSpec{0, 100e9 / 8}, false), -1);
  // 100 Mbit/s: gradients take the smallest wire size; activations only lossless-enough codecs.
  EXPECT_EQ(job.codecs[ChooseCodec(job, LinkSpec{0.05, 100e6 / 8}, false)].name, "topk:0.01");
  EXPECT_EQ(job.codecs[ChooseCodec(job, LinkSpec{0.05, 100e6 / 8}, true)].name, "bf16");
  // The runtime's rule: gradients cross every link in the spec's codec, fast or not; activations as chosen.
  JobOptions runtime;
  runtime.codecs.push_back(*ParseCodec("int8"));
  runtime.codec_on_every_link = true;
  EXPECT_EQ(ChooseCodec(runtime, LinkSpec{0, 100e9 / 8}, false), 0);
  EXPECT_EQ(ChooseCodec(runtime, LinkSpec{0, 100e9 / 8}, true), 0);  // int8 carries activations too
  runtime.codecs[0] = *ParseCodec("sparse:0.02:2");                  // a gradients-only codec does not
  EXPECT_EQ(ChooseCodec(runtime, LinkSpec{0.05, 100e6 / 8}, true), -1);
  EXPECT_EQ(ChooseCodec(runtime, LinkSpec{0.05, 100e6 / 8}, false), 0);
  EXPECT_FALSE(ParseCodec("zip").ok());
  EXPECT_FALSE(ParseCodec("topk:2").ok());
}

// int4 and sparse cost the bytes the runtime sends (common/codec_spec.h CodecRawPayloadBytes, which comm/'s tests
// check against encoded tensors), gradients only.
TEST(CostModelTest, LowBitCodecsCostTheRuntimesBytes) {
  const absl::StatusOr<Codec> int4 = ParseCodec("int4"), sparse = ParseCodec("sparse"),
                              sparse_zstd = ParseCodec("sparse:0.1:4+zstd");
  ASSERT_TRUE(int4.ok() && sparse.ok() && sparse_zstd.ok());
  EXPECT_DOUBLE_EQ(int4->ratio, (0.5 + 4.0 / 64) / 4);  // 4 bits a value, a 4-byte scale per 64
  EXPECT_EQ(sparse->name, "sparse:0.02:2");
  // Per block of 4096: 82 kept, a 12-bit offset and a 2-bit value each, and a 4-byte scale.
  EXPECT_NEAR(sparse->ratio, (4 + 82 * 14 / 8.0) / (4 * 4096), 1e-6);
  EXPECT_NEAR(sparse_zstd->ratio, 0.9 * (4 + 410 * 16 / 8.0) / (4 * 4096), 1e-6);
  EXPECT_FALSE(int4->for_activations);
  EXPECT_FALSE(sparse->for_activations);
  EXPECT_FALSE(ParseCodec("sparse:0.1:9").ok());
}

TEST(CostModelTest, CrossSitePipelineTrafficCountsActivationsBothWays) {
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 8;
  job.seq_len = 1024;
  job.codecs.push_back(*ParseCodec("bf16"));
  Cluster c = TwoSites("A100", 1, 50, 1000);
  const Plan p = TwoStages(model, 7, 4, 2);
  absl::StatusOr<Prediction> pr = Simulate(c, model, job, p);
  ASSERT_TRUE(pr.ok()) << pr.status();
  ASSERT_EQ(pr->cross_site.size(), 1u);
  // 4 microbatches x 2 sequences x 1024 x 768 floats x 4 bytes x bf16 (0.5), forward and backward.
  EXPECT_DOUBLE_EQ(pr->cross_site[0].activation_bytes, 2 * 4 * 2 * 1024 * 768 * 4 * 0.5);
  EXPECT_EQ(pr->cross_site[0].activation_codec, "bf16");
  // The tied wte gradient (50304 x 768 fp32) crosses once each way.
  EXPECT_DOUBLE_EQ(pr->cross_site[0].gradient_bytes, 2 * 50304.0 * 768 * 4 * 0.5);
  EXPECT_GT(pr->tied_sync_s, 0.05);
}

TEST(CostModelTest, CalibrationRecoversTheEfficiencyOfMeasuredStageTimes) {
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 8;
  job.seq_len = 1024;
  job.efficiency = 0.37;
  Cluster c = TwoSites("A100", 1, 0, 100000);
  const Plan p = TwoStages(model, 6, 8);
  absl::StatusOr<Prediction> pr = Simulate(c, model, job, p);
  ASSERT_TRUE(pr.ok());
  std::vector<double> measured;
  for (int s = 0; s < 2; ++s) measured.push_back(pr->stage_forward_s[s] + pr->stage_backward_s[s]);
  absl::StatusOr<double> eff = CalibrateEfficiency(c, model, job, p, measured);
  ASSERT_TRUE(eff.ok());
  EXPECT_NEAR(*eff, 0.37, 1e-9);
  EXPECT_FALSE(CalibrateEfficiency(c, model, job, p, {1.0}).ok());
}

TEST(CostModelTest, InconsistentPlansAreErrors) {
  const ModelCosts model = Costs("gpt2", 1024);
  JobOptions job;
  job.global_batch = 8;
  job.seq_len = 1024;
  Cluster c = TwoSites("A100", 1, 0, 1000);
  Plan p = DataParallel(model, 2, 4);
  p.devices[1][0][0] = 0;  // the same device twice
  EXPECT_FALSE(Simulate(c, model, job, p).ok());
  p = DataParallel(model, 2, 4);
  p.stage_begin = {0, 3};
  EXPECT_FALSE(Simulate(c, model, job, p).ok());
}

// gpt2-tiny-test's job in the tests below: 8 sequences of 32 tokens.
JobOptions TinyJob() {
  JobOptions job;
  job.global_batch = 8;
  job.seq_len = 32;
  return job;
}

// The runtime's step end (sequential_sync): two replicas across a 50 ms link pay the compute, the
// gradient exchange (its bytes once plus 2r latencies: the message and its acknowledgement) and the loss
// exchange (2r latencies) one after the other; nothing hides under the backward.
TEST(CostModelTest, SequentialSyncAddsTheRuntimesRingsAfterTheSchedule) {
  Cluster c = TwoSites("RTX6000", 1, 50, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.layer_overhead_s = 0;
  Plan plan = DataParallel(model, 2, 1);
  plan.devices = {{{0}}, {{1}}};  // one replica per site
  plan.microbatch_size = 4;
  absl::StatusOr<Prediction> overlapped = Simulate(c, model, job, plan);
  ASSERT_TRUE(overlapped.ok());
  job.sequential_sync = true;
  job.message_round_trips = 1;
  absl::StatusOr<Prediction> p = Simulate(c, model, job, plan);
  ASSERT_TRUE(p.ok());
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double l = 0.050, W = 1000e6 / 8;
  const double gradients = parameters * 4 / W + 2 * l;  // two members: one exchange, bytes once
  EXPECT_NEAR(p->dp_exposed_s, gradients, 1e-9);
  EXPECT_NEAR(p->scalar_sync_s, 2 * l, 1e-12);  // the loss exchange; one stage: no norm all-reduce
  EXPECT_NEAR(p->step_time_s, p->pipeline_time_s + gradients + 2 * l, 1e-9);
  EXPECT_GT(p->step_time_s, overlapped->step_time_s);
  // A flow-control window adds a round trip per window of each message's bytes.
  job.message_window_bytes = parameters * 4 / 2;  // the exchanged tensor is two windows
  absl::StatusOr<Prediction> windowed = Simulate(c, model, job, plan);
  ASSERT_TRUE(windowed.ok());
  EXPECT_NEAR(windowed->dp_exposed_s - p->dp_exposed_s, 2 * 2 * l, 1e-9);
}

// A pipeline message of r round trips keeps the sender 2r latencies and arrives (2r - 1) latencies
// after its serialisation: two stages, one microbatch, 1 round trip = the plain link's timing for
// the arrivals, so the makespan is unchanged; 2 round trips add 2 latencies per direction.
TEST(CostModelTest, MessageRoundTripsDelayPipelineArrivals) {
  const std::vector<double> fwd = {1, 1}, bwd = {2, 2}, transfer = {0.1}, latency = {0.5};
  const PipelineTimeline plain = SimulatePipeline(fwd, bwd, transfer, latency, 1, Schedule::kGPipe);
  const PipelineTimeline one = SimulatePipeline(fwd, bwd, transfer, latency, 1, Schedule::kGPipe, {1.0});
  const PipelineTimeline two = SimulatePipeline(fwd, bwd, transfer, latency, 1, Schedule::kGPipe, {2.0});
  EXPECT_DOUBLE_EQ(plain.makespan, 1 + 0.6 + 1 + 2 + 0.6 + 2);
  EXPECT_DOUBLE_EQ(one.makespan, plain.makespan);
  EXPECT_DOUBLE_EQ(two.makespan, plain.makespan + 2 * 2 * 0.5);
}

// Devices that share a host run slower when the plan uses several of them.
TEST(CostModelTest, SharedHostScaleSlowsComputeWithTheDevicesInUse) {
  Cluster c = TwoSites("RTX6000", 1, 0.05, 100000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.shared_host_scale[2] = 0.5;
  Plan one = DataParallel(model, 1, 1);
  one.microbatch_size = 8;
  Plan two = DataParallel(model, 2, 1);
  two.microbatch_size = 4;
  absl::StatusOr<Prediction> p1 = Simulate(c, model, job, one);
  absl::StatusOr<Prediction> p2 = Simulate(c, model, job, two);
  ASSERT_TRUE(p1.ok() && p2.ok());
  // Half the batch each, at half the speed: the same forward time per replica.
  EXPECT_NEAR(p2->stage_forward_s[0], p1->stage_forward_s[0], 1e-12);
}

// On one host (a timed cluster), the sites a plan uses share the bandwidth inside a site: a plan over both sites
// is predicted as on a cluster whose intra-site links have half the bandwidth; a plan inside one site is not
// changed.
TEST(CostModelTest, SitesSharingOneHostDivideTheBandwidthInsideASite) {
  const Cluster c = TwoSites("RTX6000", 2, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions shared = TinyJob();
  shared.sites_share_one_host = true;
  const Plan both = DataParallel(model, 4, 1);  // devices 0, 1 in utah and 2, 3 in amsterdam
  const Plan one_site = DataParallel(model, 2, 1);
  const Cluster halved = InsideBandwidthTimes(c, 0.5);

  absl::StatusOr<Prediction> on_one_host = Simulate(c, model, shared, both);
  absl::StatusOr<Prediction> as_halved = Simulate(halved, model, TinyJob(), both);
  absl::StatusOr<Prediction> apart = Simulate(c, model, TinyJob(), both);
  ASSERT_TRUE(on_one_host.ok() && as_halved.ok() && apart.ok());
  EXPECT_DOUBLE_EQ(on_one_host->step_time_s, as_halved->step_time_s);
  EXPECT_GT(on_one_host->step_time_s, apart->step_time_s);

  absl::StatusOr<Prediction> local_shared = Simulate(c, model, shared, one_site);
  absl::StatusOr<Prediction> local = Simulate(c, model, TinyJob(), one_site);
  ASSERT_TRUE(local_shared.ok() && local.ok());
  EXPECT_DOUBLE_EQ(local_shared->step_time_s, local->step_time_s);
}

// With gRPC collectives (CPU and timed workers) data parallelism across sites whose sites hold several replicas is
// gRPC's hierarchical all-reduce, as the runtime runs it: each site's leader gathers its k - 1 others' tensors and
// sends each a copy back, and the two leaders exchange their sites' sums in one round (the whole tensor each way).
// The WAN carries the tensor once each way, where a flat ring of eight sends 2 x 7/8 of it, in one round instead of
// 14. With one replica per site the ring of the sites remains. NCCL's groups are hierarchical across sites too.
TEST(CostModelTest, DataParallelismAcrossSitesRunsHierarchically) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.grpc_collectives = true;
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double bytes = parameters * 4, W = 1000e6 / 8, l = 0.010;
  const LinkSpec inside = c.Link(0, 0);
  absl::StatusOr<Prediction> eight = Simulate(c, model, job, DataParallel(model, 8, 1));
  ASSERT_TRUE(eight.ok());
  const double gather = 3 * bytes / inside.bandwidth_bytes_per_s + inside.latency_s;
  EXPECT_NEAR(eight->stage_allreduce_s[0], 2 * gather + bytes / W + l, 1e-9);
  ASSERT_EQ(eight->cross_site.size(), 1u);
  EXPECT_NEAR(eight->cross_site[0].gradient_bytes, 2 * bytes, 1e-6 * bytes);  // once each way

  Plan one_each = DataParallel(model, 2, 1);
  one_each.devices = {{{0}}, {{4}}};  // utah's first device and amsterdam's
  absl::StatusOr<Prediction> two = Simulate(c, model, job, one_each);
  ASSERT_TRUE(two.ok());
  EXPECT_NEAR(two->stage_allreduce_s[0], RingAllReduceSeconds(bytes, 2, c.Link(0, 1)), 1e-9);

  // NCCL's groups across sites are hierarchical too (comm::NcclHierarchicalAllReduce): rings inside the sites, and
  // the two leaders' gRPC exchange in one round.
  job.grpc_collectives = false;
  absl::StatusOr<Prediction> nccl = Simulate(c, model, job, DataParallel(model, 8, 1));
  ASSERT_TRUE(nccl.ok());
  const double ring_inside = 0.75 * bytes / inside.bandwidth_bytes_per_s + 3 * inside.latency_s;
  EXPECT_NEAR(nccl->stage_allreduce_s[0], 2 * ring_inside + bytes / W + l, 1e-9);
  EXPECT_NEAR(nccl->cross_site[0].gradient_bytes, 2 * bytes, 1e-6 * bytes);
}

// DP2 x PP2 on the given devices (by replica, then stage), two microbatches per replica.
Plan TwoByTwo(const ModelCosts& model, std::vector<std::vector<std::vector<int>>> devices) {
  Plan p;
  p.dp = 2;
  p.pp = 2;
  p.stage_begin = {0, model.num_layers() / 2, model.num_layers()};
  p.microbatches = {2, 2};
  p.devices = std::move(devices);
  return p;
}

// TinyJob's prediction of `plan` on a cluster of two sites, with gRPC or NCCL collectives: it succeeds, and sends
// across the one pair of sites (cross_site holds one entry, zero when the prediction failed).
Prediction PredictAcrossTwoSites(const Cluster& c, const ModelCosts& model, const Plan& plan, bool grpc) {
  JobOptions job = TinyJob();
  job.grpc_collectives = grpc;
  absl::StatusOr<Prediction> pr = Simulate(c, model, job, plan);
  EXPECT_TRUE(pr.ok()) << pr.status();
  Prediction out = pr.ok() ? *pr : Prediction{};
  EXPECT_EQ(out.cross_site.size(), 1u);
  out.cross_site.resize(1);
  return out;
}

// The tied embedding with gRPC collectives and several replicas: one all-reduce over every replica's first- and
// last-stage copy, routed as a data-parallel group, and the stages' buckets leave wte out, so each site's sum of
// the copies crosses once each way, whatever the layout. With NCCL each replica's pair exchanges its copies and the
// stages' groups all-reduce them again: wte crosses once per copy that is apart from the others.
TEST(CostModelTest, GrpcCollectivesSendTheTiedEmbeddingAcrossOnce) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double tied = model.tied_parameters * 4;
  const Plan pipelines_inside = TwoByTwo(model, {{{0}, {1}}, {{4}, {5}}});  // each replica in a site, DP across
  const Plan pipelines_across = TwoByTwo(model, {{{0}, {4}}, {{1}, {5}}});  // first stages in utah, last in amsterdam
  auto gradient_bytes = [&](const Plan& plan, bool grpc) {
    return PredictAcrossTwoSites(c, model, plan, grpc).cross_site[0].gradient_bytes;
  };
  // Every parameter's gradient once each way (wte counted once), and across: the tied sum alone.
  EXPECT_NEAR(gradient_bytes(pipelines_inside, true), 2 * parameters * 4, 1e-6 * parameters);
  EXPECT_NEAR(gradient_bytes(pipelines_across, true), 2 * tied, 1e-6 * tied);
  // With NCCL: both stages' data-parallel groups carry a copy; each replica's pair crosses.
  EXPECT_NEAR(gradient_bytes(pipelines_inside, false), 2 * (parameters * 4 + tied), 1e-6 * parameters);
  EXPECT_NEAR(gradient_bytes(pipelines_across, false), 2 * 2 * tied, 1e-6 * tied);
}

// Tensor parallelism with data parallelism across sites: on gRPC each tp rank all-reduces 1/tp of the replicated
// tensors (the embeddings above all) and gathers the rest inside its site, so every gradient crosses once each way;
// with NCCL each tp rank's group all-reduces all of them, and they cross once per tp rank.
TEST(CostModelTest, TensorParallelReplicasAcrossSitesSendTheReplicatedTensorsOnceOnGrpc) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  double parameters = 0, replicated = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters, replicated += l.replicated_parameters;
  EXPECT_NEAR(replicated, model.layers[0].parameters + 2 * 6 * 32 + 2 * 32, 1e-9);
  Plan dp_tp = DataParallel(model, 2, 1);
  dp_tp.tp = 2;
  dp_tp.devices = {{{0, 1}}, {{4, 5}}};  // one replica per site
  Plan pipelines = TwoByTwo(model, {{{0, 1}, {2, 3}}, {{4, 5}, {6, 7}}});
  pipelines.tp = 2;
  auto predict = [&](const Plan& plan, bool grpc) { return PredictAcrossTwoSites(c, model, plan, grpc); };
  const Prediction grpc = predict(dp_tp, true);
  EXPECT_NEAR(grpc.cross_site[0].gradient_bytes, 2 * parameters * 4, 1e-6 * parameters);
  // The pair exchange of each rank's half of every gradient (the two rings share the WAN), then the gather.
  const double W = 1000e6 / 8, l = 0.010;
  const LinkSpec inside = c.Link(0, 0);
  EXPECT_NEAR(grpc.stage_allreduce_s[0],
              parameters * 4 / W + l + 0.5 * replicated * 4 / inside.bandwidth_bytes_per_s + inside.latency_s, 1e-9);
  EXPECT_NEAR(predict(dp_tp, false).cross_site[0].gradient_bytes, 2 * (parameters + replicated) * 4, 1e-6 * parameters);
  // With pipelines the tied all-reduce of wte sums each rank's half too; with NCCL each stage's groups all-reduce
  // their copy of it whole on each tp rank.
  const double tied = model.tied_parameters;
  EXPECT_NEAR(predict(pipelines, true).cross_site[0].gradient_bytes, 2 * parameters * 4, 1e-6 * parameters);
  EXPECT_NEAR(predict(pipelines, false).cross_site[0].gradient_bytes, 2 * (parameters + replicated + 2 * tied) * 4,
              1e-6 * parameters);
  // One pipeline across the sites: each tp rank's first and last stage exchange their whole wte.
  Plan pipeline_across = TwoStages(model, 2, 2);
  pipeline_across.tp = 2;
  pipeline_across.devices = {{{0, 1}, {4, 5}}};
  EXPECT_NEAR(predict(pipeline_across, false).cross_site[0].gradient_bytes, 2 * 2 * tied * 4, 1e-6 * tied);
}

// With the runtime's step end (sequential_sync) the tied all-reduce of every copy comes first and the stages'
// all-reduces after it: the stages' shared WAN carries their gradients without wte, which the tied all-reduce has
// already sent (its bytes are not charged to them again).
TEST(CostModelTest, SequentialSyncChargesTheTiedBytesOnce) {
  const Cluster c = TwoSites("RTX6000", 4, 0.1, 100);  // short latency: the two stages' bytes bound the step end
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.grpc_collectives = true;
  job.sequential_sync = true;
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double W = 100e6 / 8, l = 0.0001;
  absl::StatusOr<Prediction> pr = Simulate(c, model, job, TwoByTwo(model, {{{0}, {1}}, {{4}, {5}}}));
  ASSERT_TRUE(pr.ok()) << pr.status();
  const double stages_wan = l + (parameters - model.tied_parameters) * 4 / W;
  EXPECT_GT(stages_wan, std::max(pr->stage_allreduce_s[0], pr->stage_allreduce_s[1]));
  EXPECT_NEAR(pr->dp_exposed_s, stages_wan, 1e-9);
  EXPECT_GT(pr->tied_sync_s, model.tied_parameters * 4 / W);  // the copies' sums cross once each way
}

// On one host a collective's ranks all send at once: they share the host's throughput, twice the bandwidth
// inside a site (what each of the calibration's two ranks gets), so four ranks in one site get half of it each.
TEST(CostModelTest, OneHostCollectivesShareTheHostsThroughput) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.sites_share_one_host = true;
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  LinkSpec half = c.Link(0, 0);
  half.bandwidth_bytes_per_s /= 2;
  absl::StatusOr<Prediction> four = Simulate(c, model, job, DataParallel(model, 4, 1));
  absl::StatusOr<Prediction> two = Simulate(c, model, job, DataParallel(model, 2, 1));
  ASSERT_TRUE(four.ok() && two.ok());
  EXPECT_NEAR(four->stage_allreduce_s[0], RingAllReduceSeconds(parameters * 4, 4, half), 1e-12);
  EXPECT_NEAR(two->stage_allreduce_s[0], RingAllReduceSeconds(parameters * 4, 2, c.Link(0, 0)), 1e-12);
}

// On one host the pipeline's sends between stages run at once and share the host's throughput (twice the bandwidth
// inside a site): with three boundaries each send gets two thirds of that bandwidth, with one it keeps all of it.
TEST(CostModelTest, OneHostPipelineSendsShareTheHostsThroughput) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions shared = TinyJob();
  shared.sites_share_one_host = true;
  auto pipeline = [&](int pp) {
    Plan p;
    p.pp = pp;
    p.microbatches = {8};
    p.devices.emplace_back();
    for (int s = 0; s <= pp; ++s) p.stage_begin.push_back(s * model.num_layers() / pp);
    for (int s = 0; s < pp; ++s) p.devices[0].push_back({s});  // all in utah
    return p;
  };
  ASSERT_GE(model.num_layers(), 4);
  Cluster two_thirds = c;
  two_thirds.links[0][0].bandwidth_bytes_per_s *= 2.0 / 3;
  absl::StatusOr<Prediction> four_shared = Simulate(c, model, shared, pipeline(4));
  absl::StatusOr<Prediction> four_slower = Simulate(two_thirds, model, TinyJob(), pipeline(4));
  absl::StatusOr<Prediction> four_apart = Simulate(c, model, TinyJob(), pipeline(4));
  ASSERT_TRUE(four_shared.ok() && four_slower.ok() && four_apart.ok());
  EXPECT_DOUBLE_EQ(four_shared->pipeline_time_s, four_slower->pipeline_time_s);
  EXPECT_GT(four_shared->pipeline_time_s, four_apart->pipeline_time_s);
  absl::StatusOr<Prediction> two_shared = Simulate(c, model, shared, pipeline(2));
  absl::StatusOr<Prediction> two_apart = Simulate(c, model, TinyJob(), pipeline(2));
  ASSERT_TRUE(two_shared.ok() && two_apart.ok());
  EXPECT_DOUBLE_EQ(two_shared->pipeline_time_s, two_apart->pipeline_time_s);
}

// On one host gRPC's hierarchical all-reduce gathers every site's tensors to its leader, and copies the sum back,
// through the host at once: each phase moves (members - leaders) tensors at the host's throughput (twice the
// bandwidth inside a site). The leaders, the only ranks that code while their ring runs, code at their share of the
// host's two cores: two leaders at full speed.
TEST(CostModelTest, OneHostHierarchicalAllReduceSharesTheHostByPhase) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.grpc_collectives = true;
  job.sites_share_one_host = true;
  job.codecs.push_back(*ParseCodec("int8"));
  job.codec_on_every_link = true;
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double bytes = parameters * 4;
  const LinkSpec inside = c.Link(0, 0);
  // Two leaders: one exchange of the whole tensor, coded at the codec's own throughput.
  const double leaders = bytes * job.codecs[0].SecondsPerByte(c.Link(0, 1)) + 0.010;
  absl::StatusOr<Prediction> eight = Simulate(c, model, job, DataParallel(model, 8, 1));
  ASSERT_TRUE(eight.ok()) << eight.status();
  const double gather_six = 6 * bytes / (2 * inside.bandwidth_bytes_per_s) + inside.latency_s;
  EXPECT_NEAR(eight->stage_allreduce_s[0], 2 * gather_six + leaders, 1e-9);
  // One member but the leaders: that transfer alone goes at the bandwidth inside a site, not the host's.
  absl::StatusOr<Prediction> three = Simulate(c, model, job, [&] {
    Plan p = DataParallel(model, 3, 1);
    p.devices = {{{0}}, {{1}}, {{4}}};  // two in utah, one in amsterdam
    return p;
  }());
  ASSERT_TRUE(three.ok()) << three.status();
  const double gather_one = bytes / inside.bandwidth_bytes_per_s + inside.latency_s;
  EXPECT_NEAR(three->stage_allreduce_s[0], 2 * gather_one + leaders, 1e-9);
}

// A Turing GPU has no bf16: auto trains in fp16 there, or in fp32 when a codec refuses fp16's infinities (as the
// head resolves it, model::AutoPrecision), and fp32 computes at the GPU's fp32 peak and its fp32 efficiency.
TEST(CostModelTest, PlansComputeInThePrecisionTheHeadResolves) {
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  const KnownDevice* rtx = FindKnownDevice("RTX6000");
  ASSERT_NE(rtx, nullptr);
  ASSERT_EQ(rtx->compute_capability, 75);
  const Cluster turing = TwoSites("RTX6000", 1, 10, 1000);
  const Plan one = DataParallel(model, 1, 1);
  JobOptions job = TinyJob();
  absl::StatusOr<Prediction> fp16 = Simulate(turing, model, job, one);
  job.finite_only_codec = true;
  absl::StatusOr<Prediction> fp32 = Simulate(turing, model, job, one);
  JobOptions calibrated = job;
  calibrated.efficiency_by_device = {{"RTX6000", job.efficiency}, {"RTX6000@fp32", 2 * job.efficiency}};
  absl::StatusOr<Prediction> fp32_calibrated = Simulate(turing, model, calibrated, one);
  ASSERT_TRUE(fp16.ok() && fp32.ok() && fp32_calibrated.ok());
  EXPECT_EQ(fp16->precision, "fp16");
  EXPECT_EQ(fp32->precision, "fp32");
  EXPECT_NEAR(fp32->compute_bound_s / fp16->compute_bound_s, rtx->tflops / rtx->fp32_tflops, 1e-9);
  EXPECT_NEAR(fp32_calibrated->compute_bound_s / fp32->compute_bound_s, 0.5, 1e-9);
  // An Ampere GPU keeps bf16 whatever the codec; a precision the job names stands.
  const Cluster ampere = TwoSites("A30", 1, 10, 1000);
  absl::StatusOr<Prediction> bf16 = Simulate(ampere, model, job, one);
  job.precision = "fp32";
  absl::StatusOr<Prediction> asked = Simulate(ampere, model, job, one);
  ASSERT_TRUE(bf16.ok() && asked.ok());
  EXPECT_EQ(bf16->precision, "bf16");
  EXPECT_EQ(asked->precision, "fp32");
  EXPECT_GT(asked->compute_bound_s, 4 * bf16->compute_bound_s);
}

// Activations (the pipeline's sends, tensor parallelism's all-reduces) can be given their own bandwidth inside a
// site; gradients keep the link's.
TEST(CostModelTest, ActivationsInsideASiteTakeTheirOwnBandwidth) {
  const Cluster c = TwoSites("RTX6000", 4, 10, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.activation_bandwidth_scale = 2;
  const Cluster doubled = InsideBandwidthTimes(c, 2);
  Plan pp2;
  pp2.pp = 2;
  pp2.microbatches = {4};
  pp2.stage_begin = {0, model.num_layers() / 2, model.num_layers()};
  pp2.devices = {{{0}, {1}}};
  Plan tp2;
  tp2.tp = 2;
  tp2.microbatches = {4};
  tp2.stage_begin = {0, model.num_layers()};
  tp2.devices = {{{0, 1}}};
  for (const Plan& plan : {pp2, tp2}) {
    absl::StatusOr<Prediction> scaled = Simulate(c, model, job, plan);
    absl::StatusOr<Prediction> faster = Simulate(doubled, model, TinyJob(), plan);
    absl::StatusOr<Prediction> plain = Simulate(c, model, TinyJob(), plan);
    ASSERT_TRUE(scaled.ok() && faster.ok() && plain.ok());
    EXPECT_DOUBLE_EQ(scaled->pipeline_time_s, faster->pipeline_time_s) << "pp " << plan.pp << " tp " << plan.tp;
    EXPECT_LT(scaled->pipeline_time_s, plain->pipeline_time_s) << "pp " << plan.pp << " tp " << plan.tp;
  }
  absl::StatusOr<Prediction> dp_scaled = Simulate(c, model, job, DataParallel(model, 2, 1));
  absl::StatusOr<Prediction> dp_plain = Simulate(c, model, TinyJob(), DataParallel(model, 2, 1));
  ASSERT_TRUE(dp_scaled.ok() && dp_plain.ok());
  EXPECT_GT(dp_plain->stage_allreduce_s[0], 0);
  EXPECT_DOUBLE_EQ(dp_scaled->stage_allreduce_s[0], dp_plain->stage_allreduce_s[0]);
}

// The runtime's buckets (comm::GradientBuckets): the blocks last to first, then the stage's other parameters as
// one group; a bucket is closed once it holds bucket_bytes, and a group is never split.
TEST(CostModelTest, GradientBucketsPackAsTheRuntimePacksThem) {
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  const int L = model.num_layers();  // embedding, two blocks, head
  ASSERT_EQ(L, 4);
  const double block = model.layers[1].parameters * 4,
               others = (model.layers[0].parameters + model.layers[3].parameters) * 4;
  // Every group its own bucket.
  EXPECT_THAT(GradientBucketBytes(model, 0, L, 1, 1, 1), testing::ElementsAre(block, block, others));
  // The second block joins the first's bucket (it held less than bucket_bytes); the rest start a new one.
  EXPECT_THAT(GradientBucketBytes(model, 0, L, 1, 1, block + 1), testing::ElementsAre(2 * block, others));
  EXPECT_THAT(GradientBucketBytes(model, 0, L, 1, 1, 1e12), testing::ElementsAre(2 * block + others));
  // Tensor parallelism: each rank's shard and the replicated tensors whole (the others are all replicated), or half
  // of those too with split_replicated. The last of two stages adds its tied wte copy to its other group.
  const double block_replicated = model.layers[1].replicated_parameters * 4;
  EXPECT_THAT(GradientBucketBytes(model, 0, L, 1, 2, 1),
              testing::ElementsAre((block + block_replicated) / 2, (block + block_replicated) / 2, others));
  EXPECT_THAT(GradientBucketBytes(model, 0, L, 1, 2, 1, false, /*split_replicated=*/true),
              testing::ElementsAre(block / 2, block / 2, others / 2));
  EXPECT_THAT(GradientBucketBytes(model, 2, L, 2, 1, 1),
              testing::ElementsAre(block, (model.layers[3].parameters + model.tied_parameters) * 4));
  // A middle stage holds blocks only.
  EXPECT_THAT(GradientBucketBytes(model, 1, 2, 3, 1, 1), testing::ElementsAre(block));
}

// Two replicas across a 50 ms link (a pair exchange per bucket): with sequential_sync each bucket is an all-reduce
// of its own and waits its round trip, so three buckets pay two more round trips than one.
TEST(CostModelTest, SequentialSyncPaysEachGradientBucketsRoundTrip) {
  const Cluster c = TwoSites("RTX6000", 1, 50, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.sequential_sync = true;
  Plan plan = DataParallel(model, 2, 1);
  plan.devices = {{{0}}, {{1}}};
  job.grad_bucket_bytes = 1e12;
  absl::StatusOr<Prediction> one = Simulate(c, model, job, plan);
  job.grad_bucket_bytes = 1;
  absl::StatusOr<Prediction> three = Simulate(c, model, job, plan);
  ASSERT_TRUE(one.ok() && three.ok());
  EXPECT_NEAR(three->stage_allreduce_s[0] - one->stage_allreduce_s[0], 2 * 2 * 0.050, 1e-9);
  EXPECT_NEAR(three->step_time_s - one->step_time_s, 2 * 2 * 0.050, 1e-9);
}

// With a hierarchical all-reduce (NCCL's, or gRPC's) each bucket pays the sites' leaders' rounds, not the flat
// ring's over every replica: four replicas in two sites, a pair exchange of the leaders per bucket.
TEST(CostModelTest, EachBucketPaysTheRoundsOfTheRingItRunsOn) {
  const Cluster c = TwoSites("RTX6000", 2, 50, 1000);
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  Plan plan = DataParallel(model, 4, 1);
  plan.devices = {{{0}}, {{1}}, {{2}}, {{3}}};  // two replicas per site
  auto extra_for_two_more_buckets = [&](bool grpc) {
    JobOptions job = TinyJob();
    job.sequential_sync = true;
    job.grpc_collectives = grpc;
    job.grad_bucket_bytes = 1e12;
    absl::StatusOr<Prediction> one = Simulate(c, model, job, plan);
    job.grad_bucket_bytes = 1;
    absl::StatusOr<Prediction> three = Simulate(c, model, job, plan);
    EXPECT_TRUE(one.ok() && three.ok());
    return three->stage_allreduce_s[0] - one->stage_allreduce_s[0];
  };
  // Both hierarchical (gRPC's always with two replicas in a site): two leaders, one exchange per bucket.
  EXPECT_NEAR(extra_for_two_more_buckets(true), 2 * 1 * 2 * 0.050, 1e-9);
  EXPECT_NEAR(extra_for_two_more_buckets(false), 2 * 1 * 2 * 0.050, 1e-9);
}

// A message's window stall delays it but leaves the link to the other streams: a deep pipeline's sends to one
// site stall side by side, where serialised stalls would add up.
TEST(CostModelTest, WindowStallsOfSendsInFlightOverlap) {
  const std::vector<double> f = {1, 1}, b = {1, 1}, trips = {1}, latency = {0.001};
  const int m = 8, depth = 8;
  const PipelineTimeline plain = SimulatePipeline(f, b, {0}, latency, m, Schedule::k1F1B, trips, depth, {0, 1});
  const PipelineTimeline stalled =
      SimulatePipeline(f, b, {0}, latency, m, Schedule::k1F1B, trips, depth, {0, 1}, /*stall_s=*/{5});
  const PipelineTimeline serialised = SimulatePipeline(f, b, {5}, latency, m, Schedule::k1F1B, trips, depth, {0, 1});
  EXPECT_GT(stalled.makespan, plain.makespan + 5);
  EXPECT_LT(stalled.makespan, plain.makespan + 4 * 5);
  EXPECT_GT(serialised.makespan, stalled.makespan + 3 * 5);
}

// A stream's flow-control window across sites: a message starts with the window open, so its first window goes
// at the link's rate and the rest at window / round trip. A message within the window pays nothing.
TEST(CostModelTest, WanWindowSlowsEachMessageBeyondItsFirstWindow) {
  const Cluster c = TwoSites("RTX6000", 1, 50, 1000);
  const double bandwidth = 1000e6 / 8, round_trip = 0.100;
  const ModelCosts model = Costs("gpt2-tiny-test", 32);
  JobOptions job = TinyJob();
  job.sequential_sync = true;
  job.grad_bucket_bytes = 1e12;  // one bucket: one pair exchange of every gradient
  Plan plan = DataParallel(model, 2, 1);
  plan.devices = {{{0}}, {{1}}};
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  const double message = parameters * 4;
  absl::StatusOr<Prediction> open = Simulate(c, model, job, plan);
  job.wan_window_bytes = message / 4;
  absl::StatusOr<Prediction> capped = Simulate(c, model, job, plan);
  job.wan_window_bytes = message;
  absl::StatusOr<Prediction> within = Simulate(c, model, job, plan);
  ASSERT_TRUE(open.ok() && capped.ok() && within.ok());
  EXPECT_NEAR(capped->stage_allreduce_s[0] - open->stage_allreduce_s[0],
              (message - message / 4) * (round_trip / (message / 4) - 1 / bandwidth), 1e-9);
  EXPECT_DOUBLE_EQ(within->stage_allreduce_s[0], open->stage_allreduce_s[0]);

  // A pipeline's sends across sites: one microbatch, its activations forward and their gradient back.
  Plan pipeline = TwoStages(model, 2, 1, 4);
  pipeline.schedule = Schedule::kGPipe;
  const double activations = 4.0 * 32 * 32 * 4;  // b x T x C fp32
  job = TinyJob();
  absl::StatusOr<Prediction> plain = Simulate(c, model, job, pipeline);
  job.wan_window_bytes = activations / 2;
  absl::StatusOr<Prediction> windowed = Simulate(c, model, job, pipeline);
  ASSERT_TRUE(plain.ok() && windowed.ok()) << plain.status() << windowed.status();
  EXPECT_NEAR(windowed->pipeline_time_s - plain->pipeline_time_s,
              2 * (activations / 2) * (round_trip / (activations / 2) - 1 / bandwidth), 1e-9);
}

}  // namespace
}  // namespace geotrain::scheduler
