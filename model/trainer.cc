// The single-process training loop (see trainer.h).
#include "model/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/diloco_spec.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/data.h"
#include "model/diloco.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

std::string ProgressBar(int done, int total, double seconds_left) {
  const int width = 30;
  const int filled = total > 0 ? done * width / total : width;
  std::string bar = "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
  return absl::StrCat(bar, " ", done, "/", total, " eta ", static_cast<int>(seconds_left), "s");
}

// One simulated group of replicas (every replica when the job is synchronous): its model, its optimizer, and
// the rows of the step's batch (and of each validation batch) it takes, as microbatches.
struct Group {
  std::unique_ptr<GPT2Stage> model;
  std::unique_ptr<AdamW> adam;
  std::vector<int> microbatch_rows;  // first row of each microbatch in the global batch
  float loss_scale = 1;
};

}  // namespace

LearningRateSchedule TrainSchedule(const JobSpec& spec, int diloco_groups) {
  const TrainSpec& t = spec.train();
  return {.max_lr = t.lr(),
          .min_lr = t.min_lr(),
          .warmup_steps = t.warmup_steps(),
          .total_steps = t.steps(),
          .scale = DilocoInnerLrScale(spec, diloco_groups)};
}

absl::StatusOr<Precision> SpecPrecision(const JobSpec& spec) {
  const std::string& name = spec.train().precision();
  if (name.empty() || name == "auto") return Precision::kFp32;
  return ParsePrecision(name);
}

AdamWOptions TrainOptimizerOptions(const JobSpec& spec, Precision precision) {
  const TrainSpec& t = spec.train();
  AdamWOptions options;
  options.beta1 = static_cast<float>(t.beta1());
  options.beta2 = static_cast<float>(t.beta2());
  options.weight_decay = static_cast<float>(t.weight_decay());
  options.loss_scale = LossScaleFromSpec(t, precision);
  return options;
}

namespace {

// The state of one local run, shared by its phases: the run's shape (checked against the model), the simulated
// groups of replicas, DiLoCo's outer optimizer and the data.
struct LocalRun {
  GPT2Config config;
  int global_batch = 0, T = 0;
  int micro = 1;    // microbatches per replica
  int dp = 1;       // replicas
  int present = 1;  // replicas training (dp, unless LocalTrainOptions::replicas left some out)
  int mb = 0;       // rows of a microbatch
  bool diloco = false;
  DilocoSpec d;               // EffectiveDiloco(spec)
  std::vector<int> group_of;  // each replica's group
  int num_groups = 1;
  Precision precision = Precision::kFp32;
  // bf16 / fp16: the GEMMs take rounded inputs as a GPU's would (model/precision.h); fp32 keeps the plain CPU path.
  // Declared before the groups, whose models' memory it owns, so that it outlives them.
  std::unique_ptr<Backend> backend;
  std::vector<Group> groups;
  std::unique_ptr<OuterOptimizer> outer;  // DiLoCo only
  DilocoSchedule outer_schedule;
  // Whether each group's pseudo-gradient goes through LocalTrainOptions::outer_codec before the groups' sum.
  bool round_outer = false;
  LearningRateSchedule schedule;
  std::unique_ptr<DataLoader> train;
  std::unique_ptr<DataLoader> val;  // null without validation
  int start_step = 0;
};

// The run's shape: the batch in microbatches, checked against the model and the data, and the replicas' groups.
absl::Status PlanReplicas(const JobSpec& spec, LocalRun* run) {
  ASSIGN_OR_RETURN(run->config, GPT2Config::FromSpec(spec.model()));
  const TrainSpec& t = spec.train();
  const int global_batch = t.global_batch(), T = t.seq_len();
  const int micro = spec.parallel().microbatches() > 0 ? spec.parallel().microbatches() : 1;
  if (global_batch % micro != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.global_batch ", global_batch, " must be a multiple of parallel.microbatches ", micro));
  }
  if (T > run->config.block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.seq_len ", T, " exceeds the model's block_size ", run->config.block_size));
  }
  if (spec.data().train().empty()) {
    return absl::InvalidArgumentError("data.train is empty; give a glob of .bin shards from `geotrain data prepare`");
  }
  const int Bm = global_batch / micro;
  // parallel.dp replicas, each taking its share of the global batch in microbatches of the cluster's size
  // (the rows the cluster's replicas take, and the validation rows each evaluates). Synchronous: one group
  // holds them all. DiLoCo: grouped by the site of their placement (one group each without one).
  const bool diloco = DilocoOn(spec);
  const int dp = std::max(1, spec.parallel().dp());
  if (global_batch % (dp * micro) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("train.global_batch ", global_batch,
                                                   " must be a multiple of parallel.dp x microbatches (", dp * micro,
                                                   "): each replica takes microbatches of the same size"));
  }
  std::vector<std::string> replica_sites(dp);
  for (int r = 0; r < dp; ++r) replica_sites[r] = diloco ? absl::StrCat("replica ", r) : "";
  for (const PlacementSpec& p : spec.parallel().placement()) {
    const bool first_stage = p.stage() == 0 && p.tp_rank() == 0;  // a replica's site is its first stage's
    if (diloco && first_stage && p.replica() >= 0 && p.replica() < dp && !p.site().empty()) {
      replica_sites[p.replica()] = p.site();
    }
  }
  run->global_batch = global_batch;
  run->T = T;
  run->micro = micro;
  run->dp = dp;
  run->present = dp;
  run->mb = Bm / dp;
  run->diloco = diloco;
  run->d = EffectiveDiloco(spec);
  run->group_of = DilocoGroups(replica_sites);
  run->num_groups = *std::max_element(run->group_of.begin(), run->group_of.end()) + 1;
  return absl::OkStatus();
}

// Each group's model (initialised from train.seed) and AdamW, the rows it takes, and DiLoCo's outer optimizer.
absl::Status BuildGroups(const JobSpec& spec, LocalRun* run) {
  ASSIGN_OR_RETURN(run->precision, SpecPrecision(spec));
  if (run->precision != Precision::kFp32) {
    ASSIGN_OR_RETURN(run->backend, MakeBackend("cpu", run->precision));
  }
  run->groups.resize(run->num_groups);
  StageOptions stage_options;
  stage_options.max_batch = run->mb;
  stage_options.max_seq_len = run->T;
  stage_options.backend = run->backend.get();
  const AdamWOptions adam_options = TrainOptimizerOptions(spec, run->precision);
  for (int r = 0; r < run->dp; ++r) {
    Group& g = run->groups[run->group_of[r]];
    for (int m = 0; m < run->micro; ++m) g.microbatch_rows.push_back(r * run->micro * run->mb + m * run->mb);
  }
  for (Group& g : run->groups) {
    ASSIGN_OR_RETURN(g.model, GPT2Stage::Create(run->config, stage_options));
    g.model->InitializeWeights(spec.train().seed());
    g.adam = std::make_unique<AdamW>(g.model->num_params(), g.model->segments(), adam_options);
    g.loss_scale = 1.0f / static_cast<float>(g.microbatch_rows.size());
  }
  GPT2Stage& model = *run->groups[0].model;
  const DilocoSpec& d = run->d;
  run->outer_schedule = {
      .inner_steps = d.inner_steps(), .fragments = d.fragments(), .total_steps = spec.train().steps()};
  if (run->diloco) {
    if (d.sync() == "time") {
      return absl::FailedPreconditionError(
          "diloco.sync time paces the groups by the wall time their sites take, which one process cannot simulate; "
          "run the job on a cluster, or simulate it here with sync steps");
    }
    if (d.fragments() > run->config.n_layer) {
      return absl::InvalidArgumentError(absl::StrCat("diloco.fragments ", d.fragments(), " exceeds the model's ",
                                                     run->config.n_layer,
                                                     " blocks; use at most one fragment per block"));
    }
    run->outer = std::make_unique<OuterOptimizer>(
        FragmentRanges(model, d.fragments()), model.num_params(),
        OuterOptions{.lr = d.outer_lr(), .momentum = d.outer_momentum(), .nesterov = d.nesterov()});
    run->outer->Initialize(model.params());
  }
  run->schedule = TrainSchedule(spec, run->num_groups);
  return absl::OkStatus();
}

// LocalTrainOptions::replicas: from now on the synchronous group trains (and evaluates) only those replicas' rows.
absl::Status KeepReplicas(const std::vector<int>& replicas, LocalRun* run) {
  if (run->num_groups != 1 || replicas.empty()) {
    return absl::InvalidArgumentError(
        "simulating a job without some replicas needs a synchronous job (no diloco) "
        "and at least one replica left");
  }
  Group& g = run->groups[0];
  g.microbatch_rows.clear();
  for (int r : replicas) {
    if (r < 0 || r >= run->dp) {
      return absl::InvalidArgumentError(absl::StrCat("replica ", r, " is not one of the job's ", run->dp,
                                                     " replicas (0 to ", run->dp - 1,
                                                     "); name the ones that trained on"));
    }
    for (int m = 0; m < run->micro; ++m) g.microbatch_rows.push_back(r * run->micro * run->mb + m * run->mb);
  }
  g.loss_scale = 1.0f / static_cast<float>(g.microbatch_rows.size());
  run->present = static_cast<int>(replicas.size());
  return absl::OkStatus();
}

// The loaders of data.train and (when the run evaluates) data.val: one replica's view of the global batch.
absl::Status OpenData(const JobSpec& spec, LocalRun* run) {
  ASSIGN_OR_RETURN(run->train,
                   DataLoader::Create(spec.data().train(), run->global_batch, run->T, 0, 1, run->config.vocab_size));
  if (!spec.data().val().empty() && spec.train().eval_every() > 0) {
    auto v = DataLoader::Create(spec.data().val(), run->global_batch, run->T, 0, 1, run->config.vocab_size);
    if (!v.ok()) return WithContext(v.status(), kValidationDataContext);
    run->val = std::move(*v);
  }
  return absl::OkStatus();
}

// Loads the checkpoint to resume from, if any: every group's model and AdamW, the outer optimizer and the data
// position; run->start_step is its step.
absl::Status Resume(const JobSpec& spec, const LocalTrainOptions& options, LocalRun* run) {
  // Where to resume from: checkpoint.resume_from (a step directory or a checkpoint directory, of a local or a
  // cluster run), else checkpoint.dir with --resume or `resume: auto`.
  const std::string resume_from = !spec.checkpoint().resume_from().empty() ? spec.checkpoint().resume_from()
                                  : (options.resume || spec.checkpoint().resume() == "auto") ? spec.checkpoint().dir()
                                                                                             : std::string();
  if (options.resume && resume_from.empty()) {
    return absl::InvalidArgumentError("--resume needs checkpoint.dir (or checkpoint.resume_from) in the spec");
  }
  if (resume_from.empty()) return absl::OkStatus();
  absl::StatusOr<CheckpointInfo> info;
  for (int g = 0; g < run->num_groups && (g == 0 || info.ok()); ++g) {
    info = LoadCheckpoint(resume_from, *run->groups[g].model, *run->groups[g].adam,
                          {.group = g, .outer = g == 0 ? run->outer.get() : nullptr});
  }
  const bool required = !spec.checkpoint().resume_from().empty();
  if (info.ok()) {
    for (const std::string& why : info->skipped) std::fprintf(options.out, "skipped a checkpoint: %s\n", why.c_str());
    run->start_step = static_cast<int>(info->step);
    RETURN_IF_ERROR(run->train->Restore(info->data_position));
    std::fprintf(options.out, "resumed from %s at step %d\n", info->directory.c_str(), run->start_step);
  } else if (info.status().code() != absl::StatusCode::kNotFound || required) {
    return info.status();
  } else {
    std::fprintf(options.out, "%s; starting from step 0\n", std::string(info.status().message()).c_str());
  }
  return absl::OkStatus();
}

// The lines that open the run's output: the model and batch, the emulated precision, DiLoCo's simulation.
void PrintRunSummary(const JobSpec& spec, const LocalTrainOptions& options, const LocalRun& run) {
  const GPT2Config& config = run.config;
  std::fprintf(options.out,
               "model: %d layers, %d heads, %d channels, vocab %d (%lld parameters); batch %d x %d "
               "in %d microbatches; %d steps\n",
               config.n_layer, config.n_head, config.n_embd, config.vocab_size,
               static_cast<long long>(config.NumParameters()), run.global_batch, run.T, run.micro,
               spec.train().steps());
  if (run.precision != Precision::kFp32) {
    const LossScaler& scaler = run.groups.front().adam->loss_scaler();
    std::fprintf(options.out,
                 "precision: %s GEMMs, emulated on the CPU (inputs rounded as a GPU's tensor cores take "
                 "them; fp32 weights and AdamW)%s\n",
                 std::string(PrecisionName(run.precision)).c_str(),
                 scaler.enabled() ? absl::StrFormat("; dynamic loss scale from %g", scaler.scale()).c_str() : "");
  }
  if (run.diloco) {
    const DilocoSpec& d = run.d;
    std::fprintf(options.out,
                 "DiLoCo simulated: %d replicas in %d groups; outer step every %d steps (lr %g, momentum %g%s) in %d "
                 "fragment(s); inner lr x %g (at most train.lr); pseudo-gradients %s\n",
                 run.dp, run.num_groups, d.inner_steps(), d.outer_lr(), d.outer_momentum(),
                 d.nesterov() ? ", Nesterov" : "", d.fragments(), run.schedule.scale,
                 run.round_outer ? absl::StrCat("rounded by ", d.codec(), " as the cluster sends them").c_str()
                                 : "averaged exactly");
  }
}

// DiLoCo's outer exchange of fragment f: every group's pseudo-gradient, averaged by the groups' shares (each
// share rounded by the outer codec as the cluster sends it, when options.outer_codec says how and there is an
// exchange: one group sends nothing).
absl::Status AverageDelta(const LocalRun& run, const LocalTrainOptions& options, int f, std::vector<float>* sum) {
  sum->assign(static_cast<size_t>(run.outer->FragmentSize(f)), 0.0f);
  std::vector<float> delta;
  for (int g = 0; g < run.num_groups; ++g) {
    run.outer->PseudoGradient(f, run.groups[g].model->params(), &delta);
    const float w = static_cast<float>(run.groups[g].microbatch_rows.size()) / static_cast<float>(run.dp * run.micro);
    for (float& x : delta) x *= w;
    if (run.round_outer) RETURN_IF_ERROR(options.outer_codec(g, f, absl::MakeSpan(delta)));
    for (size_t i = 0; i < sum->size(); ++i) (*sum)[i] += delta[i];
  }
  return absl::OkStatus();
}

// An outer exchange started at the beginning of a step: its averaged pseudo-gradient, and each group's parameters
// of the fragment then, which the outer step applies to at the step's end.
struct PendingExchange {
  int fragment;
  std::vector<float> delta;
  std::vector<std::vector<float>> snapshots;  // per group
};

// DiLoCo: the exchanges the schedule starts at the beginning of `step` (0-based).
absl::StatusOr<std::vector<PendingExchange>> StartOuterExchanges(const LocalRun& run, const LocalTrainOptions& options,
                                                                 int step) {
  std::vector<PendingExchange> pending;
  for (int f : run.outer_schedule.StartAtBeginning(step + 1)) {
    PendingExchange p{f, {}, std::vector<std::vector<float>>(run.num_groups)};
    RETURN_IF_ERROR(AverageDelta(run, options, f, &p.delta));
    for (int g = 0; g < run.num_groups; ++g) run.outer->Pack(f, run.groups[g].model->params(), &p.snapshots[g]);
    pending.push_back(std::move(p));
  }
  return pending;
}

// DiLoCo, at the end of `step` (0-based): the outer steps of the exchanges started with it, then the blocking ones.
absl::Status FinishOuterExchanges(LocalRun& run, const LocalTrainOptions& options, int step,
                                  const std::vector<PendingExchange>& pending) {
  for (const PendingExchange& p : pending) {
    run.outer->Step(p.fragment, p.delta.data());
    for (int g = 0; g < run.num_groups; ++g) {
      run.outer->Apply(p.fragment, run.groups[g].model->params(), p.snapshots[g].data());
    }
  }
  for (int f : run.outer_schedule.BlockingAfter(step + 1)) {
    std::vector<float> delta;
    RETURN_IF_ERROR(AverageDelta(run, options, f, &delta));
    run.outer->Step(f, delta.data());
    for (Group& g : run.groups) run.outer->Apply(f, g.model->params(), nullptr);
  }
  return absl::OkStatus();
}

// Every group's forward and backward over its microbatches of the batch, and its AdamW step at `lr` (fp16: unless
// its gradients overflowed). Returns the sum of the microbatches' losses; record gets group 0's gradient norm, loss
// scale and whether it skipped the step.
absl::StatusOr<double> TrainGroups(const TrainSpec& t, LocalRun& run, const std::vector<int32_t>& inputs,
                                   const std::vector<int32_t>& targets, double lr, StepRecord* record) {
  const int T = run.T;
  double loss_sum = 0.0;
  for (Group& g : run.groups) {
    g.model->ZeroGrad();
    const int rows = run.mb;
    LossScaler& scaler = g.adam->loss_scaler();
    for (int first : g.microbatch_rows) {
      const int64_t off = static_cast<int64_t>(first) * T;
      RETURN_IF_ERROR(g.model->Forward(rows, T, inputs.data() + off, nullptr, targets.data() + off));
      loss_sum += g.model->loss();
      RETURN_IF_ERROR(g.model->Backward(nullptr, g.loss_scale * scaler.scale()));
    }
    // fp16: one decision for the group's gradients, from their squared norm as a float, as the cluster takes it
    // from its all-reduced (float) norm shares: not finite when a gradient is not (or the sum passes FLT_MAX).
    const double squared = g.model->GradSquaredNormShare();
    const bool apply = scaler.Update(!scaler.enabled() || std::isfinite(static_cast<float>(squared)));
    const double group_norm = std::sqrt(squared) / scaler.scale_applied();
    if (&g == &run.groups.front()) {
      record->grad_norm = group_norm;
      record->skipped = !apply;
      record->loss_scale = scaler.scale_applied();
    }
    if (!apply) continue;
    g.adam->Step(g.model->params(), g.model->grads(), static_cast<float>(lr),
                 ClipScale(group_norm, t.grad_clip()) / scaler.scale_applied());
  }
  return loss_sum;
}

// The mean over eval_batches global batches of data.val, in the microbatches each replica evaluates (equal
// sizes): the same tokens for every plan.
absl::StatusOr<float> ValidationLoss(const TrainSpec& t, LocalRun& run) {
  run.val->Reset();
  std::vector<int32_t> vx(static_cast<size_t>(run.global_batch) * run.T), vy(vx.size());
  double vsum = 0.0;
  int64_t pieces = 0;
  const int batches = std::max(1, t.eval_batches());
  for (int k = 0; k < batches; ++k) {
    RETURN_IF_ERROR(run.val->Next(vx.data(), vy.data()));
    for (Group& g : run.groups) {
      for (int first : g.microbatch_rows) {
        const int64_t off = static_cast<int64_t>(first) * run.T;
        RETURN_IF_ERROR(g.model->Forward(run.mb, run.T, vx.data() + off, nullptr, vy.data() + off));
        vsum += g.model->loss();
        ++pieces;
      }
    }
  }
  return static_cast<float>(vsum / pieces);
}

// The step's line of output (with a progress bar under it when asked for one).
void PrintStep(const TrainSpec& t, const LocalTrainOptions& options, const LocalRun& run, const StepRecord& rec,
               double seconds, std::chrono::steady_clock::time_point run_start) {
  std::string line = absl::StrCat("step ", rec.step, "/", t.steps(), " | loss ", absl::StrFormat("%.4f", rec.loss));
  if (rec.val_loss >= 0) absl::StrAppend(&line, " | val ", absl::StrFormat("%.4f", rec.val_loss));
  absl::StrAppend(&line, absl::StrFormat(" | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms", rec.lr, rec.grad_norm,
                                         rec.tokens_per_second, seconds * 1e3));
  if (run.groups.front().adam->loss_scaler().enabled()) {
    absl::StrAppend(&line,
                    absl::StrFormat(" | loss scale %g%s", rec.loss_scale, rec.skipped ? " (overflow: skipped)" : ""));
  }
  if (options.progress_bar) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double left = elapsed / (rec.step - run.start_step) * (t.steps() - rec.step);
    std::fprintf(options.out, "\r\033[K%s\n%s", line.c_str(), ProgressBar(rec.step, t.steps(), left).c_str());
  } else {
    std::fprintf(options.out, "%s\n", line.c_str());
  }
  std::fflush(options.out);
}

// Every group's model and AdamW, the outer optimizer and the data position at `step` (1-based) into checkpoint.dir,
// then the oldest pruned.
absl::Status SaveStep(const JobSpec& spec, LocalRun& run, int step) {
  std::vector<std::pair<GPT2Stage*, AdamW*>> states;
  for (Group& g : run.groups) states.push_back({g.model.get(), g.adam.get()});
  const std::string& dir = spec.checkpoint().dir();
  RETURN_IF_ERROR(SaveCheckpoint(dir, step, states, run.outer.get(), run.train->position()));
  return PruneCheckpoints(dir, CheckpointsKept(spec.checkpoint()));
}

}  // namespace

absl::Status LocalTrainer::Run(const JobSpec& spec, const LocalTrainOptions& options) {
  LocalRun run;
  RETURN_IF_ERROR(PlanReplicas(spec, &run));
  RETURN_IF_ERROR(BuildGroups(spec, &run));
  RETURN_IF_ERROR(OpenData(spec, &run));
  RETURN_IF_ERROR(Resume(spec, options, &run));
  run.round_outer = run.diloco && options.outer_codec && run.num_groups > 1;
  PrintRunSummary(spec, options, run);

  const TrainSpec& t = spec.train();
  const std::string& ckpt_dir = spec.checkpoint().dir();
  std::vector<int32_t> inputs(static_cast<size_t>(run.global_batch) * run.T), targets(inputs.size());
  const auto run_start = std::chrono::steady_clock::now();
  for (int step = run.start_step; step < t.steps(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<PendingExchange> pending;
    if (run.diloco) {
      ASSIGN_OR_RETURN(pending, StartOuterExchanges(run, options, step));
    }
    if (options.replicas_from_step == step + 1) RETURN_IF_ERROR(KeepReplicas(options.replicas, &run));
    if (options.healed_from_step == step + 1) {
      std::vector<int> all(static_cast<size_t>(run.dp));
      std::iota(all.begin(), all.end(), 0);
      RETURN_IF_ERROR(KeepReplicas(all, &run));
    }
    RETURN_IF_ERROR(run.train->Next(inputs.data(), targets.data()));
    StepRecord rec;
    rec.step = step + 1;
    rec.lr = run.schedule.At(step);
    ASSIGN_OR_RETURN(const double loss_sum, TrainGroups(t, run, inputs, targets, rec.lr, &rec));
    if (run.diloco) RETURN_IF_ERROR(FinishOuterExchanges(run, options, step, pending));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec.loss = static_cast<float>(loss_sum / (run.micro * run.present));
    rec.tokens_per_second = static_cast<double>(run.global_batch) * run.T / seconds;
    const bool last = step + 1 == t.steps();
    if (run.val != nullptr && ((step + 1) % t.eval_every() == 0 || last)) {
      ASSIGN_OR_RETURN(rec.val_loss, ValidationLoss(t, run));
    }
    history_.push_back(rec);
    PrintStep(t, options, run, rec, seconds, run_start);
    if (!ckpt_dir.empty() &&
        ((spec.checkpoint().every_steps() > 0 && (step + 1) % spec.checkpoint().every_steps() == 0) || last)) {
      RETURN_IF_ERROR(SaveStep(spec, run, step + 1));
    }
    if (options.stop_after_step > 0 && step + 1 >= options.stop_after_step) break;
  }
  if (options.progress_bar) std::fprintf(options.out, "\n");
  return absl::OkStatus();
}

}  // namespace geotrain::model
