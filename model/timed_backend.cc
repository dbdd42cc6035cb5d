// Timed compute: ops that wait instead of computing, on memory that costs nothing (see timed_backend.h).
#include "model/timed_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

absl::StatusOr<std::unique_ptr<TimedBackend>> TimedBackend::Create(Options options) {
  const Roofline& r = options.roofline;
  if (!(r.flops_per_s > 0) || !(r.bytes_per_s > 0) || !(r.launch_s >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "timed compute: achieved FLOP/s (%g) and bytes/s (%g) must be positive and the launch overhead (%g s) not "
        "negative; check the device profile",
        r.flops_per_s, r.bytes_per_s, r.launch_s));
  }
  options.window_bytes = RoundUp(std::max<size_t>(options.window_bytes, PageSize()), PageSize());
  const int fd = memfd_create("geotrain-timed-window", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(options.window_bytes)) != 0) {
    const std::string error = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::InternalError(absl::StrCat("timed compute: cannot make its memory window: ", error));
  }
  return std::unique_ptr<TimedBackend>(new TimedBackend(std::move(options), fd));
}

TimedBackend::TimedBackend(Options options, int window_fd)
    : options_(std::move(options)), window_fd_(window_fd), busy_until_(Clock::now()) {}

TimedBackend::~TimedBackend() {
  absl::MutexLock lock(&mu_);
  for (const auto& [ptr, bytes] : mappings_) munmap(ptr, bytes);
  close(window_fd_);
}

std::string TimedBackend::name() const {
  const Roofline& r = options_.roofline;
  return absl::StrFormat("timed %s (EMULATED compute: %.1f TFLOP/s, %.0f GB/s achieved, %.0f us per op)",
                         options_.device_name, r.flops_per_s / 1e12, r.bytes_per_s / 1e9, r.launch_s * 1e6);
}

absl::StatusOr<void*> TimedBackend::Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t size = RoundUp(bytes, PageSize());
  // Reserve the address range, then map the window over it again and again.
  void* base = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("timed compute: cannot reserve ", size, " bytes of address space: ", std::strerror(errno)));
  }
  char* const begin = static_cast<char*>(base);
  for (size_t offset = 0; offset < size; offset += options_.window_bytes) {
    const size_t len = std::min(options_.window_bytes, size - offset);
    if (mmap(begin + offset, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, window_fd_, 0) == MAP_FAILED) {
      const std::string error = std::strerror(errno);
      munmap(base, size);
      return absl::ResourceExhaustedError(absl::StrCat("timed compute: cannot map its window (", error,
                                                       "); raise vm.max_map_count or the window size"));
    }
  }
  absl::MutexLock lock(&mu_);
  mappings_[base] = size;
  return base;
}

void TimedBackend::Free(void* ptr) {
  if (ptr == nullptr) return;
  absl::MutexLock lock(&mu_);
  auto it = mappings_.find(ptr);
  if (it == mappings_.end()) return;
  munmap(it->first, it->second);
  mappings_.erase(it);
}

void TimedBackend::Charge(const OpCost& cost) {
  const double seconds = options_.roofline.Seconds(cost);
  busy_seconds_ += seconds;
  total_ += cost;
  if (!options_.sleep) return;
  busy_until_ = std::max(busy_until_, Clock::now()) +
                std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void TimedBackend::Wait() {
  if (options_.sleep) std::this_thread::sleep_until(busy_until_);
}

absl::Status TimedBackend::CopyToDevice(void*, const void*, size_t bytes) {
  Charge(CopyCost(static_cast<int64_t>(bytes)));
  return absl::OkStatus();
}

absl::Status TimedBackend::CopyToHost(void* host_dst, const void*, size_t bytes) {
  Charge(CopyCost(static_cast<int64_t>(bytes)));
  Wait();
  if (bytes > 0) std::memset(host_dst, 0, bytes);  // what the device holds
  return absl::OkStatus();
}

void TimedBackend::CopyOnDevice(void*, const void*, size_t bytes) { Charge(CopyCost(static_cast<int64_t>(bytes))); }

void TimedBackend::Zero(void*, size_t bytes) { Charge({0, static_cast<double>(bytes)}); }

absl::Status TimedBackend::Synchronize() {
  Wait();
  return absl::OkStatus();
}

void TimedBackend::encoder_forward(float*, const int32_t*, const float*, const float*, int B, int T, int C) {
  Charge(EncoderForwardCost(B, T, C));
}
void TimedBackend::encoder_backward(float*, float*, const float*, const int32_t*, int B, int T, int C) {
  Charge(EncoderBackwardCost(B, T, C));
}
void TimedBackend::layernorm_forward(float*, float*, float*, const float*, const float*, const float*, int64_t N,
                                     int C) {
  Charge(LayernormForwardCost(N, C));
}
void TimedBackend::layernorm_backward(float*, float*, float*, const float*, const float*, const float*, const float*,
                                      const float*, int64_t N, int C) {
  Charge(LayernormBackwardCost(N, C));
}
void TimedBackend::matmul_forward(float*, const float*, const float*, const float*, int64_t N, int C, int OC) {
  Charge(MatmulForwardCost(N, C, OC));
}
void TimedBackend::matmul_backward(float*, float*, float*, const float*, const float*, const float*, int64_t N, int C,
                                   int OC, bool) {
  Charge(MatmulBackwardCost(N, C, OC));
}
void TimedBackend::add_bias(float*, const float*, int64_t N, int OC) { Charge(BiasCost(N, OC)); }
void TimedBackend::bias_backward(float*, const float*, int64_t N, int OC) { Charge(BiasCost(N, OC)); }
void TimedBackend::attention_forward(float*, float*, const float*, int B, int T, int C, int NH) {
  Charge(AttentionForwardCost(B, T, C, NH));
}
void TimedBackend::attention_backward(float*, const float*, const float*, const float*, const float*, int B, int T,
                                      int C, int NH) {
  Charge(AttentionBackwardCost(B, T, C, NH));
}
void TimedBackend::gelu_forward(float*, const float*, int64_t N) { Charge(ElementwiseCost(N, 1, 1, 8)); }
void TimedBackend::gelu_backward(float*, const float*, const float*, int64_t N) {
  Charge(ElementwiseCost(N, 2, 1, 16));
}
void TimedBackend::residual_forward(float*, const float*, const float*, int64_t N) {
  Charge(ElementwiseCost(N, 2, 1, 1));
}
void TimedBackend::crossentropy_forward(float*, float*, const float*, const int32_t*, int64_t N, int, int Vp) {
  Charge(CrossentropyCost(N, Vp));
}
void TimedBackend::crossentropy_backward_inplace(float*, const float*, const int32_t*, float, int64_t N, int, int Vp) {
  Charge(CrossentropyCost(N, Vp));
}
void TimedBackend::accumulate(float*, const float*, int64_t n) { Charge(ElementwiseCost(n, 2, 1, 1)); }
void TimedBackend::scale(float*, int64_t n, float) { Charge(ElementwiseCost(n, 1, 1, 1)); }

absl::StatusOr<double> TimedBackend::Sum(const float*, int64_t n) {
  Charge(ElementwiseCost(n, 1, 0, 1));
  Wait();
  return 0.0;
}

absl::StatusOr<double> TimedBackend::SumSquares(const float*, int64_t n) {
  Charge(ElementwiseCost(n, 1, 0, 2));
  Wait();
  return 0.0;
}

void TimedBackend::adamw_update(float*, const float*, float*, float*, int64_t n, float, float, float, float, float,
                                float, float) {
  Charge(AdamWCost(n));
}

absl::StatusOr<std::unique_ptr<TimedBackend>> MakeTimedBackend(std::string_view device_view, Precision precision) {
  const std::string device(device_view);
  const auto bad = [&device] {
    return absl::InvalidArgumentError(absl::StrCat(
        "device '", device,
        "' is not timed:NAME@TFLOPS:GBPS:LAUNCH_US[:FP32_TFLOPS] (achieved TFLOP/s, GB/s, us per op, fp32 TFLOP/s)"));
  };
  if (!device.starts_with("timed:")) return bad();
  const std::string rest = device.substr(6);
  const size_t at = rest.rfind('@');
  if (at == std::string::npos || at == 0) return bad();
  std::vector<std::string> figures = absl::StrSplit(rest.substr(at + 1), ':');
  double tflops = 0, gbps = 0, launch_us = 0, fp32_tflops = 0;
  if ((figures.size() != 3 && figures.size() != 4) || !absl::SimpleAtod(figures[0], &tflops) ||
      !absl::SimpleAtod(figures[1], &gbps) || !absl::SimpleAtod(figures[2], &launch_us) ||
      (figures.size() == 4 && (!absl::SimpleAtod(figures[3], &fp32_tflops) || !(fp32_tflops > 0)))) {
    return bad();
  }
  if (precision == Precision::kFp32 && fp32_tflops > 0) tflops = fp32_tflops;
  TimedBackend::Options options;
  options.device_name = rest.substr(0, at);
  options.roofline = {.flops_per_s = tflops * 1e12, .bytes_per_s = gbps * 1e9, .launch_s = launch_us * 1e-6};
  return TimedBackend::Create(std::move(options));
}

absl::StatusOr<double> PredictTrainingStepSeconds(const GPT2Config& config, int B, int T, int microbatches,
                                                  const Roofline& roofline) {
  ASSIGN_OR_RETURN(std::unique_ptr<TimedBackend> backend,
                   TimedBackend::Create({.device_name = "prediction", .roofline = roofline, .sleep = false}));
  StageOptions options;
  options.backend = backend.get();
  options.max_batch = B;
  options.max_seq_len = T;
  ASSIGN_OR_RETURN(std::unique_ptr<GPT2Stage> stage, GPT2Stage::Create(config, options));
  ASSIGN_OR_RETURN(std::unique_ptr<AdamW> adam, AdamW::Create(stage->num_params(), stage->segments(), {}, *backend));
  const std::vector<int32_t> tokens(static_cast<size_t>(B) * T, 0);
  const double before = backend->busy_seconds();  // what Create charged (zeroing the buffers) is not a step
  stage->ZeroGrad();
  for (int m = 0; m < microbatches; ++m) {
    RETURN_IF_ERROR(stage->Forward(B, T, tokens.data(), nullptr, tokens.data()));
    RETURN_IF_ERROR(stage->Backward(nullptr, 1.0f / static_cast<float>(microbatches)));
  }
  stage->GradSquaredNormShare();
  adam->Step(stage->params(), stage->grads(), 1e-4f, 1.0f);
  return backend->busy_seconds() - before;
}

}  // namespace geotrain::model
