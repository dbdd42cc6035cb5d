// YAML/JSON spec loading through the message descriptor, defaults and validation.
#include "common/spec.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/codec_spec.h"
#include "common/diloco_spec.h"
#include "common/status.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace geotrain {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

std::string KnownKeys(const Descriptor* d) {
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
  return absl::StrJoin(names, ", ");
}

std::string PathOr(const std::string& path, const char* top) { return path.empty() ? top : path; }

// YAML (or JSON, a subset of it) to the JSON that protobuf's JSON mapping reads, checked against the
// message's descriptor on the way so that errors name the key: unknown keys, wrong kinds of values.
class YamlToJson {
 public:
  explicit YamlToJson(std::string source) : source_(std::move(source)) {}

  absl::Status Message(const YAML::Node& node, const Descriptor* d, const std::string& path, nlohmann::json* out) {
    *out = nlohmann::json::object();
    if (node.IsNull()) return absl::OkStatus();
    if (!node.IsMap()) {
      return Error(path, absl::StrCat("expected a mapping with keys (", KnownKeys(d), ")"));
    }
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      const std::string child = path.empty() ? key : absl::StrCat(path, ".", key);
      const FieldDescriptor* f = d->FindFieldByName(key);
      for (int i = 0; f == nullptr && i < d->field_count(); ++i) {
        if (d->field(i)->json_name() == key) f = d->field(i);
      }
      if (f == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(source_, ": unknown key '", child, "'; known keys of ",
                                                       PathOr(path, "the top level"), ": ", KnownKeys(d)));
      }
      nlohmann::json& value = (*out)[f->name()];  // a key given twice: the last one wins
      if (f->is_repeated() && kv.second.IsScalar() && f->type() == FieldDescriptor::TYPE_STRING) {
        value = nlohmann::json::array({kv.second.as<std::string>()});  // `sites: all`: a list of one
      } else if (f->is_repeated()) {
        if (!kv.second.IsSequence()) return Error(child, "expected a list");
        value = nlohmann::json::array();
        for (size_t i = 0; i < kv.second.size(); ++i) {
          RETURN_IF_ERROR(Value(kv.second[i], f, absl::StrCat(child, "[", i, "]"), &value.emplace_back()));
        }
      } else {
        RETURN_IF_ERROR(Value(kv.second, f, child, &value));
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(const std::string& path, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": key '", path, "': ", what));
  }

  absl::Status Value(const YAML::Node& node, const FieldDescriptor* f, const std::string& path, nlohmann::json* out) {
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      return Message(node, f->message_type(), path, out);
    }
    if (!node.IsScalar()) return Error(path, absl::StrCat("expected a ", f->type_name(), " value"));
    const std::string text = node.Scalar();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_STRING:
        *out = text;
        return absl::OkStatus();
      case FieldDescriptor::CPPTYPE_BOOL: {
        const std::string lower = absl::AsciiStrToLower(text);
        if (lower == "true" || lower == "yes" || lower == "on") {
          *out = true;
        } else if (lower == "false" || lower == "no" || lower == "off") {
          *out = false;
        } else {
          return Error(path, absl::StrCat("expected true or false, got '", text, "'"));
        }
        return absl::OkStatus();
      }
      case FieldDescriptor::CPPTYPE_ENUM:
        if (f->enum_type()->FindValueByName(text) == nullptr) {
          return Error(path, absl::StrCat("unknown value '", text, "'"));
        }
        *out = text;
        return absl::OkStatus();
      case FieldDescriptor::CPPTYPE_FLOAT:
      case FieldDescriptor::CPPTYPE_DOUBLE: {
        double v;
        if (!absl::SimpleAtod(text, &v) || !std::isfinite(v)) {
          return Error(path, absl::StrCat("expected a number, got '", text, "'"));
        }
        *out = v;
        return absl::OkStatus();
      }
      default: {  // integers
        int64_t v;
        if (!absl::SimpleAtoi(text, &v)) {
          return Error(path, absl::StrCat("expected an integer, got '", text, "'"));
        }
        if (f->cpp_type() == FieldDescriptor::CPPTYPE_INT32 && (v > INT32_MAX || v < INT32_MIN)) {
          return Error(path, absl::StrCat("value ", text, " does not fit in 32 bits"));
        }
        if ((f->cpp_type() == FieldDescriptor::CPPTYPE_UINT32 || f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64) &&
            v < 0) {
          return Error(path, absl::StrCat("expected a non-negative integer, got ", text));
        }
        *out = text;  // the JSON mapping takes 64-bit integers as strings
        return absl::OkStatus();
      }
    }
  }

  std::string source_;
};

absl::Status ReadFile(const std::string& path, std::string* text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read '", path, "': ", std::strerror(errno), "; check the path"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  *text = ss.str();
  return absl::OkStatus();
}

constexpr KnownDevice kKnownDevices[] = {
    // Dense fp16/bf16 tensor-core TFLOP/s, memory in GB and memory bandwidth in GB/s, compute capability, and the
    // dense fp32 / fp16 / bf16 peaks, from the vendors' data sheets (NVIDIA T4, Quadro RTX 6000, A30, A40, A10,
    // V100 SXM2, L4, L40S, A100 80GB SXM, H100 SXM, H200 SXM).
    // name       tflops  mem_gb  GB/s    cc  fp32   fp16   bf16
    {"T4", 65.0, 16.0, 320.0, 75, 8.1, 65.0, 0},
    {"RTX6000", 130.5, 24.0, 672.0, 75, 16.3, 130.5, 0},
    {"A30", 165.0, 24.0, 933.0, 80, 10.3, 165.0, 165.0},
    {"A40", 149.7, 48.0, 696.0, 86, 37.4, 149.7, 149.7},
    {"A10", 125.0, 24.0, 600.0, 86, 31.2, 125.0, 125.0},
    {"V100", 125.0, 32.0, 900.0, 70, 15.7, 125.0, 0},
    {"L4", 121.0, 24.0, 300.0, 89, 30.3, 121.0, 121.0},
    {"L40S", 362.0, 48.0, 864.0, 89, 91.6, 362.0, 362.0},
    {"A100", 312.0, 80.0, 2039.0, 80, 19.5, 312.0, 312.0},
    {"H100", 989.0, 80.0, 3350.0, 90, 67.0, 989.0, 989.0},
    {"H200", 989.0, 141.0, 4800.0, 90, 67.0, 989.0, 989.0},
};

std::string NormalizeDeviceName(std::string_view name) {
  std::string out;
  for (char c : name) {
    if (c == ' ' || c == '-' || c == '_') continue;
    out += absl::ascii_toupper(c);
  }
  return out;
}

}  // namespace

const KnownDevice* FindKnownDevice(std::string_view name) {
  const std::string n = NormalizeDeviceName(name);
  for (const KnownDevice& d : kKnownDevices) {
    if (n == d.name) return &d;
  }
  return nullptr;
}

absl::Status ParseYamlOrJson(std::string_view text, std::string_view source, google::protobuf::Message* message) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(source.data(), source.size()),
                                                   ": not valid YAML or JSON at line ", e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
  nlohmann::json json;
  YamlToJson converter{std::string(source)};
  try {
    RETURN_IF_ERROR(converter.Message(root, message->GetDescriptor(), "", &json));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(source.data(), source.size()), ": ", e.what()));
  }
  std::string text_json;
  try {
    text_json = json.dump();
  } catch (const nlohmann::json::type_error& e) {  // protobuf strings must be UTF-8
    return absl::InvalidArgumentError(
        absl::StrCat(absl::string_view(source.data(), source.size()), ": a value is not UTF-8 text: ", e.what()));
  }
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(text_json, message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(absl::string_view(source.data(), source.size()), ": ", std::string(status.message())));
  }
  return absl::OkStatus();
}

absl::Status LoadMessageFile(const std::string& path, google::protobuf::Message* message) {
  std::string text;
  RETURN_IF_ERROR(ReadFile(path, &text));
  return ParseYamlOrJson(text, path, message);
}

void ApplyJobDefaults(JobSpec* spec) {
  if (spec->name().empty()) spec->set_name("job");
  if (spec->model().preset().empty() && spec->model().n_layer() == 0) {
    spec->mutable_model()->set_preset("gpt2-small-test");
  }
  TrainSpec* t = spec->mutable_train();
  if (t->global_batch() == 0) t->set_global_batch(8);
  if (t->seq_len() == 0) t->set_seq_len(64);
  if (t->steps() == 0) t->set_steps(100);
  if (t->lr() == 0) t->set_lr(6e-4);
  if (t->min_lr() == 0) t->set_min_lr(t->lr() / 10);
  if (t->beta1() == 0) t->set_beta1(0.9);
  if (t->beta2() == 0) t->set_beta2(0.95);
  if (t->seed() == 0) t->set_seed(1);
  if (t->eval_batches() == 0) t->set_eval_batches(4);
  ParallelSpec* p = spec->mutable_parallel();
  if (p->plan().empty()) p->set_plan("auto");
  if (p->dp() == 0) p->set_dp(1);
  if (p->pp() == 0) p->set_pp(1);
  if (p->tp() == 0) p->set_tp(1);
  if (p->microbatches() == 0) p->set_microbatches(p->pp() > 1 ? 2 * p->pp() : 1);
  if (p->schedule().empty()) p->set_schedule("1f1b");
  CommSpec* c = spec->mutable_comm();
  if (c->wan_codec().empty()) c->set_wan_codec("bf16");
  if (c->lan_codec().empty()) c->set_lan_codec("none");
  if (c->chunk_bytes() == 0) c->set_chunk_bytes(1 << 20);
  if (c->grad_bucket_mb() == 0) c->set_grad_bucket_mb(25);
  CheckpointSpec* k = spec->mutable_checkpoint();
  if (k->keep() == 0) k->set_keep(3);
  FaultToleranceSpec* f = spec->mutable_fault_tolerance();
  if (!f->has_max_restarts()) f->set_max_restarts(3);
  if (f->wait_for_workers_s() == 0) f->set_wait_for_workers_s(300);
  if (!f->has_regroup()) f->set_regroup(true);
  if (!f->has_heal()) f->set_heal(true);
  if (spec->diloco().inner_steps() > 0) *spec->mutable_diloco() = EffectiveDiloco(*spec);
}

namespace {

// An error naming the key, its allowed range and the value given, when `value` is outside [lo, hi] (NaN too).
template <typename T>
absl::Status CheckRange(absl::string_view what, absl::string_view key, T value, T lo, T hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", key, " must be in [", lo, ", ", hi, "] (got ", value, ")"));
}

// ValidateJobSpec's errors: a key with what is wrong with it, and a key's value outside [lo, hi] (in the value's
// type).
absl::Status BadKey(absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", key, " ", what));
}
template <typename T>
absl::Status CheckJobRange(absl::string_view key, T value, std::type_identity_t<T> lo, std::type_identity_t<T> hi) {
  return CheckRange("job spec", key, value, lo, hi);
}

// The job's name, the model's dimensions and train's schedule, optimizer and precision.
absl::Status ValidateModelAndTrain(const JobSpec& spec) {
  const SpecLimits& l = kSpecLimits;
  const TrainSpec& t = spec.train();
  RETURN_IF_ERROR(
      CheckJobRange("name (bytes)", static_cast<int64_t>(spec.name().size()), int64_t{0}, l.max_name_bytes));
  const ModelSpec& m = spec.model();
  RETURN_IF_ERROR(CheckJobRange("model.n_layer", m.n_layer(), 0, l.max_layers));
  RETURN_IF_ERROR(CheckJobRange("model.n_head", m.n_head(), 0, l.max_heads));
  RETURN_IF_ERROR(CheckJobRange("model.n_embd", m.n_embd(), 0, l.max_embd));
  RETURN_IF_ERROR(CheckJobRange("model.block_size", m.block_size(), 0, l.max_seq_len));
  RETURN_IF_ERROR(CheckJobRange("model.vocab_size", m.vocab_size(), 0, l.max_vocab));
  RETURN_IF_ERROR(CheckJobRange("train.global_batch", t.global_batch(), 1, l.max_global_batch));
  RETURN_IF_ERROR(CheckJobRange("train.seq_len", t.seq_len(), 1, l.max_seq_len));
  RETURN_IF_ERROR(CheckJobRange("train.steps", t.steps(), 1, l.max_steps));
  if (t.lr() <= 0) return BadKey("train.lr", "must be positive");
  RETURN_IF_ERROR(CheckJobRange("train.lr", t.lr(), 0.0, l.max_lr));
  RETURN_IF_ERROR(CheckJobRange("train.min_lr", t.min_lr(), 0.0, l.max_lr));
  if (t.warmup_steps() < 0) return BadKey("train.warmup_steps", "must not be negative");
  RETURN_IF_ERROR(CheckJobRange("train.warmup_steps", t.warmup_steps(), 0, l.max_steps));
  if (t.weight_decay() < 0) return BadKey("train.weight_decay", "must not be negative");
  RETURN_IF_ERROR(CheckJobRange("train.weight_decay", t.weight_decay(), 0.0, 1e3));
  if (t.grad_clip() < 0) return BadKey("train.grad_clip", "must not be negative (0 disables clipping)");
  RETURN_IF_ERROR(CheckJobRange("train.grad_clip", t.grad_clip(), 0.0, 1e12));
  RETURN_IF_ERROR(CheckJobRange("train.beta1", t.beta1(), 0.0, 1.0));
  RETURN_IF_ERROR(CheckJobRange("train.beta2", t.beta2(), 0.0, 1.0));
  RETURN_IF_ERROR(CheckJobRange("train.eval_every", t.eval_every(), 0, l.max_steps));
  RETURN_IF_ERROR(CheckJobRange("train.eval_batches", t.eval_batches(), 0, l.max_eval_batches));
  if (!t.precision().empty() && t.precision() != "auto" && t.precision() != "bf16" && t.precision() != "fp16" &&
      t.precision() != "fp32") {
    return BadKey("train.precision", absl::StrCat("must be auto, bf16, fp16 or fp32, got '", t.precision(), "'"));
  }
  if (t.has_loss_scale()) {
    if (t.precision() == "bf16" || t.precision() == "fp32") {
      return BadKey("train.loss_scale", absl::StrCat("applies to fp16 only (train.precision is ", t.precision(),
                                                     "); remove it or set train.precision: fp16 or auto"));
    }
    if (t.loss_scale().initial() != 0) {
      RETURN_IF_ERROR(
          CheckJobRange("train.loss_scale.initial", t.loss_scale().initial(), 1.0 / 16777216, 18446744073709551616.0));
    }
    RETURN_IF_ERROR(CheckJobRange("train.loss_scale.growth_interval", t.loss_scale().growth_interval(), 0, 1000000));
  }
  return absl::OkStatus();
}

// The plan and its shape: dp, pp, tp, microbatches, sites, placement and the pipeline schedule.
absl::Status ValidateParallel(const JobSpec& spec) {
  const SpecLimits& l = kSpecLimits;
  const ParallelSpec& p = spec.parallel();
  if (p.plan() != "auto" && p.plan() != "manual") {
    return BadKey("parallel.plan", absl::StrCat("must be auto or manual, got '", p.plan(), "'"));
  }
  if (p.dp() <= 0 || p.pp() <= 0 || p.tp() <= 0 || p.microbatches() <= 0) {
    return BadKey("parallel", "dp, pp, tp and microbatches must be positive");
  }
  if (p.sites_size() > 0 && p.plan() != "auto") {
    return BadKey("parallel.sites", "applies to plan: auto (a manual plan places its actors with parallel.placement)");
  }
  RETURN_IF_ERROR(CheckJobRange("parallel.sites (count)", p.sites_size(), 0, 256));
  for (const std::string& site : p.sites()) {
    if (site.empty() || site.size() > 256) return BadKey("parallel.sites", "holds an empty or over-long site name");
  }
  RETURN_IF_ERROR(CheckJobRange("parallel.dp", p.dp(), 1, l.max_parallel));
  RETURN_IF_ERROR(CheckJobRange("parallel.pp", p.pp(), 1, l.max_parallel));
  RETURN_IF_ERROR(CheckJobRange("parallel.tp", p.tp(), 1, l.max_parallel));
  RETURN_IF_ERROR(CheckJobRange("parallel.microbatches", p.microbatches(), 1, l.max_microbatches));
  RETURN_IF_ERROR(CheckJobRange("parallel.dp x pp x tp", int64_t{p.dp()} * p.pp() * p.tp(), int64_t{1}, l.max_actors));
  RETURN_IF_ERROR(CheckJobRange("parallel.placement (entries)", int64_t{p.placement_size()}, int64_t{0}, l.max_actors));
  if (p.schedule() != "1f1b" && p.schedule() != "gpipe") {
    return BadKey("parallel.schedule", absl::StrCat("must be 1f1b or gpipe, got '", p.schedule(), "'"));
  }
  if (p.plan() == "manual") {
    const int64_t per_step = static_cast<int64_t>(p.dp()) * p.microbatches();
    if (spec.train().global_batch() % per_step != 0) {
      return BadKey("train.global_batch", absl::StrCat("(", spec.train().global_batch(),
                                                       ") must be a multiple of dp x microbatches (", per_step, ")"));
    }
  }
  return absl::OkStatus();
}

// How tensors travel: the gradient buckets, the stream chunks and the pipeline's depth of sends in flight.
absl::Status ValidateComm(const JobSpec& spec) {
  const SpecLimits& l = kSpecLimits;
  if (!(spec.comm().grad_bucket_mb() >= 0 && spec.comm().grad_bucket_mb() <= 1e6)) {
    return BadKey("comm.grad_bucket_mb", "must be in (0, 1e6] (0 or absent: 25)");
  }
  if (spec.comm().chunk_bytes() != 0) {
    RETURN_IF_ERROR(CheckJobRange("comm.chunk_bytes", spec.comm().chunk_bytes(), int64_t{1024}, l.max_chunk_bytes));
  }
  const ParallelSpec& p = spec.parallel();
  if (p.pipeline_depth() < 0)
    return BadKey("parallel.pipeline_depth", "must not be negative (0 or absent: chosen from the links)");
  RETURN_IF_ERROR(CheckJobRange("parallel.pipeline_depth", p.pipeline_depth(), 0, l.max_microbatches));
  return absl::OkStatus();
}

// Synchronous or DiLoCo: parallel.sync, parallel.allow_diloco and the diloco block (with its defaults filled).
absl::Status ValidateDiloco(const JobSpec& spec) {
  const SpecLimits& l = kSpecLimits;
  const ParallelSpec& p = spec.parallel();
  if (p.sync() != "" && p.sync() != "sync" && p.sync() != "diloco") {
    return BadKey("parallel.sync", absl::StrCat("must be sync or diloco (or absent), got '", p.sync(), "'"));
  }
  if (p.allow_diloco() && p.plan() != "auto") {
    return BadKey("parallel.allow_diloco",
                  "applies to plan: auto only; with a manual plan, a diloco block turns it on");
  }
  const DilocoSpec& d = spec.diloco();
  if (d.inner_steps() < 0) return BadKey("diloco.inner_steps", "must be positive");
  RETURN_IF_ERROR(CheckJobRange("diloco.inner_steps", d.inner_steps(), 0, l.max_steps));
  RETURN_IF_ERROR(CheckJobRange("diloco.fragments", d.fragments(), 0, l.max_microbatches));
  if (!DilocoOn(spec) && !p.allow_diloco()) return absl::OkStatus();
  const DilocoSpec e = EffectiveDiloco(spec);
  if (!(e.outer_lr() > 0 && e.outer_lr() <= 10)) return BadKey("diloco.outer_lr", "must be in (0, 10]");
  if (!(e.outer_momentum() >= 0 && e.outer_momentum() < 1)) {
    return BadKey("diloco.outer_momentum", "must be in [0, 1) (0: no momentum)");
  }
  if (e.has_inner_lr_scale() && !(e.inner_lr_scale() > 0 && e.inner_lr_scale() <= 10)) {
    return BadKey("diloco.inner_lr_scale",
                  "must be in (0, 10] (1: train's schedule as it is; absent: sqrt of the number of sites)");
  }
  if (e.sync() != "steps" && e.sync() != "time") {
    return BadKey("diloco.sync", absl::StrCat("must be steps or time (or absent: steps), got '", e.sync(), "'"));
  }
  if (e.sync() == "time" && e.fragments() > 1) {
    return BadKey("diloco.sync", absl::StrCat("time paces whole-model outer steps; it needs diloco.fragments 1 (got ",
                                              e.fragments(), ")"));
  }
  if (e.fragments() > e.inner_steps()) {
    return BadKey("diloco.fragments",
                  absl::StrCat("(", e.fragments(), ") must not exceed inner_steps (", e.inner_steps(),
                               "): each fragment syncs once every inner_steps steps"));
  }
  if (d.has_sparse() && d.sparse().has_fraction() && !(d.sparse().fraction() > 0 && d.sparse().fraction() <= 1)) {
    return BadKey("diloco.sparse.fraction",
                  absl::StrCat("must be in (0, 1], the share of each block kept (got ", d.sparse().fraction(), ")"));
  }
  if (d.has_sparse() && d.sparse().has_bits()) {
    RETURN_IF_ERROR(CheckJobRange("diloco.sparse.bits", d.sparse().bits(), 2, 8));
  }
  absl::StatusOr<CodecSpec> codec = ParseCodecSpec(e.codec());
  if (!codec.ok()) return BadKey("diloco.codec", codec.status().message());
  if (d.has_sparse() && codec->kind != CodecKind::kSparse) {
    return BadKey("diloco.sparse",
                  absl::StrCat("applies to diloco.codec sparse only (the codec is '", e.codec(), "')"));
  }
  if (codec->kind == CodecKind::kSparse &&
      (e.sparse().fraction() != codec->sparse_fraction || e.sparse().bits() != codec->sparse_bits)) {
    return BadKey("diloco.sparse", absl::StrCat("(fraction ", e.sparse().fraction(), ", bits ", e.sparse().bits(),
                                                ") disagrees with diloco.codec '", d.codec(),
                                                "': give the fraction and bits in one place"));
  }
  return absl::OkStatus();
}

// Checkpoints and resumes, the data's paths, and how the job meets faults.
absl::Status ValidateCheckpointDataAndFaults(const JobSpec& spec) {
  const SpecLimits& l = kSpecLimits;
  const CheckpointSpec& k = spec.checkpoint();
  if (k.every_steps() < 0) return BadKey("checkpoint.every_steps", "must not be negative");
  RETURN_IF_ERROR(CheckJobRange("checkpoint.every_steps", k.every_steps(), 0, l.max_steps));
  if (k.keep() < -1) return BadKey("checkpoint.keep", "must be -1 (keep all) or a count of checkpoints to keep");
  RETURN_IF_ERROR(CheckJobRange("checkpoint.keep", k.keep(), -1, l.max_checkpoints_kept));
  if (k.resume() != "" && k.resume() != "auto") {
    return BadKey("checkpoint.resume", absl::StrCat("must be auto (or absent), got '", k.resume(), "'"));
  }
  if (k.resume() == "auto" && k.dir().empty()) {
    return BadKey("checkpoint.resume", "auto needs checkpoint.dir: the directory to resume from");
  }
  RETURN_IF_ERROR(
      CheckJobRange("checkpoint.dir (bytes)", static_cast<int64_t>(k.dir().size()), int64_t{0}, l.max_path_bytes));
  RETURN_IF_ERROR(CheckJobRange("checkpoint.resume_from (bytes)", static_cast<int64_t>(k.resume_from().size()),
                                int64_t{0}, l.max_path_bytes));
  RETURN_IF_ERROR(CheckJobRange("data.train (bytes)", static_cast<int64_t>(spec.data().train().size()), int64_t{0},
                                l.max_path_bytes));
  RETURN_IF_ERROR(
      CheckJobRange("data.val (bytes)", static_cast<int64_t>(spec.data().val().size()), int64_t{0}, l.max_path_bytes));
  const FaultToleranceSpec& f = spec.fault_tolerance();
  if (f.has_max_restarts() && f.max_restarts() < -1) {
    return BadKey("fault_tolerance.max_restarts", "must be -1 (unlimited), 0 (fail on the first fault) or a count");
  }
  RETURN_IF_ERROR(CheckJobRange("fault_tolerance.max_restarts", f.max_restarts(), -1, l.max_restarts));
  if (!(f.wait_for_workers_s() >= 0 && f.wait_for_workers_s() <= 7 * 24 * 3600)) {
    return BadKey("fault_tolerance.wait_for_workers_s", "must be between 0 and 604800 (a week)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  RETURN_IF_ERROR(ValidateModelAndTrain(spec));
  RETURN_IF_ERROR(ValidateParallel(spec));
  RETURN_IF_ERROR(ValidateComm(spec));
  RETURN_IF_ERROR(ValidateDiloco(spec));
  return ValidateCheckpointDataAndFaults(spec);
}

absl::Status ValidateLinkFigures(std::string_view what, double latency_ms, double bandwidth_mbps, double jitter_ms) {
  const SpecLimits& l = kSpecLimits;
  const absl::string_view link(what.data(), what.size());
  // CheckRange's comparisons are false for NaN, so NaN is refused too.
  RETURN_IF_ERROR(CheckRange(link, "latency_ms", latency_ms, 0.0, l.max_link_latency_ms));
  RETURN_IF_ERROR(CheckRange(link, "bandwidth_mbps", bandwidth_mbps, 0.0, l.max_link_bandwidth_mbps));
  return CheckRange(link, "jitter_ms", jitter_ms, 0.0, l.max_link_latency_ms);
}

absl::Status ValidateTopology(Topology* topology) {
  if (topology->sites_size() == 0) {
    return absl::InvalidArgumentError("topology: no sites; list at least one under 'sites'");
  }
  const SpecLimits& l = kSpecLimits;
  RETURN_IF_ERROR(CheckRange("topology", "sites (entries)", topology->sites_size(), 1, l.max_sites));
  RETURN_IF_ERROR(CheckRange("topology", "links (entries)", topology->links_size(), 0, l.max_sites * l.max_sites));
  std::set<std::string> names;
  for (TopologySite& site : *topology->mutable_sites()) {
    if (site.name().empty()) return absl::InvalidArgumentError("topology: a site has no name");
    RETURN_IF_ERROR(CheckRange("topology", "site name (bytes)", static_cast<int64_t>(site.name().size()), int64_t{1},
                               l.max_name_bytes));
    RETURN_IF_ERROR(CheckRange("topology", absl::StrCat("site '", site.name(), "': workers (entries)"),
                               site.workers_size(), 0, l.max_workers_per_site));
    if (!names.insert(site.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("topology: site '", site.name(), "' appears twice"));
    }
    for (TopologyWorker& w : *site.mutable_workers()) {
      if (w.count() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("topology: site '", site.name(), "': worker count must not be negative"));
      }
      if (w.count() == 0) w.set_count(1);
      RETURN_IF_ERROR(CheckRange("topology", absl::StrCat("site '", site.name(), "': worker count"), w.count(), 1,
                                 l.max_devices_per_worker));
      RETURN_IF_ERROR(CheckRange("topology", absl::StrCat("site '", site.name(), "': tflops"), w.tflops(), -1e9, 1e6));
      RETURN_IF_ERROR(CheckRange("topology", absl::StrCat("site '", site.name(), "': mem_gb"), w.mem_gb(), -1e9, 1e6));
      const KnownDevice* known = FindKnownDevice(w.device());
      if (w.tflops() <= 0 || w.mem_gb() <= 0) {
        if (known == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("topology: site '", site.name(), "': unknown device '", w.device(),
                           "'; give tflops and mem_gb for it, or use a known device (T4, RTX6000, A30, A40, A100, "
                           "H100, ...)"));
        }
        if (w.tflops() <= 0) w.set_tflops(known->tflops);
        if (w.mem_gb() <= 0) w.set_mem_gb(known->mem_gb);
      }
      RETURN_IF_ERROR(CheckRange("topology", absl::StrCat("site '", site.name(), "': compute_capability"),
                                 w.compute_capability(), 0, 1000));
      RETURN_IF_ERROR(
          CheckRange("topology", absl::StrCat("site '", site.name(), "': fp32_tflops"), w.fp32_tflops(), 0.0, 1e6));
      if (known != nullptr && w.compute_capability() == 0) w.set_compute_capability(known->compute_capability);
      if (known != nullptr && w.fp32_tflops() == 0) w.set_fp32_tflops(known->fp32_tflops);
    }
  }
  std::set<std::pair<std::string, std::string>> seen;
  for (const TopologyLink& link : topology->links()) {
    for (const std::string& end : {link.a(), link.b()}) {
      if (!names.count(end)) {
        return absl::InvalidArgumentError(
            absl::StrCat("topology: link ", link.a(), "-", link.b(), " names unknown site '", end, "'"));
      }
    }
    if (link.a() == link.b()) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology: link ", link.a(), "-", link.b(), " joins a site to itself"));
    }
    RETURN_IF_ERROR(ValidateLinkFigures(absl::StrCat("topology: link ", link.a(), "-", link.b()), link.latency_ms(),
                                        link.bandwidth_mbps(), link.jitter_ms()));
    auto key = std::minmax(link.a(), link.b());
    if (!seen.insert({key.first, key.second}).second) {
      return absl::InvalidArgumentError(absl::StrCat("topology: link ", link.a(), "-", link.b(), " appears twice"));
    }
  }
  return absl::OkStatus();
}

void MakeSpecPathsAbsolute(JobSpec* spec, const std::string& base_dir) {
  auto absolute = [&](std::string* path) {
    if (!path->empty() && (*path)[0] != '/') *path = (std::filesystem::path(base_dir) / *path).lexically_normal();
  };
  absolute(spec->mutable_data()->mutable_train());
  absolute(spec->mutable_data()->mutable_val());
  absolute(spec->mutable_checkpoint()->mutable_dir());
  absolute(spec->mutable_checkpoint()->mutable_resume_from());
}

absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path) {
  JobSpec spec;
  RETURN_IF_ERROR(LoadMessageFile(path, &spec));
  ApplyJobDefaults(&spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  return spec;
}

absl::StatusOr<Topology> LoadTopologyFile(const std::string& path) {
  Topology topology;
  RETURN_IF_ERROR(LoadMessageFile(path, &topology));
  if (absl::Status s = ValidateTopology(&topology); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  return topology;
}

std::string ToJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = pretty;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

bool RegroupAllowedBySpec(const JobSpec& spec, std::string* why) {
  if (spec.parallel().dp() <= 1) {
    *why = "the job has one data-parallel replica";
    return false;
  }
  if (const FaultToleranceSpec& ft = spec.fault_tolerance(); ft.has_regroup() && !ft.regroup()) {
    *why = "fault_tolerance.regroup is false";
    return false;
  }
  if (DilocoOn(spec)) {
    *why = "DiLoCo groups are not regrouped live";
    return false;
  }
  if (spec.parallel().tp() > 1) {
    *why = "tensor-parallel stages are not regrouped live";
    return false;
  }
  return true;
}

}  // namespace geotrain
