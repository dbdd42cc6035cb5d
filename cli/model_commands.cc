// Model verbs of the geotrain CLI:
//   geotrain train --local SPEC.yaml [--resume] [--regrouped-at STEP --replicas R,... [--healed-at STEP]]   the reference run
//   geotrain data prepare INPUT... --out DIR [--val-fraction F]
//   geotrain model init --config SPEC.yaml --out W.safetensors [--seed S]
//   geotrain model grad --config SPEC.yaml --weights W.safetensors --tokens X.bin --out G.safetensors
//   geotrain model steps --config SPEC.yaml --weights W.safetensors --tokens X.bin --out P.safetensors
// `grad` and `steps` exist for the parity tests against PyTorch (tests/parity/).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "cli/registry.h"
#include "cli/support.h"
#include "common/spec.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "model/data.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "model/timed_backend.h"
#include "model/tokenizer.h"
#include "model/trainer.h"
#include "worker/devices.h"
#include "worker/stage_trainer.h"

namespace geotrain::cli {
namespace {

using model::GPT2Stage;

struct Loaded {
  JobSpec spec;
  GPT2Config config;
};

absl::StatusOr<Loaded> LoadSpec(const std::string& path) {
  ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpecFile(path));
  ASSIGN_OR_RETURN(GPT2Config config, GPT2Config::FromSpec(spec.model()));
  return Loaded{spec, config};
}

absl::StatusOr<std::unique_ptr<GPT2Stage>> MakeModel(const Loaded& l, const std::string& weights) {
  model::StageOptions o;
  o.max_batch = l.spec.train().global_batch();
  o.max_seq_len = l.spec.train().seq_len();
  ASSIGN_OR_RETURN(std::unique_ptr<GPT2Stage> m, GPT2Stage::Create(l.config, o));
  RETURN_IF_ERROR(model::LoadStageWeights(weights, *m));
  return m;
}

int ModelGrad(const std::string& config_path, const std::string& weights, const std::string& tokens,
              const std::string& out) {
  absl::StatusOr<Loaded> l = LoadSpec(config_path);
  if (!l.ok()) return Fail(l.status());
  const int B = l->spec.train().global_batch(), T = l->spec.train().seq_len();
  absl::StatusOr<std::unique_ptr<GPT2Stage>> m = MakeModel(*l, weights);
  if (!m.ok()) return Fail(m.status());
  auto loader = model::DataLoader::Create(tokens, B, T, 0, 1, l->config.vocab_size);
  if (!loader.ok()) return Fail(loader.status());
  std::vector<int32_t> x(static_cast<size_t>(B) * T), y(x.size());
  if (absl::Status s = (*loader)->Next(x.data(), y.data()); !s.ok()) return Fail(s);
  GPT2Stage& model = **m;
  model.ZeroGrad();
  if (absl::Status s = model.Forward(B, T, x.data(), nullptr, y.data()); !s.ok()) return Fail(s);
  std::vector<model::NamedTensor> tensors;
  model::NamedTensor logits{"logits", {B, T, l->config.vocab_size}, {}};
  const int V = l->config.vocab_size, Vp = l->config.padded_vocab_size;
  logits.data.resize(static_cast<size_t>(B) * T * V);
  for (int64_t n = 0; n < static_cast<int64_t>(B) * T; ++n) {
    std::copy(model.logits() + n * Vp, model.logits() + n * Vp + V, logits.data.begin() + n * V);
  }
  tensors.push_back(std::move(logits));
  tensors.push_back({"loss", {}, {model.loss()}});
  if (absl::Status s = model.Backward(nullptr, 1.0f); !s.ok()) return Fail(s);
  auto grads = model::ExportStageTensors(model, true, "grad.");
  if (!grads.ok()) return Fail(grads.status());
  for (auto& g : *grads) tensors.push_back(std::move(g));
  if (absl::Status s = model::WriteSafetensorsAtomically(out, tensors, {}); !s.ok()) return Fail(s);
  std::printf("loss %.6f; wrote logits, loss and %zu gradients to %s\n", model.loss(), grads->size(), out.c_str());
  return 0;
}

int ModelSteps(const std::string& config_path, const std::string& weights, const std::string& tokens,
               const std::string& out) {
  absl::StatusOr<Loaded> l = LoadSpec(config_path);
  if (!l.ok()) return Fail(l.status());
  const TrainSpec& t = l->spec.train();
  const int B = t.global_batch(), T = t.seq_len();
  absl::StatusOr<std::unique_ptr<GPT2Stage>> m = MakeModel(*l, weights);
  if (!m.ok()) return Fail(m.status());
  auto loader = model::DataLoader::Create(tokens, B, T, 0, 1, l->config.vocab_size);
  if (!loader.ok()) return Fail(loader.status());
  GPT2Stage& model = **m;
  // fp32, as PyTorch's reference runs it.
  model::AdamW adam(model.num_params(), model.segments(),
                    model::TrainOptimizerOptions(l->spec, model::Precision::kFp32));
  // One process, no DiLoCo: train's schedule as it is (model::TrainSchedule would apply a diloco block's
  // inner_lr_scale, which this parity tool does not simulate).
  model::LearningRateSchedule schedule{
      .max_lr = t.lr(), .min_lr = t.min_lr(), .warmup_steps = t.warmup_steps(), .total_steps = t.steps()};
  std::vector<int32_t> x(static_cast<size_t>(B) * T), y(x.size());
  model::NamedTensor losses{"losses", {t.steps()}, {}};
  for (int step = 0; step < t.steps(); ++step) {
    if (absl::Status s = (*loader)->Next(x.data(), y.data()); !s.ok()) return Fail(s);
    model.ZeroGrad();
    if (absl::Status s = model.Forward(B, T, x.data(), nullptr, y.data()); !s.ok()) return Fail(s);
    losses.data.push_back(model.loss());
    if (absl::Status s = model.Backward(nullptr, 1.0f); !s.ok()) return Fail(s);
    const double norm = std::sqrt(model.GradSquaredNormShare());
    adam.Step(model.params(), model.grads(), static_cast<float>(schedule.At(step)),
              model::ClipScale(norm, t.grad_clip()));
  }
  auto params = model::ExportStageTensors(model, false);
  if (!params.ok()) return Fail(params.status());
  params->push_back(std::move(losses));
  if (absl::Status s = model::WriteSafetensorsAtomically(out, *params, {}); !s.ok()) return Fail(s);
  std::printf("ran %d AdamW steps; wrote parameters and losses to %s\n", t.steps(), out.c_str());
  return 0;
}

int ModelInit(const std::string& config_path, const std::string& out, uint64_t seed) {
  absl::StatusOr<Loaded> l = LoadSpec(config_path);
  if (!l.ok()) return Fail(l.status());
  model::StageOptions o;
  o.max_batch = 1;
  o.max_seq_len = 1;
  absl::StatusOr<std::unique_ptr<GPT2Stage>> m = GPT2Stage::Create(l->config, o);
  if (!m.ok()) return Fail(m.status());
  (*m)->InitializeWeights(seed != 0 ? seed : l->spec.train().seed());
  if (absl::Status s = model::SaveStageWeights(out, **m); !s.ok()) return Fail(s);
  std::printf("wrote GPT-2 weights (%lld parameters) to %s\n", static_cast<long long>(l->config.NumParameters()),
              out.c_str());
  return 0;
}

int DataPrepare(const std::vector<std::string>& inputs, const std::string& out, double val_fraction) {
  absl::StatusOr<std::string> dir = model::FindTokenizerDir("");
  if (!dir.ok()) return Fail(dir.status());
  auto tokenizer = model::Tokenizer::Load(*dir);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto stats = model::PrepareTextData(inputs, out, val_fraction, **tokenizer);
  if (!stats.ok()) return Fail(stats.status());
  std::printf("%lld documents: %lld train tokens, %lld val tokens\n", static_cast<long long>(stats->documents),
              static_cast<long long>(stats->train_tokens), static_cast<long long>(stats->val_tokens));
  for (const std::string& f : stats->files_written) std::printf("wrote %s\n", f.c_str());
  return 0;
}

// geotrain model timed-step: the emulated seconds of one training step of a whole model on an emulated device,
// as timed compute waits them (worker/devices.h profile, model/timed_backend.h).
struct TimedStepArgs {
  std::string model = "gpt2";
  std::string device = "H100";
  std::string profiles;
  std::string precision = "bf16";
  int batch = 1, seq_len = 1024, microbatches = 1;
  bool json = false;
};

int TimedStep(const TimedStepArgs& a) {
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset(a.model);
  if (!config.ok()) return Fail(config.status());
  absl::StatusOr<worker::DeviceProfile> profile = worker::ParseDeviceProfile(a.device);
  if (!profile.ok()) return Fail(profile.status());
  if (!a.profiles.empty()) {
    if (absl::StatusOr<bool> c = worker::CalibrateDeviceProfile(a.profiles, &*profile); !c.ok())
      return Fail(c.status());
  }
  if (absl::Status s = worker::TimedDeviceName(*profile).status(); !s.ok()) return Fail(s);
  absl::StatusOr<model::Precision> precision = model::ParsePrecision(a.precision);
  if (!precision.ok()) return Fail(precision.status());
  const model::Roofline r = profile->roofline(*precision);
  absl::StatusOr<double> seconds = model::PredictTrainingStepSeconds(*config, a.batch, a.seq_len, a.microbatches, r);
  if (!seconds.ok()) return Fail(seconds.status());
  if (a.json) {
    const Json json = {{"model", a.model},
                       {"device", profile->name},
                       {"batch", a.batch},
                       {"seq_len", a.seq_len},
                       {"microbatches", a.microbatches},
                       {"precision", a.precision},
                       {"achieved_tflops", JsonFigure(r.flops_per_s / 1e12, 6)},
                       {"achieved_bandwidth_gbs", JsonFigure(r.bytes_per_s / 1e9, 6)},
                       {"launch_us", JsonFigure(r.launch_s * 1e6, 6)},
                       {"step_seconds", JsonFigure(*seconds, 9)},
                       {"source", profile->source}};
    std::printf("%s\n", DumpJson(json).c_str());
  } else {
    std::printf(
        "EMULATED %s step of %s in %s, %d x %d microbatch x %d: %.6f s (%.1f TFLOP/s, %.0f GB/s achieved, %.0f us "
        "per op; %s)\n",
        profile->name.c_str(), a.model.c_str(), a.precision.c_str(), a.batch, a.seq_len, a.microbatches, *seconds,
        r.flops_per_s / 1e12, r.bytes_per_s / 1e9, r.launch_s * 1e6, profile->source.c_str());
  }
  return 0;
}

void AddTimedStepCommand(CLI::App* model_cmd, Context& context) {
  auto args = std::make_shared<TimedStepArgs>();
  auto* cmd = model_cmd->add_subcommand(
      "timed-step", "Emulated seconds of one training step on an emulated GPU, as --timed-compute waits them");
  cmd->add_option("--model", args->model, "GPT-2 preset")->capture_default_str();
  cmd->add_option("--device", args->device, "NAME[:TFLOPS:MEM_GB[:BW_GBS]]")->capture_default_str();
  AddDeviceProfilesOption(cmd, &args->profiles);
  cmd->add_option("--batch", args->batch, "microbatch size B")->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len, "sequence length T")->capture_default_str();
  cmd->add_option("--microbatches", args->microbatches, "microbatches per step")->capture_default_str();
  cmd->add_option("--precision", args->precision,
                  "bf16, fp16 (the tensor cores' peak) or fp32 (a known GPU's CUDA cores' peak)")
      ->capture_default_str();
  AddJsonFlag(cmd, &args->json);
  cmd->callback([&context, args]() { context.exit_code = TimedStep(*args); });
}

void AddModelCommands(CLI::App& app, Context& context) {
  // geotrain train --local SPEC.yaml [--resume]
  auto* train = app.add_subcommand("train", "Train a job spec in this process (--local): the reference run");
  auto train_spec = std::make_shared<std::string>();
  auto resume = std::make_shared<bool>(false);
  train->add_option("--local", *train_spec, "Job spec (YAML or JSON) to train in this process")->required();
  train->add_flag("--resume", *resume, "Continue from the latest checkpoint in checkpoint.dir");
  // What a cluster job trained after a live regroup: from --regrouped-at on, only --replicas' rows of each batch.
  auto regrouped_at = std::make_shared<int>(0);
  auto replicas = std::make_shared<std::vector<int>>();
  train->add_option("--regrouped-at", *regrouped_at,
                    "Simulate a job that went on with fewer replicas after a fault: from this step on (the one its "
                    "log says they train next) only --replicas train");
  train->add_option("--replicas", *replicas, "With --regrouped-at: the replicas that trained on (e.g. 0,2)")
      ->delimiter(',');
  auto healed_at = std::make_shared<int>(0);
  train->add_option("--healed-at", *healed_at,
                    "With --regrouped-at: the job healed, every replica training again from this step on (the one its "
                    "log says they train next)");
  train->callback([&context, train_spec, resume, regrouped_at, replicas, healed_at]() {
    absl::StatusOr<JobSpec> spec = LoadJobSpecFile(*train_spec);
    if (!spec.ok()) {
      context.exit_code = Fail(spec.status());
      return;
    }
    model::LocalTrainer trainer;
    model::LocalTrainOptions options;
    options.resume = *resume;
    if ((*regrouped_at > 0) != !replicas->empty()) {
      context.exit_code = Fail(absl::InvalidArgumentError(
          "--regrouped-at and --replicas go together: the step the replicas left trained next, and which they are"));
      return;
    }
    if (*healed_at > 0 && *healed_at <= *regrouped_at) {
      context.exit_code = Fail(absl::InvalidArgumentError(
          "--healed-at comes after --regrouped-at: the step the healed replicas train first, once they left"));
      return;
    }
    options.replicas_from_step = *regrouped_at;
    options.replicas = *replicas;
    options.healed_from_step = *healed_at;
    options.progress_bar = ::isatty(::fileno(stdout));
    // DiLoCo's pseudo-gradients rounded by diloco.codec, as the cluster sends them.
    absl::StatusOr<std::function<absl::Status(int, int, absl::Span<float>)>> outer_codec =
        worker::SimulatedOuterCodec(*spec);
    if (!outer_codec.ok()) {
      context.exit_code = Fail(outer_codec.status());
      return;
    }
    options.outer_codec = *std::move(outer_codec);
    if (absl::Status s = trainer.Run(*spec, options); !s.ok()) context.exit_code = Fail(s);
  });

  // geotrain data prepare INPUT... --out DIR [--val-fraction F]
  auto* data = app.add_subcommand("data", "Token data: prepare shards from text");
  data->require_subcommand(1);
  auto* prepare = data->add_subcommand("prepare", "Tokenize text files or directories into .bin shards");
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto out_dir = std::make_shared<std::string>();
  auto val_fraction = std::make_shared<double>(0.01);
  prepare->add_option("inputs", *inputs, "Text files or directories (fortune files split on '%' lines)")->required();
  prepare->add_option("--out", *out_dir, "Output directory for train_NNNNNN.bin and val_000000.bin")->required();
  prepare->add_option("--val-fraction", *val_fraction, "Fraction of documents for validation (default 0.01)");
  prepare->callback([&context, inputs, out_dir, val_fraction]() {
    context.exit_code = DataPrepare(*inputs, *out_dir, *val_fraction);
  });

  // geotrain model init|grad|steps
  auto* model_cmd = app.add_subcommand("model", "GPT-2 model tools (weights, gradients for parity checks)");
  model_cmd->require_subcommand(1);
  struct Args {
    std::string config, weights, tokens, out;
    uint64_t seed = 0;
  };
  auto args = std::make_shared<Args>();
  auto* init = model_cmd->add_subcommand("init", "Write GPT-2-initialised weights for the spec's model");
  init->add_option("--config", args->config, "Job spec giving the model shape")->required();
  init->add_option("--out", args->out, "Output safetensors file")->required();
  init->add_option("--seed", args->seed, "Seed (default: train.seed)");
  init->callback([&context, args]() { context.exit_code = ModelInit(args->config, args->out, args->seed); });
  for (const char* verb : {"grad", "steps"}) {
    const bool grad = std::string(verb) == "grad";
    auto* cmd = model_cmd->add_subcommand(
        verb, grad ? "One forward and backward on the first B x (T+1) tokens: logits, loss, grad.<name>"
                   : "train.steps AdamW steps on consecutive batches: final parameters and losses");
    cmd->add_option("--config", args->config, "Job spec: model shape, train.global_batch (B), train.seq_len (T)")
        ->required();
    cmd->add_option("--weights", args->weights, "Weights (safetensors, HF GPT-2 names)")->required();
    cmd->add_option("--tokens", args->tokens, "Token shard (.bin)")->required();
    cmd->add_option("--out", args->out, "Output safetensors file")->required();
    cmd->callback([&context, args, grad]() {
      context.exit_code = grad ? ModelGrad(args->config, args->weights, args->tokens, args->out)
                               : ModelSteps(args->config, args->weights, args->tokens, args->out);
    });
  }
  AddTimedStepCommand(model_cmd, context);
}

bool registered = RegisterCommands("model", &AddModelCommands);

}  // namespace
}  // namespace geotrain::cli
