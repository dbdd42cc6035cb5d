// The single-process training loop (see trainer.h).
#include "model/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>

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

LearningRateSchedule TrainSchedule(const JobSpec& spec) {
  const TrainSpec& t = spec.train();
  return {.max_lr = t.lr(),
          .min_lr = t.min_lr(),
          .warmup_steps = t.warmup_steps(),
          .total_steps = t.steps(),
          .scale = DilocoOn(spec) ? EffectiveDiloco(spec).inner_lr_scale() : 1.0};
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

absl::Status LocalTrainer::Run(const JobSpec& spec, const LocalTrainOptions& options) {
  absl::StatusOr<GPT2Config> config = GPT2Config::FromSpec(spec.model());
  if (!config.ok()) return config.status();
  const TrainSpec& t = spec.train();
  const int global_batch = t.global_batch(), T = t.seq_len();
  const int micro = spec.parallel().microbatches() > 0 ? spec.parallel().microbatches() : 1;
  if (global_batch % micro != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.global_batch ", global_batch, " must be a multiple of parallel.microbatches ", micro));
  }
  if (T > config->block_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.seq_len ", T, " exceeds the model's block_size ", config->block_size));
  }
  if (spec.data().train().empty()) {
    return absl::InvalidArgumentError("data.train is empty; give a glob of .bin shards from `geotrain data prepare`");
  }
  const int Bm = global_batch / micro;
  // parallel.dp replicas, each taking its share of the global batch in microbatches of the cluster's size
  // (the rows the cluster's replicas take, and the validation rows each evaluates). Synchronous: one group
  // holds them all. DiLoCo: grouped by the site of their placement (one group each without one).
  const bool diloco = DilocoOn(spec);
  const DilocoSpec d = EffectiveDiloco(spec);
  const int dp = std::max(1, spec.parallel().dp());
  if (global_batch % (dp * micro) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("train.global_batch ", global_batch,
                                                   " must be a multiple of parallel.dp x microbatches (", dp * micro,
                                                   "): each replica takes microbatches of the same size"));
  }
  const int mb = Bm / dp;
  std::vector<std::string> replica_sites(dp);
  for (int r = 0; r < dp; ++r) replica_sites[r] = diloco ? absl::StrCat("replica ", r) : "";
  for (const PlacementSpec& p : spec.parallel().placement()) {
    const bool first_stage = p.stage() == 0 && p.tp_rank() == 0;  // a replica's site is its first stage's
    if (diloco && first_stage && p.replica() >= 0 && p.replica() < dp && !p.site().empty()) {
      replica_sites[p.replica()] = p.site();
    }
  }
  const std::vector<int> group_of = DilocoGroups(replica_sites);
  const int num_groups = *std::max_element(group_of.begin(), group_of.end()) + 1;
  ASSIGN_OR_RETURN(const Precision precision, SpecPrecision(spec));
  // bf16 / fp16: the GEMMs take rounded inputs as a GPU's would (model/precision.h); fp32 keeps the plain CPU path.
  // Declared before the groups, whose models' memory it owns, so that it outlives them.
  std::unique_ptr<Backend> backend;
  if (precision != Precision::kFp32) {
    ASSIGN_OR_RETURN(backend, MakeBackend("cpu", precision));
  }
  std::vector<Group> groups(num_groups);
  StageOptions stage_options;
  stage_options.max_batch = mb;
  stage_options.max_seq_len = T;
  stage_options.backend = backend.get();
  const AdamWOptions adam_options = TrainOptimizerOptions(spec, precision);
  for (int r = 0; r < dp; ++r) {
    Group& g = groups[group_of[r]];
    for (int m = 0; m < micro; ++m) g.microbatch_rows.push_back(r * micro * mb + m * mb);
  }
  for (Group& g : groups) {
    ASSIGN_OR_RETURN(g.model, GPT2Stage::Create(*config, stage_options));
    g.model->InitializeWeights(t.seed());
    g.adam = std::make_unique<AdamW>(g.model->num_params(), g.model->segments(), adam_options);
    g.loss_scale = 1.0f / static_cast<float>(g.microbatch_rows.size());
  }
  GPT2Stage& model = *groups[0].model;
  std::unique_ptr<OuterOptimizer> outer;
  const DilocoSchedule outer_schedule{
      .inner_steps = d.inner_steps(), .fragments = d.fragments(), .total_steps = t.steps()};
  if (diloco) {
    if (d.fragments() > config->n_layer) {
      return absl::InvalidArgumentError(absl::StrCat("diloco.fragments ", d.fragments(), " exceeds the model's ",
                                                     config->n_layer, " blocks; use at most one fragment per block"));
    }
    outer = std::make_unique<OuterOptimizer>(
        FragmentRanges(model, d.fragments()), model.num_params(),
        OuterOptions{.lr = d.outer_lr(), .momentum = d.outer_momentum(), .nesterov = d.nesterov()});
    outer->Initialize(model.params());
  }
  const LearningRateSchedule schedule = TrainSchedule(spec);

  auto train = DataLoader::Create(spec.data().train(), global_batch, T, 0, 1, config->vocab_size);
  if (!train.ok()) return train.status();
  std::unique_ptr<DataLoader> val;
  if (!spec.data().val().empty() && t.eval_every() > 0) {
    auto v = DataLoader::Create(spec.data().val(), global_batch, T, 0, 1, config->vocab_size);
    if (!v.ok()) return WithContext(v.status(), kValidationDataContext);
    val = std::move(*v);
  }
  const std::string& ckpt_dir = spec.checkpoint().dir();
  int start_step = 0;
  // Where to resume from: checkpoint.resume_from (a step directory or a checkpoint directory, of a local or a
  // cluster run), else checkpoint.dir with --resume or `resume: auto`.
  const std::string resume_from = !spec.checkpoint().resume_from().empty() ? spec.checkpoint().resume_from()
                                  : (options.resume || spec.checkpoint().resume() == "auto") ? ckpt_dir
                                                                                             : std::string();
  if (options.resume && resume_from.empty()) {
    return absl::InvalidArgumentError("--resume needs checkpoint.dir (or checkpoint.resume_from) in the spec");
  }
  if (!resume_from.empty()) {
    absl::StatusOr<CheckpointInfo> info;
    for (int g = 0; g < num_groups && (g == 0 || info.ok()); ++g) {
      info = LoadCheckpoint(resume_from, *groups[g].model, *groups[g].adam,
                            {.group = g, .outer = g == 0 ? outer.get() : nullptr});
    }
    const bool required = !spec.checkpoint().resume_from().empty();
    if (info.ok()) {
      for (const std::string& why : info->skipped) std::fprintf(options.out, "skipped a checkpoint: %s\n", why.c_str());
      start_step = static_cast<int>(info->step);
      RETURN_IF_ERROR((*train)->Restore(info->data_position));
      std::fprintf(options.out, "resumed from %s at step %d\n", info->directory.c_str(), start_step);
    } else if (info.status().code() != absl::StatusCode::kNotFound || required) {
      return info.status();
    } else {
      std::fprintf(options.out, "%s; starting from step 0\n", std::string(info.status().message()).c_str());
    }
  }
  std::fprintf(options.out,
               "model: %d layers, %d heads, %d channels, vocab %d (%lld parameters); batch %d x %d "
               "in %d microbatches; %d steps\n",
               config->n_layer, config->n_head, config->n_embd, config->vocab_size,
               static_cast<long long>(config->NumParameters()), global_batch, T, micro, t.steps());
  if (precision != Precision::kFp32) {
    const LossScaler& scaler = groups.front().adam->loss_scaler();
    std::fprintf(options.out,
                 "precision: %s GEMMs, emulated on the CPU (inputs rounded as a GPU's tensor cores take "
                 "them; fp32 weights and AdamW)%s\n",
                 std::string(PrecisionName(precision)).c_str(),
                 scaler.enabled() ? absl::StrFormat("; dynamic loss scale from %g", scaler.scale()).c_str() : "");
  }
  const bool round_outer = diloco && options.outer_codec && num_groups > 1;
  if (diloco) {
    std::fprintf(options.out,
                 "DiLoCo simulated: %d replicas in %d groups; outer step every %d steps (lr %g, momentum %g%s) in %d "
                 "fragment(s); inner lr x %g (at most train.lr); pseudo-gradients %s\n",
                 dp, num_groups, d.inner_steps(), d.outer_lr(), d.outer_momentum(), d.nesterov() ? ", Nesterov" : "",
                 d.fragments(), d.inner_lr_scale(),
                 round_outer ? absl::StrCat("rounded by ", d.codec(), " as the cluster sends them").c_str()
                             : "averaged exactly");
  }

  // DiLoCo's outer exchange of fragment f: every group's pseudo-gradient, averaged by the groups' shares (each
  // share rounded by the outer codec as the cluster sends it, when options.outer_codec says how and there is an
  // exchange: one group sends nothing).
  auto average_delta = [&](int f, std::vector<float>* sum) -> absl::Status {
    sum->assign(static_cast<size_t>(outer->FragmentSize(f)), 0.0f);
    std::vector<float> delta;
    for (int g = 0; g < num_groups; ++g) {
      outer->PseudoGradient(f, groups[g].model->params(), &delta);
      const float w = static_cast<float>(groups[g].microbatch_rows.size()) / static_cast<float>(dp * micro);
      for (float& x : delta) x *= w;
      if (round_outer) RETURN_IF_ERROR(options.outer_codec(g, f, absl::MakeSpan(delta)));
      for (size_t i = 0; i < sum->size(); ++i) (*sum)[i] += delta[i];
    }
    return absl::OkStatus();
  };
  struct Pending {
    int fragment;
    std::vector<float> delta;
    std::vector<std::vector<float>> snapshots;  // per group
  };

  std::vector<int32_t> inputs(static_cast<size_t>(global_batch) * T), targets(inputs.size());
  const auto run_start = std::chrono::steady_clock::now();
  for (int step = start_step; step < t.steps(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Pending> pending;
    if (diloco) {
      for (int f : outer_schedule.StartAtBeginning(step + 1)) {
        Pending p{f, {}, std::vector<std::vector<float>>(num_groups)};
        RETURN_IF_ERROR(average_delta(f, &p.delta));
        for (int g = 0; g < num_groups; ++g) outer->Pack(f, groups[g].model->params(), &p.snapshots[g]);
        pending.push_back(std::move(p));
      }
    }
    RETURN_IF_ERROR((*train)->Next(inputs.data(), targets.data()));
    const double lr = schedule.At(step);
    double loss_sum = 0.0, norm = 0.0;
    bool skipped = false;
    double scale_used = 1;
    for (Group& g : groups) {
      g.model->ZeroGrad();
      const int rows = static_cast<int>(stage_options.max_batch);
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
      if (&g == &groups.front()) {
        norm = group_norm;
        skipped = !apply;
        scale_used = scaler.scale_applied();
      }
      if (!apply) continue;
      g.adam->Step(g.model->params(), g.model->grads(), static_cast<float>(lr),
                   ClipScale(group_norm, t.grad_clip()) / scaler.scale_applied());
    }
    if (diloco) {
      for (const Pending& p : pending) {
        outer->Step(p.fragment, p.delta.data());
        for (int g = 0; g < num_groups; ++g) outer->Apply(p.fragment, groups[g].model->params(), p.snapshots[g].data());
      }
      for (int f : outer_schedule.BlockingAfter(step + 1)) {
        std::vector<float> delta;
        RETURN_IF_ERROR(average_delta(f, &delta));
        outer->Step(f, delta.data());
        for (Group& g : groups) outer->Apply(f, g.model->params(), nullptr);
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepRecord rec;
    rec.step = step + 1;
    rec.loss = static_cast<float>(loss_sum / (micro * dp));
    rec.lr = lr;
    rec.grad_norm = norm;
    rec.loss_scale = scale_used;
    rec.skipped = skipped;
    rec.tokens_per_second = static_cast<double>(global_batch) * T / seconds;
    const bool last = step + 1 == t.steps();
    if (val != nullptr && ((step + 1) % t.eval_every() == 0 || last)) {
      // The mean over eval_batches global batches of data.val, in the microbatches each replica evaluates (equal
      // sizes): the same tokens for every plan.
      val->Reset();
      std::vector<int32_t> vx(static_cast<size_t>(global_batch) * T), vy(vx.size());
      double vsum = 0.0;
      int64_t pieces = 0;
      const int batches = std::max(1, t.eval_batches());
      for (int k = 0; k < batches; ++k) {
        RETURN_IF_ERROR(val->Next(vx.data(), vy.data()));
        for (Group& g : groups) {
          for (int first : g.microbatch_rows) {
            const int64_t off = static_cast<int64_t>(first) * T;
            RETURN_IF_ERROR(g.model->Forward(mb, T, vx.data() + off, nullptr, vy.data() + off));
            vsum += g.model->loss();
            ++pieces;
          }
        }
      }
      rec.val_loss = static_cast<float>(vsum / pieces);
    }
    history_.push_back(rec);
    std::string line = absl::StrCat("step ", rec.step, "/", t.steps(), " | loss ", absl::StrFormat("%.4f", rec.loss));
    if (rec.val_loss >= 0) absl::StrAppend(&line, " | val ", absl::StrFormat("%.4f", rec.val_loss));
    absl::StrAppend(&line, absl::StrFormat(" | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms", lr, norm,
                                           rec.tokens_per_second, seconds * 1e3));
    if (groups.front().adam->loss_scaler().enabled()) {
      absl::StrAppend(&line, absl::StrFormat(" | loss scale %g%s", scale_used, skipped ? " (overflow: skipped)" : ""));
    }
    if (options.progress_bar) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      const double left = elapsed / (step + 1 - start_step) * (t.steps() - step - 1);
      std::fprintf(options.out, "\r\033[K%s\n%s", line.c_str(), ProgressBar(step + 1, t.steps(), left).c_str());
    } else {
      std::fprintf(options.out, "%s\n", line.c_str());
    }
    std::fflush(options.out);
    if (!ckpt_dir.empty() &&
        ((spec.checkpoint().every_steps() > 0 && (step + 1) % spec.checkpoint().every_steps() == 0) || last)) {
      std::vector<std::pair<GPT2Stage*, AdamW*>> states;
      for (Group& g : groups) states.push_back({g.model.get(), g.adam.get()});
      RETURN_IF_ERROR(SaveCheckpoint(ckpt_dir, step + 1, states, outer.get(), (*train)->position()));
      RETURN_IF_ERROR(PruneCheckpoints(ckpt_dir, CheckpointsKept(spec.checkpoint())));
    }
    if (options.stop_after_step > 0 && step + 1 >= options.stop_after_step) break;
  }
  if (options.progress_bar) std::fprintf(options.out, "\n");
  return absl::OkStatus();
}

}  // namespace geotrain::model
