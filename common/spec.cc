// YAML/JSON spec loading through the message descriptor, defaults and validation.
#include "common/spec.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
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
      if (f->is_repeated()) {
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
    // Dense fp16/bf16 tensor-core TFLOP/s from the vendors' data sheets, and memory in GB.
    {"T4", 65.0, 16.0},    {"RTX6000", 130.5, 24.0}, {"A30", 165.0, 24.0},   {"A40", 149.7, 48.0},
    {"A10", 125.0, 24.0},  {"V100", 125.0, 32.0},    {"L4", 121.0, 24.0},    {"L40S", 362.0, 48.0},
    {"A100", 312.0, 80.0}, {"H100", 989.0, 80.0},    {"H200", 989.0, 141.0},
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
}

absl::Status ValidateJobSpec(const JobSpec& spec) {
  const TrainSpec& t = spec.train();
  auto bad = [](absl::string_view key, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", key, " ", what));
  };
  if (t.global_batch() <= 0) return bad("train.global_batch", "must be positive");
  if (t.seq_len() <= 0) return bad("train.seq_len", "must be positive");
  if (t.steps() <= 0) return bad("train.steps", "must be positive");
  if (t.lr() <= 0) return bad("train.lr", "must be positive");
  if (t.warmup_steps() < 0) return bad("train.warmup_steps", "must not be negative");
  if (t.weight_decay() < 0) return bad("train.weight_decay", "must not be negative");
  if (t.grad_clip() < 0) return bad("train.grad_clip", "must not be negative (0 disables clipping)");
  const ParallelSpec& p = spec.parallel();
  if (p.plan() != "auto" && p.plan() != "manual") {
    return bad("parallel.plan", absl::StrCat("must be auto or manual, got '", p.plan(), "'"));
  }
  if (p.dp() <= 0 || p.pp() <= 0 || p.tp() <= 0 || p.microbatches() <= 0) {
    return bad("parallel", "dp, pp, tp and microbatches must be positive");
  }
  if (p.schedule() != "1f1b" && p.schedule() != "gpipe") {
    return bad("parallel.schedule", absl::StrCat("must be 1f1b or gpipe, got '", p.schedule(), "'"));
  }
  if (p.plan() == "manual") {
    const int64_t per_step = static_cast<int64_t>(p.dp()) * p.microbatches();
    if (t.global_batch() % per_step != 0) {
      return bad("train.global_batch",
                 absl::StrCat("(", t.global_batch(), ") must be a multiple of dp x microbatches (", per_step, ")"));
    }
  }
  if (!(spec.comm().grad_bucket_mb() >= 0 && spec.comm().grad_bucket_mb() <= 1e6)) {
    return bad("comm.grad_bucket_mb", "must be in (0, 1e6] (0 or absent: 25)");
  }
  const CheckpointSpec& k = spec.checkpoint();
  if (k.every_steps() < 0) return bad("checkpoint.every_steps", "must not be negative");
  if (k.keep() < -1) return bad("checkpoint.keep", "must be -1 (keep all) or a count of checkpoints to keep");
  if (k.resume() != "" && k.resume() != "auto") {
    return bad("checkpoint.resume", absl::StrCat("must be auto (or absent), got '", k.resume(), "'"));
  }
  if (k.resume() == "auto" && k.dir().empty()) {
    return bad("checkpoint.resume", "auto needs checkpoint.dir: the directory to resume from");
  }
  const FaultToleranceSpec& f = spec.fault_tolerance();
  if (f.has_max_restarts() && f.max_restarts() < -1) {
    return bad("fault_tolerance.max_restarts", "must be -1 (unlimited), 0 (fail on the first fault) or a count");
  }
  if (!(f.wait_for_workers_s() >= 0 && f.wait_for_workers_s() <= 7 * 24 * 3600)) {
    return bad("fault_tolerance.wait_for_workers_s", "must be between 0 and 604800 (a week)");
  }
  return absl::OkStatus();
}

absl::Status ValidateTopology(Topology* topology) {
  if (topology->sites_size() == 0) {
    return absl::InvalidArgumentError("topology: no sites; list at least one under 'sites'");
  }
  std::set<std::string> names;
  for (TopologySite& site : *topology->mutable_sites()) {
    if (site.name().empty()) return absl::InvalidArgumentError("topology: a site has no name");
    if (!names.insert(site.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat("topology: site '", site.name(), "' appears twice"));
    }
    for (TopologyWorker& w : *site.mutable_workers()) {
      if (w.count() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("topology: site '", site.name(), "': worker count must not be negative"));
      }
      if (w.count() == 0) w.set_count(1);
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
    if (link.latency_ms() < 0 || link.bandwidth_mbps() < 0 || link.jitter_ms() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("topology: link ", link.a(), "-", link.b(),
                                                     ": latency, bandwidth and jitter must not be negative"));
    }
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

}  // namespace geotrain
