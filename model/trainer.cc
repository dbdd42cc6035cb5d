// The single-process training loop (see trainer.h).
#include "model/trainer.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/data.h"
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

}  // namespace

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
  StageOptions stage_options;
  stage_options.max_batch = Bm;
  stage_options.max_seq_len = T;
  absl::StatusOr<std::unique_ptr<GPT2Stage>> model_or = GPT2Stage::Create(*config, stage_options);
  if (!model_or.ok()) return model_or.status();
  GPT2Stage& model = **model_or;
  model.InitializeWeights(t.seed());
  AdamWOptions adam_options;
  adam_options.beta1 = static_cast<float>(t.beta1());
  adam_options.beta2 = static_cast<float>(t.beta2());
  adam_options.weight_decay = static_cast<float>(t.weight_decay());
  AdamW adam(model.num_params(), model.segments(), adam_options);
  LearningRateSchedule schedule{
      .max_lr = t.lr(), .min_lr = t.min_lr(), .warmup_steps = t.warmup_steps(), .total_steps = t.steps()};

  auto train = DataLoader::Create(spec.data().train(), global_batch, T, 0, 1, config->vocab_size);
  if (!train.ok()) return train.status();
  std::unique_ptr<DataLoader> val;
  if (!spec.data().val().empty() && t.eval_every() > 0) {
    auto v = DataLoader::Create(spec.data().val(), Bm, T, 0, 1, config->vocab_size);
    if (!v.ok()) return v.status();
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
    absl::StatusOr<CheckpointInfo> info = LoadCheckpoint(resume_from, model, adam);
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

  std::vector<int32_t> inputs(static_cast<size_t>(global_batch) * T), targets(inputs.size());
  const auto run_start = std::chrono::steady_clock::now();
  for (int step = start_step; step < t.steps(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR((*train)->Next(inputs.data(), targets.data()));
    model.ZeroGrad();
    double loss_sum = 0.0;
    for (int m = 0; m < micro; ++m) {
      const int64_t off = static_cast<int64_t>(m) * Bm * T;
      if (absl::Status s = model.Forward(Bm, T, inputs.data() + off, nullptr, targets.data() + off); !s.ok()) return s;
      loss_sum += model.loss();
      if (absl::Status s = model.Backward(nullptr, 1.0f / micro); !s.ok()) return s;
    }
    const double norm = std::sqrt(model.GradSquaredNormShare());
    const double lr = schedule.At(step);
    adam.Step(model.params(), model.grads(), static_cast<float>(lr), ClipScale(norm, t.grad_clip()));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepRecord rec;
    rec.step = step + 1;
    rec.loss = static_cast<float>(loss_sum / micro);
    rec.lr = lr;
    rec.grad_norm = norm;
    rec.tokens_per_second = static_cast<double>(global_batch) * T / seconds;
    const bool last = step + 1 == t.steps();
    if (val != nullptr && ((step + 1) % t.eval_every() == 0 || last)) {
      val->Reset();
      std::vector<int32_t> vx(static_cast<size_t>(Bm) * T), vy(vx.size());
      double vsum = 0.0;
      const int batches = std::max(1, t.eval_batches());
      for (int k = 0; k < batches; ++k) {
        RETURN_IF_ERROR(val->Next(vx.data(), vy.data()));
        if (absl::Status s = model.Forward(Bm, T, vx.data(), nullptr, vy.data()); !s.ok()) return s;
        vsum += model.loss();
      }
      rec.val_loss = static_cast<float>(vsum / batches);
    }
    history_.push_back(rec);
    std::string line = absl::StrCat("step ", rec.step, "/", t.steps(), " | loss ", absl::StrFormat("%.4f", rec.loss));
    if (rec.val_loss >= 0) absl::StrAppend(&line, " | val ", absl::StrFormat("%.4f", rec.val_loss));
    absl::StrAppend(&line, absl::StrFormat(" | lr %.2e | norm %.3f | %.0f tok/s | %.0f ms", lr, norm,
                                           rec.tokens_per_second, seconds * 1e3));
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
      RETURN_IF_ERROR(SaveCheckpoint(ckpt_dir, step + 1, model, adam, (*train)->position()));
      RETURN_IF_ERROR(PruneCheckpoints(ckpt_dir, CheckpointsKept(spec.checkpoint())));
    }
    if (options.stop_after_step > 0 && step + 1 >= options.stop_after_step) break;
  }
  if (options.progress_bar) std::fprintf(options.out, "\n");
  return absl::OkStatus();
}

}  // namespace geotrain::model
