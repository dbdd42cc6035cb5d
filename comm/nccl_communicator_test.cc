// NCCL inside a site (CUDA builds; ctest label gpu). Every test skips with a message where fewer CUDA
// devices are visible than it needs. One GPU: a size-1 communicator's operations, host pointers refused, a
// join that times out. Two or more: one rank per GPU on threads of this process (one id from
// NewNcclUniqueId), every collective against a CPU reference, grouped send/receive around a ring, a
// missing rank failing the others by the deadline, and the hierarchical all-reduce with two "sites" whose
// leaders talk through a GrpcCommunicator on loopback. Any number: GradientBuckets in DeviceBucketMemory.
#include "comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <thread>

#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain::comm {
namespace {

using ::testing::HasSubstr;

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

#define REQUIRE_CUDA_DEVICES(n)                                                                  \
  if (int found = DeviceCount(); found < (n)) {                                                  \
    if (found == 0) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none or fails)"; \
    GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << found;                         \
  }

// n floats of device memory on `device`.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t n) : n_(n) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(&data_, std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess);
  }
  DeviceBuffer(int device, const std::vector<float>& values) : DeviceBuffer(device, values.size()) {
    EXPECT_EQ(cudaMemcpy(data_, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Span<float> span() { return absl::MakeSpan(data_, n_); }
  std::vector<float> Read() const {
    std::vector<float> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), data_, n_ * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  float* data_ = nullptr;
  size_t n_;
};

// Rank r's element i: small multiples of 1/4, so fp32 sums over a few ranks are exact in any order.
std::vector<float> RankValues(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>((rank + 1) * ((i % 13) + 1)) - 1.0f;
  return v;
}

std::vector<float> SumOverRanks(int ranks, size_t n) {
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> v = RankValues(r, n);
    for (size_t i = 0; i < n; ++i) sum[i] += v[i];
  }
  return sum;
}

// Element-wise equality, reporting the first difference and how many there are (not megabytes of values).
void ExpectSameFloats(const std::vector<float>& actual, const std::vector<float>& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  size_t differences = 0, first = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i] && differences++ == 0) first = i;
  }
  EXPECT_EQ(differences, 0u) << what << ": first at " << first << ": " << actual[first] << " != " << expected[first];
}

// Makes one communicator per rank (rank r on GPU `devices[r]`), on threads, then runs fn(rank, comm) on
// one thread per rank and returns each rank's status.
class Ranks {
 public:
  explicit Ranks(std::vector<int> devices, absl::Duration timeout = absl::Seconds(60))
      : devices_(std::move(devices)), comms_(devices_.size()) {
    const std::string id = NewNcclUniqueId().value();
    std::vector<absl::Status> created = Run([&](int r) -> absl::Status {
      ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(r, size(), id, devices_[r], timeout));
      comms_[r] = std::move(comm);
      return absl::OkStatus();
    });
    for (const absl::Status& s : created) EXPECT_TRUE(s.ok()) << s;
  }
  ~Ranks() {
    // Finalising waits for the peers: destroy on all threads at once.
    Run([&](int r) {
      comms_[r].reset();
      return absl::OkStatus();
    });
  }

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int r) const { return devices_[r]; }
  NcclCommunicator& comm(int r) { return *comms_[r]; }
  bool ok() const {
    for (const auto& c : comms_) {
      if (c == nullptr) return false;
    }
    return true;
  }

  std::vector<absl::Status> Run(const std::function<absl::Status(int)>& fn) {
    std::vector<absl::Status> statuses(devices_.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) {
      threads.emplace_back([&, r] {
        cudaSetDevice(devices_[r]);
        statuses[r] = fn(r);
      });
    }
    for (auto& t : threads) t.join();
    return statuses;
  }

 private:
  std::vector<int> devices_;
  std::vector<std::unique_ptr<NcclCommunicator>> comms_;
};

std::vector<int> AllDevices() {
  std::vector<int> devices(std::min(DeviceCount(), 8));
  for (int d = 0; d < static_cast<int>(devices.size()); ++d) devices[d] = d;
  return devices;
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

TEST(NcclCommunicator, RefusesBadArgumentsBeforeTouchingTheDevice) {
  // Runs everywhere: the checks come before any CUDA call.
  EXPECT_EQ(NcclCommunicator::Create(0, 1, "short", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(2, 2, std::string(kNcclUniqueIdBytes, '\0'), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(0, 0, std::string(kNcclUniqueIdBytes, '\0'), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclCommunicator, SizeOneOperations) {
  REQUIRE_CUDA_DEVICES(1);
  Ranks ranks({0});
  ASSERT_TRUE(ranks.ok());
  NcclCommunicator& comm = ranks.comm(0);
  const size_t n = 1000;
  const std::vector<float> values = RankValues(0, n);

  DeviceBuffer data(0, values);
  ASSERT_TRUE(comm.AllReduceSum(data.span(), "ar").ok());
  ExpectSameFloats(data.Read(), values, "all-reduce");
  ASSERT_TRUE(comm.Broadcast(data.span(), 0, "bc").ok());
  ASSERT_TRUE(comm.Reduce(data.span(), 0, "rd").ok());
  ExpectSameFloats(data.Read(), values, "broadcast and reduce");

  DeviceBuffer out(0, n);
  ASSERT_TRUE(comm.ReduceScatter(data.span(), out.span(), "rs").ok());
  ExpectSameFloats(out.Read(), values, "reduce-scatter");
  DeviceBuffer gathered(0, n);
  ASSERT_TRUE(comm.AllGather(data.span(), gathered.span(), "ag").ok());
  ExpectSameFloats(gathered.Read(), values, "all-gather");

  DeviceBuffer received(0, n);
  const NcclSend send{0, data.span()};
  const NcclRecv receive{0, received.span()};
  ASSERT_TRUE(comm.SendRecv(absl::MakeConstSpan(&send, 1), absl::MakeConstSpan(&receive, 1), "self").ok());
  ExpectSameFloats(received.Read(), values, "send to self");

  std::vector<float> staged(n);
  ASSERT_TRUE(comm.CopyToHost(data.span(), staged.data()).ok());
  ExpectSameFloats(staged, values, "copy to host");

  std::vector<float> host = values;
  absl::Status refused = comm.AllReduceSum(absl::MakeSpan(host), "host");
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("device pointers"));
  EXPECT_EQ(comm.ReduceScatter(data.span(), out.span().subspan(0, 10), "rs").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm.health().ok()) << "refused calls do not break the communicator";
}

TEST(NcclCommunicator, JoinTimesOutWhenARankNeverComes) {
  REQUIRE_CUDA_DEVICES(1);
  const absl::Time start = absl::Now();
  auto comm = NcclCommunicator::Create(0, 2, NewNcclUniqueId().value(), 0, absl::Seconds(3));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_THAT(comm.status().message(), HasSubstr("rank 0 of 2"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

TEST(NcclCommunicator, CollectivesMatchTheCpuReference) {
  REQUIRE_CUDA_DEVICES(2);
  Ranks ranks(AllDevices());
  ASSERT_TRUE(ranks.ok());
  const int n = ranks.size();
  for (size_t count : {size_t{1}, size_t{1000}, size_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(count);
    const std::vector<float> sum = SumOverRanks(n, count);
    ExpectAllOk(ranks.Run([&](int r) -> absl::Status {
      DeviceBuffer data(ranks.device(r), RankValues(r, count));
      RETURN_IF_ERROR(ranks.comm(r).AllReduceSum(data.span(), "ar"));
      const std::string rank = "rank " + std::to_string(r);
      ExpectSameFloats(data.Read(), sum, rank + " all-reduce");

      DeviceBuffer reduced(ranks.device(r), RankValues(r, count));
      RETURN_IF_ERROR(ranks.comm(r).Reduce(reduced.span(), n - 1, "rd"));
      ExpectSameFloats(reduced.Read(), r == n - 1 ? sum : RankValues(r, count), rank + " reduce");

      DeviceBuffer broadcast(ranks.device(r), RankValues(r, count));
      RETURN_IF_ERROR(ranks.comm(r).Broadcast(broadcast.span(), 1, "bc"));
      ExpectSameFloats(broadcast.Read(), RankValues(1, count), rank + " broadcast");

      // Reduce-scatter of n * count: rank r gets the sum of block r.
      DeviceBuffer input(ranks.device(r), RankValues(r, n * count));
      DeviceBuffer block(ranks.device(r), count);
      RETURN_IF_ERROR(ranks.comm(r).ReduceScatter(input.span(), block.span(), "rs"));
      const std::vector<float> full_sum = SumOverRanks(n, n * count);
      ExpectSameFloats(block.Read(),
                       std::vector<float>(full_sum.begin() + r * count, full_sum.begin() + (r + 1) * count),
                       rank + " reduce-scatter");

      // All-gather: block q of the output is rank q's input.
      DeviceBuffer mine(ranks.device(r), RankValues(r, count));
      DeviceBuffer all(ranks.device(r), n * count);
      RETURN_IF_ERROR(ranks.comm(r).AllGather(mine.span(), all.span(), "ag"));
      std::vector<float> expected;
      for (int q = 0; q < n; ++q) {
        std::vector<float> v = RankValues(q, count);
        expected.insert(expected.end(), v.begin(), v.end());
      }
      ExpectSameFloats(all.Read(), expected, rank + " all-gather");
      return absl::OkStatus();
    }));
  }
}

TEST(NcclCommunicator, SendRecvAroundARing) {
  REQUIRE_CUDA_DEVICES(2);
  Ranks ranks(AllDevices());
  ASSERT_TRUE(ranks.ok());
  const int n = ranks.size();
  const size_t count = 100000;
  ExpectAllOk(ranks.Run([&](int r) -> absl::Status {
    DeviceBuffer mine(ranks.device(r), RankValues(r, count));
    DeviceBuffer from_previous(ranks.device(r), count);
    // Every rank sends and receives at once: grouped, so nobody waits for a Recv that comes later.
    const NcclSend send{(r + 1) % n, mine.span()};
    const NcclRecv receive{(r + n - 1) % n, from_previous.span()};
    if (absl::Status s =
            ranks.comm(r).SendRecv(absl::MakeConstSpan(&send, 1), absl::MakeConstSpan(&receive, 1), "ring");
        !s.ok()) {
      return s;
    }
    ExpectSameFloats(from_previous.Read(), RankValues((r + n - 1) % n, count), "rank " + std::to_string(r));
    // Plain Send/Recv in a matching order: 0 sends to 1, then 1 sends back.
    if (r < 2) {
      DeviceBuffer buffer(ranks.device(r), RankValues(r, count));
      if (r == 0) {
        RETURN_IF_ERROR(ranks.comm(0).Send(1, buffer.span(), "p2p"));
        RETURN_IF_ERROR(ranks.comm(0).Recv(1, buffer.span(), "p2p"));
        ExpectSameFloats(buffer.Read(), RankValues(0, count), "rank 1 returned what it received");
      } else {
        RETURN_IF_ERROR(ranks.comm(1).Recv(0, buffer.span(), "p2p"));
        RETURN_IF_ERROR(ranks.comm(1).Send(0, buffer.span(), "p2p"));
      }
    }
    return absl::OkStatus();
  }));
}

TEST(NcclCommunicator, AMissingRankFailsTheOthersByTheDeadline) {
  REQUIRE_CUDA_DEVICES(2);
  Ranks ranks({0, 1}, absl::Seconds(3));
  ASSERT_TRUE(ranks.ok());
  DeviceBuffer data(0, RankValues(0, 1000));
  const absl::Time start = absl::Now();
  absl::Status s = ranks.comm(0).AllReduceSum(data.span(), "alone");  // rank 1 never calls
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("alone"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(ranks.comm(0).health().ok());
  EXPECT_EQ(ranks.comm(0).AllReduceSum(data.span(), "after").code(), absl::StatusCode::kFailedPrecondition);
}

// Two sites: with 4 or more GPUs, GPUs {0,1} and {2,3}; with 2 or 3, one GPU per site. The site leaders'
// communicator is a GrpcCommunicator on loopback (lossless, then bf16 on the WAN).
TEST(NcclHierarchicalAllReduce, TwoSitesMatchTheSum) {
  REQUIRE_CUDA_DEVICES(2);
  const int per_site = DeviceCount() >= 4 ? 2 : 1;
  std::vector<std::vector<int>> site_devices = {{}, {}};
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < per_site; ++i) site_devices[s].push_back(s * per_site + i);
  }
  for (const char* wan : {"none", "bf16"}) {
    SCOPED_TRACE(wan);
    constexpr char kToken[] = "nccl-hier-token";
    std::vector<std::unique_ptr<TensorStreamServer>> streams;
    std::vector<std::unique_ptr<grpc::Server>> servers;
    std::vector<std::unique_ptr<TensorStreamClient>> clients;
    std::vector<PeerInfo> peers;
    for (int s = 0; s < 2; ++s) {
      streams.push_back(std::make_unique<TensorStreamServer>(kToken));
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      streams[s]->Register(&builder);
      servers.push_back(builder.BuildAndStart());
      clients.push_back(std::make_unique<TensorStreamClient>(kToken));
      peers.push_back(
          PeerInfo{"leader" + std::to_string(s), "127.0.0.1:" + std::to_string(port), s == 0 ? "east" : "west"});
    }
    CommunicatorOptions options;
    options.job_id = "job-h";
    options.wan_codec = ParseCodec(wan).value();
    options.timeout = absl::Seconds(60);
    std::vector<std::unique_ptr<GrpcCommunicator>> leaders;
    for (int s = 0; s < 2; ++s) {
      leaders.push_back(std::make_unique<GrpcCommunicator>(s, peers, streams[s].get(), clients[s].get(), options));
    }

    std::vector<std::unique_ptr<Ranks>> sites;
    for (int s = 0; s < 2; ++s) sites.push_back(std::make_unique<Ranks>(site_devices[s]));
    ASSERT_TRUE(sites[0]->ok() && sites[1]->ok());
    const int world = 2 * per_site;
    const size_t count = (3 << 20) + 5;  // three and a bit chunks of 1 Mi floats
    const std::vector<float> sum = SumOverRanks(world, count);
    std::vector<std::vector<float>> results(world);
    std::vector<std::thread> threads;
    std::vector<absl::Status> statuses(world);
    for (int s = 0; s < 2; ++s) {
      for (int i = 0; i < per_site; ++i) {
        threads.emplace_back([&, s, i] {
          const int global = s * per_site + i;
          NcclCommunicator& site = sites[s]->comm(i);
          cudaSetDevice(site.device());
          auto all_reduce = NcclHierarchicalAllReduce::Create(&site, i == 0 ? leaders[s].get() : nullptr, 1 << 20);
          if (!all_reduce.ok()) {
            statuses[global] = all_reduce.status();
            return;
          }
          DeviceBuffer data(site.device(), RankValues(global, count));
          statuses[global] = (*all_reduce)->AllReduceSum(data.span(), "grads");
          results[global] = data.Read();
        });
      }
    }
    for (auto& t : threads) t.join();
    ExpectAllOk(statuses);
    for (int g = 0; g < world; ++g) {
      ExpectSameFloats(results[g], results[0], "rank " + std::to_string(g) + ": every rank ends with the same bits");
    }
    // Lossless: exact (sums of quarters). bf16 on the WAN: within bf16's 2^-8 relative error per encode.
    double worst = 0;
    for (size_t i = 0; i < count; ++i) {
      worst = std::max(worst, std::abs(double(results[0][i]) - sum[i]) / std::max(1.0, std::abs(double(sum[i]))));
    }
    EXPECT_LE(worst, std::string(wan) == "none" ? 0.0 : 2.0 / 256) << wan;
    for (auto& site : sites) site.reset();
    for (int s = 0; s < 2; ++s) {
      streams[s]->Shutdown();
      servers[s]->Shutdown();
    }
  }
}

// The data-parallel path of a CUDA stage: GradientBuckets in DeviceBucketMemory over NCCL, one rank per GPU
// (one GPU: a size-1 communicator). Each rank's "backward" writes its gradients with asynchronous copies on
// its own compute stream, queued behind a large copy that keeps the stream busy, and reports each group at
// once: a bucket whose all-reduce did not wait for its event would sum stale memory. Two steps, so the
// buckets and events are reused.
TEST(DeviceBucketMemory, GradientBucketsSumOnTheGpuAfterEachBucketsEvent) {
  REQUIRE_CUDA_DEVICES(1);
  Ranks ranks(AllDevices());
  ASSERT_TRUE(ranks.ok());
  const int world = ranks.size();
  const std::vector<size_t> group_sizes = {300000, 7, 1 << 20, 4096};  // ragged, one group per "layer"
  size_t total = 0;
  for (size_t n : group_sizes) total += n;
  std::vector<std::vector<float>> results(world);
  ExpectAllOk(ranks.Run([&](int r) -> absl::Status {
    cudaStream_t compute;
    if (cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) != cudaSuccess) {
      return absl::InternalError("cudaStreamCreate");
    }
    DeviceBuffer grads(ranks.device(r), total);
    DeviceBuffer busy_src(ranks.device(r), 64 << 20), busy_dst(ranks.device(r), 64 << 20);
    float* pinned = nullptr;
    if (cudaMallocHost(&pinned, total * sizeof(float)) != cudaSuccess) return absl::InternalError("cudaMallocHost");
    const std::vector<float> values = RankValues(r, total);
    std::copy(values.begin(), values.end(), pinned);
    std::vector<std::vector<absl::Span<float>>> groups;
    for (size_t offset = 0, g = 0; g < group_sizes.size(); offset += group_sizes[g++]) {
      groups.push_back({grads.span().subspan(offset, group_sizes[g])});
    }
    absl::Status status;
    {
      DeviceBucketMemory memory(ranks.device(r), compute);
      NcclCommunicator* comm = &ranks.comm(r);
      AllReduceFn all_reduce = [comm](absl::Span<float> data, std::string_view tag) {
        return comm->AllReduceSum(data, tag);
      };
      GradientBuckets buckets(all_reduce, &memory, groups, /*bucket_bytes=*/2 << 20);
      status = buckets.status();
      for (int step = 0; step < 2 && status.ok(); ++step) {
        cudaMemsetAsync(grads.span().data(), 0, total * sizeof(float), compute);
        cudaMemcpyAsync(busy_dst.span().data(), busy_src.span().data(), (64 << 20) * sizeof(float),
                        cudaMemcpyDeviceToDevice, compute);
        size_t offset = 0;
        for (size_t g = 0; g < group_sizes.size(); ++g) {
          cudaMemcpyAsync(grads.span().data() + offset, pinned + offset, group_sizes[g] * sizeof(float),
                          cudaMemcpyHostToDevice, compute);
          buckets.GroupReady(static_cast<int>(g));
          offset += group_sizes[g];
        }
        status = buckets.Finish();
      }
      if (status.ok() && cudaStreamSynchronize(compute) != cudaSuccess) status = absl::InternalError("stream");
    }
    results[r] = grads.Read();
    cudaFreeHost(pinned);
    cudaStreamDestroy(compute);
    return status;
  }));
  const std::vector<float> sum = SumOverRanks(world, total);
  for (int r = 0; r < world; ++r) ExpectSameFloats(results[r], sum, "rank " + std::to_string(r));
}

}  // namespace
}  // namespace geotrain::comm
