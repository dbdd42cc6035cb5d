// NCCL all-reduce among the GPUs of this machine through comm::NcclCommunicator (CUDA builds): one process,
// one thread and one rank per GPU, fp32 sums of 1 MiB to 1 GiB. Prints the time per all-reduce (the mean
// over --iters after --warmup, the slowest rank's), algbw = bytes / time and busbw = algbw x 2(n-1)/n, the
// nccl-tests convention. Each call waits for its result (the communicator's calls are synchronous), as the
// runtime's calls do. With fewer than 2 GPUs it says so and exits 0.
//
//   build/bench/comm/bench_nccl_allreduce [--min-mb 1] [--max-mb 1024] [--iters 20] [--warmup 5] [--gpus N]
//                                         [--out results.jsonl]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "comm/nccl_communicator.h"

namespace {

using geotrain::comm::NcclCommunicator;
using Clock = std::chrono::steady_clock;

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  size_t min_mb = 1, max_mb = 1024;
  int iters = 20, warmup = 5, gpus = -1;
  std::string out_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--min-mb")
      min_mb = std::stoul(argv[i + 1]);
    else if (flag == "--max-mb")
      max_mb = std::stoul(argv[i + 1]);
    else if (flag == "--iters")
      iters = std::stoi(argv[i + 1]);
    else if (flag == "--warmup")
      warmup = std::stoi(argv[i + 1]);
    else if (flag == "--gpus")
      gpus = std::stoi(argv[i + 1]);
    else if (flag == "--out")
      out_path = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const int available = DeviceCount();
  const int n = gpus > 0 ? std::min(gpus, available) : available;
  if (n < 2) {
    std::printf(
        "bench_nccl_allreduce: %d CUDA device(s) visible; an all-reduce needs at least 2. Nothing to "
        "measure.\n",
        available);
    return 0;
  }
  std::printf("load average (1 min) at the start: %s\n", geotrain::bench::LoadAverage().c_str());
  std::printf("NCCL all-reduce (fp32 sum, in place) over %d GPUs:", n);
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) std::printf(" [%d] %s", d, prop.name);
  }
  std::printf("\n%14s %12s %12s %12s %12s\n", "size (B)", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)");

  std::vector<std::unique_ptr<NcclCommunicator>> comms(n);
  std::vector<float*> buffers(n, nullptr);
  const std::string id = geotrain::comm::NewNcclUniqueId().value();
  size_t max_bytes = max_mb << 20;
  {
    std::vector<std::thread> threads;
    std::vector<std::string> errors(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto comm = NcclCommunicator::Create(r, n, id, r, absl::Seconds(300));
        if (!comm.ok()) {
          errors[r] = comm.status().ToString();
          return;
        }
        comms[r] = std::move(*comm);
        cudaSetDevice(r);
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        if (max_bytes > free_bytes / 2)
          errors[r] = absl::StrFormat("GPU %d has only %zu bytes free", r, free_bytes);
        else if (cudaMalloc(&buffers[r], max_bytes) != cudaSuccess)
          errors[r] = "cudaMalloc failed";
        else
          cudaMemset(buffers[r], 0, max_bytes);
        cudaDeviceSynchronize();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      if (!errors[r].empty()) {
        std::fprintf(stderr, "rank %d: %s\n", r, errors[r].c_str());
        return 1;
      }
    }
  }

  std::ofstream out;
  if (!out_path.empty()) out.open(out_path, std::ios::app);
  for (size_t bytes = min_mb << 20; bytes <= max_bytes; bytes *= 2) {
    const size_t count = bytes / sizeof(float);
    std::vector<double> seconds(n, 0);
    std::vector<std::string> errors(n);
    std::barrier start(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        cudaSetDevice(r);
        absl::Span<float> data(buffers[r], count);
        for (int i = 0; i < warmup; ++i) {
          if (absl::Status s = comms[r]->AllReduceSum(data, "warmup"); !s.ok()) errors[r] = s.ToString();
        }
        start.arrive_and_wait();
        const auto t0 = Clock::now();
        for (int i = 0; i < iters && errors[r].empty(); ++i) {
          if (absl::Status s = comms[r]->AllReduceSum(data, "bench"); !s.ok()) errors[r] = s.ToString();
        }
        seconds[r] = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      if (!errors[r].empty()) {
        std::fprintf(stderr, "rank %d: %s\n", r, errors[r].c_str());
        return 1;
      }
    }
    const double time = *std::max_element(seconds.begin(), seconds.end());
    const double algbw = static_cast<double>(bytes) / time / 1e9;
    const double busbw = algbw * 2.0 * (n - 1) / n;
    std::printf("%14zu %12zu %12.1f %12.2f %12.2f\n", bytes, count, time * 1e6, algbw, busbw);
    std::fflush(stdout);
    if (out.is_open()) {
      out << absl::StrFormat(
          "{\"bench\": \"nccl_allreduce\", \"gpus\": %d, \"bytes\": %zu, \"time_us\": %.2f, \"algbw_gbps\": %.3f, "
          "\"busbw_gbps\": %.3f}\n",
          n, bytes, time * 1e6, algbw, busbw);
    }
  }
  for (int r = 0; r < n; ++r) {
    cudaSetDevice(r);
    cudaFree(buffers[r]);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { comms[r].reset(); });
  for (auto& t : threads) t.join();
  return 0;
}
