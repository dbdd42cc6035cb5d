// Codec speed on one core: encode and decode GB/s (of fp32 tensor bytes) for every codec, against two
// references measured in the same run: memcpy of the same bytes and the scalar (non-vectorised) loops.
//
//   build/bench/comm/comm_codec_bench [--mib 64] [--reps 7]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/codec.h"

namespace {

using Clock = std::chrono::steady_clock;

using geotrain::bench::LoadAverage;
using geotrain::bench::Median;

template <typename F>
double TimeSeconds(F&& f) {
  const auto start = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("load average (1 min) at the start: %s\n", LoadAverage().c_str());
  using namespace geotrain::comm;
  size_t mib = 64;
  int reps = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--mib") mib = std::stoul(argv[i + 1]);
    if (std::string(argv[i]) == "--reps") reps = std::stoi(argv[i + 1]);
  }
  const size_t n = mib * 1024 * 1024 / sizeof(float);
  const double bytes = static_cast<double>(n) * sizeof(float);
  std::vector<float> input(n), output(n), copy(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1e-3f);  // gradient-like magnitudes
  for (float& x : input) x = dist(rng);

  std::printf("codec bench: %zu MiB fp32 tensor (%zu elements), one thread, median of %d, isa=%s\n", mib, n, reps,
              std::string(CodecIsa()).c_str());
  // Reference: memcpy of the same bytes.
  std::vector<double> memcpy_times;
  for (int r = 0; r < reps; ++r) {
    memcpy_times.push_back(TimeSeconds([&] { std::memcpy(copy.data(), input.data(), bytes); }));
  }
  const double memcpy_gbs = bytes / Median(memcpy_times) / 1e9;
  std::printf("reference memcpy: %.2f GB/s\n", memcpy_gbs);

  struct Row {
    std::string name;
    double encode_gbs, decode_gbs, ratio;
  };
  std::vector<Row> rows;
  const std::vector<std::string> codecs = {"none",      "fp16",      "bf16",      "int8",      "topk:0.01",
                                           "fp16+zstd", "bf16+zstd", "int8+zstd", "none+zstd", "topk:0.01+zstd"};
  for (bool scalar : {false, true}) {
    ForceScalarCodecs(scalar);
    for (const std::string& name : codecs) {
      if (scalar && name != "bf16" && name != "int8" && name != "fp16") continue;
      const Codec codec = ParseCodec(name).value();
      std::vector<float> residual;
      std::vector<double> encode_times, decode_times;
      Bytes wire;
      for (int r = 0; r < reps; ++r) {
        // Alternate encode and decode so that both see the same machine conditions.
        encode_times.push_back(TimeSeconds([&] {
          absl::Status s = EncodeTensor(codec, input, &wire, &residual);
          if (!s.ok()) std::fprintf(stderr, "encode failed: %s\n", std::string(s.message()).c_str());
        }));
        decode_times.push_back(TimeSeconds([&] {
          absl::Status s = DecodeTensor(wire.span(), absl::MakeSpan(output));
          if (!s.ok()) std::fprintf(stderr, "decode failed: %s\n", std::string(s.message()).c_str());
        }));
      }
      Row row{scalar ? name + " (scalar)" : name, bytes / Median(encode_times) / 1e9,
              bytes / Median(decode_times) / 1e9, bytes / static_cast<double>(wire.size())};
      std::printf("%-20s encode %6.2f GB/s  decode %6.2f GB/s  ratio %6.2fx\n", row.name.c_str(), row.encode_gbs,
                  row.decode_gbs, row.ratio);
      rows.push_back(row);
    }
  }
  ForceScalarCodecs(false);
  std::printf("\nsummary (GB/s of fp32 data; memcpy %.2f GB/s)\n", memcpy_gbs);
  std::printf("| codec | encode GB/s | decode GB/s | vs memcpy (enc/dec) | compression |\n|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %.2f | %.2f | %.2f / %.2f | %.2fx |\n", r.name.c_str(), r.encode_gbs, r.decode_gbs,
                r.encode_gbs / memcpy_gbs, r.decode_gbs / memcpy_gbs, r.ratio);
  }
  std::printf("load average (1 min) at the end: %s\n", LoadAverage().c_str());
  return 0;
}
