// Tensor-stream throughput on loopback against a plain TCP socket copy of the same bytes, measured in the
// same run, alternating (A A2 A' B M, A A2 A' B M, ...), medians.
//   A  = end to end through the mailbox: Send(fp32 tensor, codec none) -> Recv -> DecodeInto an fp32 buffer
//   A2 = end to end into a waiting receiver: Send(fp32, none) -> RecvInto the fp32 buffer (posted before the
//        Send starts, so the chunks are decoded into it as they arrive)
//   A' = transport only: SendEncoded(already encoded bytes) -> Recv (the encoded tensor in the mailbox)
//   B  = one persistent TCP connection on 127.0.0.1: write the bytes, the peer reads them into a buffer
//   M  = memcpy of the same bytes between the same two buffers (the memory-bandwidth ceiling of one copy)
// In A, A2, A' and B the receiving thread is started, and waiting, before the clock starts; the clock stops when it
// has the data (and, for the stream, when Send has returned: the receiver's acknowledgement is included).
// Every size runs in every round (1, 16, 64, 256, 1, 16, ...), tensors under 16 MiB several times in a row (16 MiB
// per round and size); the first round is dropped. Ratios are given two ways: median(A) / median(B) over all
// samples, and the median of the ratio between the A and the B of the same iteration.
//
// Run it under the shared lock so that nothing else runs (the machine is shared):
//   flock /tmp/geotrain-heavy.lock build/bench/comm/comm_stream_bench [--sizes-mib 1,16,64,256] [--chunk-kib 1024]
//     [--reps 11] [--window-kib 0] [--frame-kib 0] [--read-kib 0]   (transport tuning; 0 = gRPC's default)
// If the lock is free when it starts (run without flock), the benchmark takes it for the run itself.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "bench/bench_util.h"
#include "comm/tensor_stream.h"

namespace {

using namespace geotrain::comm;
using Clock = std::chrono::steady_clock;

using geotrain::bench::LoadAverage;
using geotrain::bench::Median;

constexpr char kHeavyLock[] = "/tmp/geotrain-heavy.lock";

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Runs `receive` on a new thread and returns once that thread is about to call it: the receiving side is waiting
// before the clock starts (as a pipeline stage or a ring step waits for its input), for the stream and TCP alike,
// so that no variant counts a thread's start-up.
class ReceiverThread {
 public:
  explicit ReceiverThread(std::function<void()> receive)
      : thread_([this, receive = std::move(receive)] {
          started_.Notify();
          receive();
        }) {
    started_.WaitForNotification();
  }
  ~ReceiverThread() { Join(); }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  absl::Notification started_;
  std::thread thread_;
};

// A connected pair of loopback TCP sockets.
struct TcpPair {
  int sender = -1, receiver = -1;
  TcpPair() {
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
    listen(listener, 1);
    sender = socket(AF_INET, SOCK_STREAM, 0);
    connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    receiver = accept(listener, nullptr, nullptr);
    close(listener);
  }
  ~TcpPair() {
    close(sender);
    close(receiver);
  }
  // Sends `n` bytes from `src` while the other end reads them into `dst`; returns seconds.
  double Copy(const uint8_t* src, uint8_t* dst, size_t n) {
    ReceiverThread reader([&] {
      size_t got = 0;
      while (got < n) {
        const ssize_t r = read(receiver, dst + got, n - got);
        if (r <= 0) break;
        got += static_cast<size_t>(r);
      }
    });
    const auto start = Clock::now();
    size_t sent = 0;
    while (sent < n) {
      const ssize_t w = write(sender, src + sent, n - sent);
      if (w <= 0) break;
      sent += static_cast<size_t>(w);
    }
    reader.Join();
    return Seconds(start, Clock::now());
  }
};

// Medians of per-round ratios a[i] / b[i].
double PairedRatio(const std::vector<double>& numerator_times, const std::vector<double>& denominator_times) {
  std::vector<double> ratios;
  for (size_t i = 0; i < numerator_times.size() && i < denominator_times.size(); ++i) {
    ratios.push_back(denominator_times[i] / numerator_times[i]);  // throughput ratio = inverse time ratio
  }
  return Median(ratios);
}

}  // namespace

int main(int argc, char** argv) {
  // The shared lock: held by our caller (flock ... comm_stream_bench), or taken here if it is free.
  const int lock_fd = open(kHeavyLock, O_RDWR | O_CREAT, 0666);
  const bool took_lock = lock_fd >= 0 && flock(lock_fd, LOCK_EX | LOCK_NB) == 0;
  std::printf("%s: %s\n", kHeavyLock,
              took_lock ? "was free, held by this benchmark for the run"
                        : "held by another process (the caller's flock, as documented)");
  std::printf("load average (1 min) at the start: %s\n", LoadAverage().c_str());
  std::vector<size_t> sizes_mib = {1, 16, 64, 256};
  size_t chunk_kib = 1024;
  int reps = 11;
  int window_kib = -1, frame_kib = -1, read_kib = -1;  // -1: the library's defaults
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--sizes-mib") {
      sizes_mib.clear();
      std::string list = argv[i + 1];
      size_t at = 0;
      while (at < list.size()) {
        size_t comma = list.find(',', at);
        if (comma == std::string::npos) comma = list.size();
        sizes_mib.push_back(std::stoul(list.substr(at, comma - at)));
        at = comma + 1;
      }
    }
    if (flag == "--chunk-kib") chunk_kib = std::stoul(argv[i + 1]);
    if (flag == "--reps") reps = std::stoi(argv[i + 1]);
    if (flag == "--window-kib") window_kib = std::stoi(argv[i + 1]);
    if (flag == "--frame-kib") frame_kib = std::stoi(argv[i + 1]);
    if (flag == "--read-kib") read_kib = std::stoi(argv[i + 1]);
  }
  const std::string token = "bench-token";
  TensorStreamOptions options;
  options.chunk_bytes = chunk_kib * 1024;
  options.max_tensor_bytes = uint64_t{2} << 30;
  if (window_kib >= 0) options.http2_window_bytes = window_kib * 1024;
  if (frame_kib >= 0) options.http2_max_frame_bytes = frame_kib * 1024;
  if (read_kib >= 0) options.tcp_read_chunk_bytes = read_kib * 1024;
  TensorStreamServer streams(token, options);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  streams.Register(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  TensorStreamClient client(token, options);
  TcpPair tcp;

  std::printf(
      "tensor stream vs raw TCP on loopback, chunk %zu KiB, codec none, http2 window %d B, frame %d B, "
      "tcp read chunk %d B (0 = gRPC default)\n",
      chunk_kib, options.http2_window_bytes, options.http2_max_frame_bytes, options.tcp_read_chunk_bytes);
  int64_t step = 0;
  {
    // Warm the connection up first (HTTP/2 windows grow with the traffic seen): 4 x 64 MiB, not measured.
    std::vector<float> warm((size_t{64} << 20) / sizeof(float), 0.5f);
    for (int i = 0; i < 4; ++i) {
      TensorKey key{"bench", step++, 0, "warmup", "sender"};
      std::thread receiver([&] { (void)streams.Recv(key, absl::Now() + absl::Seconds(120)); });
      (void)client.Send(address, key, {static_cast<int64_t>(warm.size())}, warm, Codec{},
                        absl::Now() + absl::Seconds(120));
      receiver.join();
    }
  }
  struct SizeState {
    size_t mib, bytes, n;
    std::vector<float> data, out;
    std::vector<uint8_t> tcp_src, tcp_dst;
    Bytes encoded;
    std::vector<double> stream_times, into_times, transport_times, tcp_times, memcpy_times;
  };
  std::vector<SizeState> states;
  for (size_t mib : sizes_mib) {
    SizeState st;
    st.mib = mib;
    st.bytes = mib << 20;
    st.n = st.bytes / sizeof(float);
    st.data.assign(st.n, 1.5f);
    st.out.assign(st.n, 0.0f);
    st.tcp_src.assign(st.bytes, 7);
    st.tcp_dst.assign(st.bytes, 0);
    if (!EncodeTensor(Codec{}, st.data, &st.encoded).ok()) return 1;
    states.push_back(std::move(st));
  }
  const uint64_t direct_before = streams.stats().tensors_decoded_on_arrival;
  int into_runs = 0;
  for (int r = 0; r < reps + 1; ++r) {
    for (SizeState& st : states) {
      // Small tensors take a millisecond or less, where the shared machine's jitter is large: take more samples
      // of them (up to 16 per round, 16 MiB per round and size).
      const int inner = static_cast<int>(std::clamp<size_t>(16 / st.mib, 1, 16));
      for (int k = 0; k < inner; ++k) {
        const std::vector<int64_t> shape = {static_cast<int64_t>(st.n)};
        // A: end to end through the mailbox.
        TensorKey key{"bench", step++, 0, "t", "sender"};
        ReceiverThread receiver([&] {
          auto got = streams.Recv(key, absl::Now() + absl::Seconds(120));
          if (!got.ok() || !got->DecodeInto(absl::MakeSpan(st.out)).ok()) std::fprintf(stderr, "recv failed\n");
        });
        auto start = Clock::now();
        absl::Status s = client.Send(address, key, shape, st.data, Codec{}, absl::Now() + absl::Seconds(120));
        receiver.Join();
        const double a = Seconds(start, Clock::now());
        if (!s.ok()) {
          std::fprintf(stderr, "send failed: %s\n", std::string(s.message()).c_str());
          return 1;
        }
        // A2: end to end into a waiting RecvInto: the receiving thread has posted its buffer before the Send starts
        // (as a pipeline stage or a ring step waits for its input).
        key.step = step++;
        ReceiverThread receiver_into([&] {
          if (!streams.RecvInto(key, absl::MakeSpan(st.out), absl::Now() + absl::Seconds(120)).ok()) {
            std::fprintf(stderr, "recv into failed\n");
          }
        });
        while (streams.stats().receivers_waiting == 0) std::this_thread::yield();
        start = Clock::now();
        s = client.Send(address, key, shape, st.data, Codec{}, absl::Now() + absl::Seconds(120));
        receiver_into.Join();
        const double a_into = Seconds(start, Clock::now());
        if (!s.ok()) return 1;
        ++into_runs;
        // A': transport only.
        key.step = step++;
        ReceiverThread receiver2([&] {
          if (!streams.Recv(key, absl::Now() + absl::Seconds(120)).ok()) std::fprintf(stderr, "recv failed\n");
        });
        start = Clock::now();
        s = client.SendEncoded(address, key, shape, Codec{}, st.encoded, absl::Now() + absl::Seconds(120));
        receiver2.Join();
        const double a2 = Seconds(start, Clock::now());
        // B: raw TCP.
        const double b = tcp.Copy(st.tcp_src.data(), st.tcp_dst.data(), st.bytes);
        // M: memcpy.
        start = Clock::now();
        std::memcpy(st.tcp_dst.data(), st.tcp_src.data(), st.bytes);
        const double m = Seconds(start, Clock::now());
        if (r == 0) continue;
        st.memcpy_times.push_back(m);
        st.stream_times.push_back(a);
        st.into_times.push_back(a_into);
        st.transport_times.push_back(a2);
        st.tcp_times.push_back(b);
      }
    }
  }
  const uint64_t direct = streams.stats().tensors_decoded_on_arrival - direct_before;
  struct Row {
    size_t mib;
    double stream_gbs, into_gbs, transport_gbs, tcp_gbs, memcpy_gbs;
    double stream_paired, into_paired, transport_paired;
  };
  std::vector<Row> rows;
  for (SizeState& st : states) {
    const double bytes = static_cast<double>(st.bytes);
    Row row{st.mib,
            bytes / Median(st.stream_times) / 1e9,
            bytes / Median(st.into_times) / 1e9,
            bytes / Median(st.transport_times) / 1e9,
            bytes / Median(st.tcp_times) / 1e9,
            bytes / Median(st.memcpy_times) / 1e9,
            PairedRatio(st.stream_times, st.tcp_times),
            PairedRatio(st.into_times, st.tcp_times),
            PairedRatio(st.transport_times, st.tcp_times)};
    std::printf(
        "%4zu MiB: end-to-end %.2f GB/s (Recv), %.2f GB/s (RecvInto), transport %.2f GB/s, raw TCP %.2f GB/s, "
        "memcpy %.2f GB/s; / TCP: %.2f, %.2f, %.2f (paired: %.2f, %.2f, %.2f; %zu samples)\n",
        st.mib, row.stream_gbs, row.into_gbs, row.transport_gbs, row.tcp_gbs, row.memcpy_gbs,
        row.stream_gbs / row.tcp_gbs, row.into_gbs / row.tcp_gbs, row.transport_gbs / row.tcp_gbs, row.stream_paired,
        row.into_paired, row.transport_paired, st.tcp_times.size());
    rows.push_back(row);
  }
  std::printf("RecvInto runs decoded chunk by chunk on arrival: %llu of %d\n", static_cast<unsigned long long>(direct),
              into_runs);
  // Per-tensor latency of small tensors, Send + Recv, median of 100 (the fixed cost of a transfer).
  for (size_t kib : {1, 32, 128, 512}) {
    std::vector<float> small(kib * 256, 1.0f);
    std::vector<double> times;
    for (int r = 0; r < 101; ++r) {
      TensorKey key{"bench", step++, 0, "small", "sender"};
      const auto start = Clock::now();
      absl::Status s = client.Send(address, key, {static_cast<int64_t>(small.size())}, small, Codec{},
                                   absl::Now() + absl::Seconds(10));
      auto got = streams.Recv(key, absl::Now() + absl::Seconds(10));
      if (!s.ok() || !got.ok()) return 1;
      if (r > 0) times.push_back(Seconds(start, Clock::now()));
    }
    std::printf("%zu KiB tensor Send+Recv latency: median %.0f us\n", kib, Median(times) * 1e6);
  }
  std::printf("streams opened by the client: %llu\n", static_cast<unsigned long long>(client.stats().streams_opened));
  std::printf(
      "\n| tensor | end-to-end GB/s (Recv) | end-to-end GB/s (RecvInto) | transport GB/s | raw TCP GB/s | memcpy GB/s "
      "| e2e / TCP (Recv) | e2e / TCP (RecvInto) | transport / TCP |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %zu MiB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f (%.2f) | %.2f (%.2f) | %.2f (%.2f) |\n", r.mib,
                r.stream_gbs, r.into_gbs, r.transport_gbs, r.tcp_gbs, r.memcpy_gbs, r.stream_gbs / r.tcp_gbs,
                r.stream_paired, r.into_gbs / r.tcp_gbs, r.into_paired, r.transport_gbs / r.tcp_gbs,
                r.transport_paired);
  }
  std::printf("(ratios: median of each over all samples, divided; in brackets the median of the paired ratios)\n");
  streams.Shutdown();
  server->Shutdown();
  std::printf("load average (1 min) at the end: %s\n", LoadAverage().c_str());
  if (took_lock) flock(lock_fd, LOCK_UN);
  if (lock_fd >= 0) close(lock_fd);
  return 0;
}
