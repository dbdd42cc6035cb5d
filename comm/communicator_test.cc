// Collective tests: 4 ranks in one process, each with its own gRPC endpoint on loopback, in 2 sites
// (ranks 0,1 in "east", 2,3 in "west"), and 2 ranks in 2 sites. Ring, hierarchical and two-rank all-reduce
// against the exact sum (lossless) and the codec bounds (bf16, int8), identical results on every rank, the other
// collectives, the bucketed all-reduce and deadlines.
#include "comm/communicator.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <random>
#include <thread>
#include <tuple>

#include "absl/synchronization/mutex.h"
#include "comm/tensor_stream_testing.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain::comm {
namespace {

constexpr char kToken[] = "collective-token";

struct Rank {
  std::unique_ptr<TensorStreamServer> streams;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<TensorStreamClient> client;
  std::unique_ptr<GrpcCommunicator> comm;
};

class Cluster {
 public:
  Cluster(int n, const std::vector<std::string>& sites, CommunicatorOptions options) : ranks_(n) {
    std::vector<PeerInfo> peers;
    for (int r = 0; r < n; ++r) {
      ranks_[r].streams = std::make_unique<TensorStreamServer>(kToken);
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      ranks_[r].streams->Register(&builder);
      ranks_[r].server = builder.BuildAndStart();
      ranks_[r].client = std::make_unique<TensorStreamClient>(kToken);
      peers.push_back(PeerInfo{"rank" + std::to_string(r), "127.0.0.1:" + std::to_string(port), sites[r]});
    }
    options.job_id = "job-c";
    for (int r = 0; r < n; ++r) {
      ranks_[r].comm =
          std::make_unique<GrpcCommunicator>(r, peers, ranks_[r].streams.get(), ranks_[r].client.get(), options);
    }
  }
  ~Cluster() {
    for (auto& r : ranks_) {
      r.streams->Shutdown();
      r.server->Shutdown();
    }
  }
  GrpcCommunicator& comm(int r) { return *ranks_[r].comm; }
  TensorStreamClient& client(int r) { return *ranks_[r].client; }
  int size() const { return static_cast<int>(ranks_.size()); }

  // Runs fn(rank) on one thread per rank; returns each rank's status.
  std::vector<absl::Status> Run(const std::function<absl::Status(int)>& fn) {
    std::vector<absl::Status> statuses(ranks_.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back([&, r] { statuses[r] = fn(r); });
    for (auto& t : threads) t.join();
    return statuses;
  }

 private:
  std::vector<Rank> ranks_;
};

const std::vector<std::string> kTwoSites = {"east", "east", "west", "west"};

CommunicatorOptions Options(const char* lan, const char* wan, AllReduceAlgorithm algorithm) {
  CommunicatorOptions o;
  o.lan_codec = ParseCodec(lan).value();
  o.wan_codec = ParseCodec(wan).value();
  o.all_reduce = algorithm;
  o.timeout = absl::Seconds(30);
  return o;
}

std::vector<std::vector<float>> RankData(int n, size_t count, bool positive) {
  std::vector<std::vector<float>> data(n);
  for (int r = 0; r < n; ++r) {
    std::mt19937 rng(1000 + r);
    std::uniform_real_distribution<float> dist(positive ? 0.5f : -1.0f, positive ? 1.5f : 1.0f);
    data[r].resize(count);
    for (float& x : data[r]) x = dist(rng);
  }
  return data;
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

struct AllReduceCase {
  const char* lan;
  const char* wan;
  AllReduceAlgorithm algorithm;
  double relative_bound;  // per element, relative to the sum of |inputs|
};

class AllReduceTest : public ::testing::TestWithParam<AllReduceCase> {};

TEST_P(AllReduceTest, MatchesTheSumWithinTheCodecBoundAndAgreesOnEveryRank) {
  const AllReduceCase& c = GetParam();
  Cluster cluster(4, kTwoSites, Options(c.lan, c.wan, c.algorithm));
  const size_t count = 100003;  // not a multiple of the rank count
  const bool lossless = c.relative_bound < 1e-5;
  auto data = RankData(4, count, /*positive=*/!lossless);
  std::vector<double> exact(count, 0.0), magnitude(count, 0.0);
  for (const auto& d : data) {
    for (size_t i = 0; i < count; ++i) {
      exact[i] += d[i];
      magnitude[i] += std::fabs(d[i]);
    }
  }
  // Twice, so that the second call exercises the per-tag sequence numbers.
  for (int round = 0; round < 2; ++round) {
    auto work = data;
    ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(work[r]), "g"); }));
    double worst = 0;
    for (size_t i = 0; i < count; ++i) {
      worst = std::max(worst, std::fabs(work[0][i] - exact[i]) / magnitude[i]);
    }
    EXPECT_LE(worst, c.relative_bound) << c.lan << "/" << c.wan;
    for (int r = 1; r < 4; ++r) EXPECT_EQ(work[r], work[0]) << "rank " << r << " differs from rank 0";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, AllReduceTest,
    ::testing::Values(AllReduceCase{"none", "none", AllReduceAlgorithm::kRing, 1e-6},
                      AllReduceCase{"none", "none", AllReduceAlgorithm::kHierarchical, 1e-6},
                      AllReduceCase{"none", "none+zstd", AllReduceAlgorithm::kHierarchical, 1e-6},
                      // bf16: at most 3 roundings of values no larger than the final sum (positive data):
                      // partial sums crossing the WAN, then the final chunk.
                      AllReduceCase{"none", "bf16", AllReduceAlgorithm::kRing, 3 * 0x1p-8},
                      AllReduceCase{"none", "bf16", AllReduceAlgorithm::kHierarchical, 2 * 0x1p-8},
                      // int8: each rounding is at most max|block|/254 <= 1.5 x the element's own sum / 254 for
                      // these positive inputs in [0.5, 1.5].
                      AllReduceCase{"none", "int8", AllReduceAlgorithm::kRing, 3 * 3.0 / 254},
                      AllReduceCase{"none", "int8+zstd", AllReduceAlgorithm::kHierarchical, 2 * 3.0 / 254},
                      // A lossy codec inside the sites too: the members' tensors up, the leaders' exchange and
                      // the copies down each rounded once (positive data).
                      AllReduceCase{"bf16", "bf16", AllReduceAlgorithm::kHierarchical, 4 * 0x1p-8},
                      // top-k keeping everything is exact (exercises the residual plumbing).
                      AllReduceCase{"none", "topk:1", AllReduceAlgorithm::kHierarchical, 1e-6}),
    [](const auto& info) { return "Case" + std::to_string(info.index); });

TEST(Collectives, TwoRanksAllReduceByOneExchangeAndAgreeForEveryCodec) {
  // Two ranks in two sites: one tensor each way (a ring of two sends two), the exact sum without a codec, and
  // the same result on both ranks with a lossy one (each adds its own decoded operand to the peer's).
  for (const char* wan : {"none", "bf16", "int8", "topk:0.5"}) {
    Cluster cluster(2, {"east", "west"}, Options("none", wan, AllReduceAlgorithm::kRing));
    const size_t count = 10007;
    auto data = RankData(2, count, /*positive=*/true);
    for (int round = 0; round < 2; ++round) {
      auto work = data;
      const uint64_t sent_before = cluster.client(0).stats().tensors_sent;
      ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(work[r]), "g"); }));
      EXPECT_EQ(cluster.client(0).stats().tensors_sent - sent_before, 1u) << wan;
      EXPECT_EQ(work[1], work[0]) << wan << ": the ranks disagree";
      if (std::string(wan) == "none") {
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(work[0][i], data[0][i] + data[1][i]) << "element " << i;
      } else if (std::string(wan) != "topk:0.5") {
        double worst =
            0;  // one rounding of each operand: bf16 2^-9 of it, int8 at most 1.5 / 254 (inputs in [0.5, 1.5])
        for (size_t i = 0; i < count; ++i) {
          const double sum = static_cast<double>(data[0][i]) + data[1][i];
          worst = std::max(worst, std::fabs(work[0][i] - sum) / sum);
        }
        EXPECT_LE(worst, std::string(wan) == "bf16" ? 0x1p-8 : 3.0 / 254) << wan;
      }
    }
  }
}

TEST(Collectives, HierarchicalAllReduceSendsEachSitesSumAcrossOnce) {
  // Two sites of two ranks: each member sends its tensor up to its site's leader (ranks 0 and 2), the leaders
  // exchange their sites' sums in one pair exchange and each sends the result down: a leader sends two tensors
  // (one across sites, one down), a member one. A flat ring of four would send 2 x 3 chunks from every rank. Every
  // rank holds the same sum, bit for bit, for every codec (top-k's residual included: twice, the same tag).
  for (const char* wan : {"bf16", "int8", "topk:0.5"}) {
    Cluster cluster(4, kTwoSites, Options("none", wan, AllReduceAlgorithm::kHierarchical));
    const size_t count = 100003;
    auto data = RankData(4, count, /*positive=*/true);
    for (int round = 0; round < 2; ++round) {
      auto work = data;
      std::vector<uint64_t> before(4);
      for (int r = 0; r < 4; ++r) before[r] = cluster.client(r).stats().tensors_sent;
      ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(work[r]), "g"); }));
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(cluster.client(r).stats().tensors_sent - before[r], r % 2 == 0 ? 2u : 1u) << wan << " rank " << r;
        EXPECT_EQ(work[r], work[0]) << wan << ": rank " << r << " differs from rank 0";
      }
      if (std::string(wan) == "topk:0.5") continue;
      double worst = 0;  // one rounding of each site's sum as the other leader decodes it, and of its own
      for (size_t i = 0; i < count; ++i) {
        const double sum = static_cast<double>(data[0][i]) + data[1][i] + data[2][i] + data[3][i];
        worst = std::max(worst, std::fabs(work[0][i] - sum) / sum);
      }
      EXPECT_LE(worst, std::string(wan) == "bf16" ? 2 * 0x1p-8 : 2 * 3.0 / 254) << wan;
    }
  }
}

TEST(Collectives, HierarchicalAllReduceRingsThreeSitesLeaders) {
  // Three sites of two ranks (and one site of one): the leaders' all-reduce is a ring; the sum is exact
  // without a codec and the same on every rank.
  const std::vector<std::string> sites = {"east", "east", "west", "west", "north", "north", "south"};
  const int n = static_cast<int>(sites.size());
  Cluster cluster(n, sites, Options("none", "none", AllReduceAlgorithm::kHierarchical));
  const size_t count = 30011;
  auto data = RankData(n, count, /*positive=*/false);
  auto work = data;
  ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(work[r]), "g"); }));
  for (size_t i = 0; i < count; ++i) {
    double sum = 0, magnitude = 0;
    for (int r = 0; r < n; ++r) {
      sum += data[r][i];
      magnitude += std::fabs(data[r][i]);
    }
    ASSERT_LE(std::fabs(work[0][i] - sum), 1e-6 * magnitude) << "element " << i;
  }
  for (int r = 1; r < n; ++r) EXPECT_EQ(work[r], work[0]) << "rank " << r << " differs from rank 0";
}

TEST(Collectives, TopKErrorFeedbackDeliversDroppedGradientsLater) {
  // The same gradients every step with top-k 25% across the WAN: without error feedback three quarters of the
  // elements would never arrive (cumulative error = steps x gradient); with it every element's cumulative sum
  // stays within a few gradients of the exact one, and all ranks agree at every step.
  Cluster cluster(4, kTwoSites, Options("none", "topk:0.25", AllReduceAlgorithm::kHierarchical));
  const size_t count = 4096;
  auto data = RankData(4, count, /*positive=*/false);
  std::vector<double> exact(count, 0.0), cumulative(count, 0.0);
  for (const auto& d : data) {
    for (size_t i = 0; i < count; ++i) exact[i] += d[i];
  }
  constexpr int kSteps = 24;
  size_t zeros_first_step = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto work = data;
    ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(work[r]), "bucket0"); }));
    for (int r = 1; r < 4; ++r) ASSERT_EQ(work[r], work[0]) << "step " << step << " rank " << r;
    for (size_t i = 0; i < count; ++i) {
      cumulative[i] += work[0][i];
      if (step == 0 && work[0][i] == 0.0f) ++zeros_first_step;
    }
  }
  EXPECT_GT(zeros_first_step, count / 2);  // it really is sparse
  double max_exact = 0, worst = 0;
  for (size_t i = 0; i < count; ++i) {
    max_exact = std::max(max_exact, std::fabs(exact[i]));
    worst = std::max(worst, std::fabs(cumulative[i] - kSteps * exact[i]));
  }
  EXPECT_LT(worst, 8 * max_exact) << "cumulative error " << worst << " vs one gradient " << max_exact;
}

TEST(Collectives, ReduceScatterAllGatherBroadcastSendRecv) {
  Cluster cluster(4, kTwoSites, Options("none", "none", AllReduceAlgorithm::kRing));
  const size_t m = 1001;
  auto data = RankData(4, 4 * m, false);
  std::vector<std::vector<float>> scattered(4, std::vector<float>(m));
  ExpectAllOk(
      cluster.Run([&](int r) { return cluster.comm(r).ReduceScatter(data[r], absl::MakeSpan(scattered[r]), "rs"); }));
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < m; ++i) {
      const double exact =
          static_cast<double>(data[0][r * m + i]) + data[1][r * m + i] + data[2][r * m + i] + data[3][r * m + i];
      ASSERT_NEAR(scattered[r][i], exact, 1e-5) << r << " " << i;
    }
  }
  std::vector<std::vector<float>> gathered(4, std::vector<float>(4 * m));
  ExpectAllOk(
      cluster.Run([&](int r) { return cluster.comm(r).AllGather(scattered[r], absl::MakeSpan(gathered[r]), "ag"); }));
  for (int r = 0; r < 4; ++r) {
    for (int q = 0; q < 4; ++q) {
      ASSERT_TRUE(std::equal(scattered[q].begin(), scattered[q].end(), gathered[r].begin() + q * m));
    }
  }
  auto bcast = RankData(4, 5000, false);
  const std::vector<float> root_data = bcast[2];
  ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).Broadcast(absl::MakeSpan(bcast[r]), 2, "b"); }));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(bcast[r], root_data);
  // A ring of point-to-point messages, twice with the same tag (matched in order).
  std::vector<std::vector<float>> received(4, std::vector<float>(10));
  ExpectAllOk(cluster.Run([&](int r) -> absl::Status {
    for (int round = 0; round < 2; ++round) {
      std::vector<float> mine(10, static_cast<float>(r * 10 + round));
      RETURN_IF_ERROR(cluster.comm(r).Send((r + 1) % 4, mine, "p"));
      RETURN_IF_ERROR(cluster.comm(r).Recv((r + 3) % 4, absl::MakeSpan(received[r]), "p"));
      if (received[r][0] != static_cast<float>(((r + 3) % 4) * 10 + round)) return absl::InternalError("wrong value");
    }
    return absl::OkStatus();
  }));
}

TEST(Collectives, TensorsSmallerThanTheRankCount) {
  for (AllReduceAlgorithm algorithm : {AllReduceAlgorithm::kRing, AllReduceAlgorithm::kHierarchical}) {
    Cluster cluster(4, kTwoSites, Options("none", "int8", algorithm));
    for (size_t count : {size_t{0}, size_t{1}, size_t{3}}) {
      std::vector<std::vector<float>> data(4, std::vector<float>(count, 2.0f));
      ExpectAllOk(cluster.Run([&](int r) { return cluster.comm(r).AllReduceSum(absl::MakeSpan(data[r]), "tiny"); }));
      for (int r = 0; r < 4; ++r) {
        for (float x : data[r]) EXPECT_NEAR(x, 8.0f, 8.0f / 254) << "count " << count;
      }
    }
  }
}

TEST(Collectives, RanksThatShareAnEndpointEachGetTheirCopy) {
  // Actors on one worker share its endpoint (one TensorStreamServer): a broadcast's and the hierarchical
  // all-reduce's copies to them must travel under keys of their own. Ranks 2 and 3 share one here.
  std::vector<std::unique_ptr<LoopbackEndpoint>> endpoints;
  for (int e = 0; e < 3; ++e) endpoints.push_back(std::make_unique<LoopbackEndpoint>(kToken));
  const std::vector<int> endpoint_of = {0, 1, 2, 2};
  const std::vector<std::string> sites = {"east", "west", "west", "west"};
  std::vector<PeerInfo> peers;
  for (int r = 0; r < 4; ++r) {
    peers.push_back({"rank" + std::to_string(r), endpoints[endpoint_of[r]]->address(), sites[r]});
  }
  std::vector<std::unique_ptr<TensorStreamClient>> clients;
  std::vector<std::unique_ptr<GrpcCommunicator>> comms;
  for (int r = 0; r < 4; ++r) {
    clients.push_back(std::make_unique<TensorStreamClient>(kToken));
    CommunicatorOptions options = Options("none", "bf16", AllReduceAlgorithm::kHierarchical);
    options.job_id = "job-shared";
    comms.push_back(
        std::make_unique<GrpcCommunicator>(r, peers, &endpoints[endpoint_of[r]]->streams(), clients[r].get(), options));
  }
  auto run = [&](const std::function<absl::Status(int)>& fn) {
    std::vector<absl::Status> statuses(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r) threads.emplace_back([&, r] { statuses[r] = fn(r); });
    for (auto& t : threads) t.join();
    return statuses;
  };
  auto data = RankData(4, 5003, /*positive=*/true);
  auto work = data;
  ExpectAllOk(run([&](int r) { return comms[r]->AllReduceSum(absl::MakeSpan(work[r]), "g"); }));
  for (int r = 1; r < 4; ++r) EXPECT_EQ(work[r], work[0]) << "rank " << r << " differs from rank 0";
  work = data;
  ExpectAllOk(run([&](int r) { return comms[r]->Broadcast(absl::MakeSpan(work[r]), 0, "b"); }));
  for (int r = 1; r < 4; ++r) {  // the root's tensor, through bf16 across the sites
    EXPECT_EQ(work[r], work[1]) << "rank " << r << " differs from rank 1";
    for (size_t i = 0; i < data[0].size(); ++i) {
      ASSERT_NEAR(work[r][i], data[0][i], 0x1p-8 * data[0][i]) << "rank " << r << ", element " << i;
    }
  }
}

TEST(Collectives, ReceivesOfAnotherSizeAreRefusedByName) {
  // Recv, Broadcast and the hierarchical all-reduce's last step decode straight into the caller's span: a tensor of
  // another size is refused with INVALID_ARGUMENT that says so, never written past the span.
  Cluster cluster(2, {"east", "west"}, Options("none", "bf16", AllReduceAlgorithm::kRing));
  std::vector<float> sent(10, 1.0f), small(7, 0.0f);
  std::vector<absl::Status> st = cluster.Run([&](int r) {
    return r == 0 ? cluster.comm(0).Send(1, sent, "x") : cluster.comm(1).Recv(0, absl::MakeSpan(small), "x");
  });
  EXPECT_TRUE(st[0].ok()) << st[0];
  EXPECT_EQ(st[1].code(), absl::StatusCode::kInvalidArgument) << st[1];
  EXPECT_THAT(std::string(st[1].message()), testing::HasSubstr("same sizes"));
  st = cluster.Run([&](int r) {
    return r == 0 ? cluster.comm(0).Broadcast(absl::MakeSpan(sent), 0, "y")
                  : cluster.comm(1).Broadcast(absl::MakeSpan(small), 0, "y");
  });
  EXPECT_EQ(st[1].code(), absl::StatusCode::kInvalidArgument) << st[1];
}

TEST(Collectives, WrongSizesAreRefused) {
  Cluster cluster(4, kTwoSites, Options("none", "none", AllReduceAlgorithm::kRing));
  std::vector<float> in(10), out(3);
  EXPECT_EQ(cluster.comm(0).ReduceScatter(in, absl::MakeSpan(out), "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cluster.comm(0).AllGather(in, absl::MakeSpan(out), "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cluster.comm(0).Broadcast(absl::MakeSpan(in), 7, "x").code(), absl::StatusCode::kInvalidArgument);
  // A communicator built with a rank outside its peers, or with duplicate names, refuses every call.
  std::vector<PeerInfo> peers = cluster.comm(0).peers();
  TensorStreamServer server(kToken);
  TensorStreamClient client(kToken);
  GrpcCommunicator bad_rank(7, peers, &server, &client, {});
  EXPECT_EQ(bad_rank.AllReduceSum(absl::MakeSpan(in), "x").code(), absl::StatusCode::kInvalidArgument);
  peers[1].name = peers[0].name;
  GrpcCommunicator duplicate(0, peers, &server, &client, {});
  EXPECT_EQ(duplicate.Send(1, in, "x").code(), absl::StatusCode::kInvalidArgument);
}

TEST(Collectives, ConcurrentBucketsOverlapAndSum) {
  Cluster cluster(4, kTwoSites, Options("none", "bf16", AllReduceAlgorithm::kHierarchical));
  constexpr int kBuckets = 5;
  std::vector<std::vector<std::vector<float>>> buckets(4);
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < kBuckets; ++b) buckets[r].push_back(std::vector<float>(20000 + 1000 * b, 1.0f + r));
  }
  ExpectAllOk(cluster.Run([&](int r) -> absl::Status {
    BucketedAllReduce bucketed(&cluster.comm(r));
    std::vector<std::shared_future<absl::Status>> futures;
    for (int b = kBuckets - 1; b >= 0; --b) {  // backward produces the last layers' gradients first
      futures.push_back(bucketed.Start(b, absl::MakeSpan(buckets[r][b])));
      absl::SleepFor(absl::Milliseconds(2));  // "backward" keeps computing
    }
    RETURN_IF_ERROR(futures.front().get());
    return bucketed.WaitAll();
  }));
  for (int r = 0; r < 4; ++r) {
    for (int b = 0; b < kBuckets; ++b) {
      for (float x : buckets[r][b]) ASSERT_EQ(x, 10.0f);  // 1+2+3+4, exact in bf16
    }
  }
}

TEST(Collectives, BucketsAfterAFailedOneFailWithoutACollectiveUntilWaitAll) {
  std::atomic<int> calls{0};
  BucketedAllReduce bucketed([&calls](absl::Span<float>, std::string_view tag) {
    ++calls;
    return tag == "grad-bucket/1" ? absl::DeadlineExceededError("peer gone") : absl::OkStatus();
  });
  std::vector<float> data(4);
  std::vector<std::shared_future<absl::Status>> done;
  for (int b = 0; b < 4; ++b) done.push_back(bucketed.Start(b, absl::MakeSpan(data)));
  EXPECT_EQ(bucketed.WaitAll().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(calls.load(), 2);  // buckets 0 and 1; 2 and 3 carry bucket 1's error
  EXPECT_TRUE(done[0].get().ok());
  EXPECT_THAT(std::string(done[3].get().message()), testing::HasSubstr("peer gone"));
  bucketed.Start(0, absl::MakeSpan(data));  // the next step starts afresh
  EXPECT_TRUE(bucketed.WaitAll().ok());
  EXPECT_EQ(calls.load(), 3);
}

TEST(Collectives, AbandonedBucketsAreNotAllReduced) {
  std::atomic<int> calls{0};
  std::vector<float> data(4);
  {
    BucketedAllReduce bucketed([&calls](absl::Span<float>, std::string_view) {
      ++calls;
      absl::SleepFor(absl::Milliseconds(200));  // a collective in flight
      return absl::OkStatus();
    });
    for (int b = 0; b < 5; ++b) bucketed.Start(b, absl::MakeSpan(data));
    absl::SleepFor(absl::Milliseconds(50));
  }  // the step is abandoned: the bucket in flight finishes, the queued ones are dropped
  EXPECT_EQ(calls.load(), 1);
}

TEST(Collectives, GradientBucketsPackGroupsInCompletionOrderAndWriteSumsBack) {
  Cluster cluster(4, kTwoSites, Options("none", "none", AllReduceAlgorithm::kRing));
  // Per rank: 5 "layers" of three pieces each (uneven sizes) and one "embedding" group.
  const std::vector<std::vector<size_t>> sizes = {{300, 7, 1000}, {300, 7, 1000}, {50, 1, 2},
                                                  {300, 7, 1000}, {4000},         {123, 5}};
  std::vector<std::vector<std::vector<float>>> pieces(4);
  for (int r = 0; r < 4; ++r) {
    for (const auto& group : sizes) {
      for (size_t n : group) {
        std::vector<float> piece(n);
        for (size_t i = 0; i < n; ++i) piece[i] = static_cast<float>(r + 1) * static_cast<float>(i % 17);
        pieces[r].push_back(std::move(piece));
      }
    }
  }
  for (int step = 0; step < 2; ++step) {  // the buffers are reused across steps
    ExpectAllOk(cluster.Run([&](int r) -> absl::Status {
      std::vector<std::vector<absl::Span<float>>> groups;
      size_t next = 0;
      for (const auto& group : sizes) {
        groups.emplace_back();
        for (size_t k = 0; k < group.size(); ++k) groups.back().push_back(absl::MakeSpan(pieces[r][next++]));
      }
      GradientBuckets buckets(&cluster.comm(r), groups, /*bucket_bytes=*/4 * 1200);
      // Groups of 1307 floats fill a 1200-float bucket each; the small group 2 shares one with group 3.
      EXPECT_EQ(buckets.num_buckets(), 5);
      for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
        buckets.GroupReady(g);
        absl::SleepFor(absl::Milliseconds(1));  // "backward" keeps computing
      }
      return buckets.Finish();
    }));
    const float factor = step == 0 ? 10.0f : 40.0f;  // the sum of ranks 1..4, then the sum of those sums
    for (int r = 0; r < 4; ++r) {
      for (const auto& piece : pieces[r]) {
        for (size_t i = 0; i < piece.size(); ++i) ASSERT_EQ(piece[i], factor * static_cast<float>(i % 17));
      }
    }
  }
}

TEST(Collectives, GradientBucketsRefuseAMissingOrRepeatedGroup) {
  Cluster cluster(1, {"east"}, Options("none", "none", AllReduceAlgorithm::kRing));
  std::vector<float> a(10, 1.0f), b(10, 2.0f);
  GradientBuckets buckets(&cluster.comm(0), {{absl::MakeSpan(a)}, {absl::MakeSpan(b)}}, 1 << 20);
  buckets.GroupReady(0);
  EXPECT_EQ(buckets.Finish().code(), absl::StatusCode::kFailedPrecondition);
  buckets.GroupReady(0);
  buckets.GroupReady(0);
  buckets.GroupReady(1);
  EXPECT_EQ(buckets.Finish().code(), absl::StatusCode::kInternal);
  buckets.GroupReady(1);
  buckets.GroupReady(0);
  EXPECT_TRUE(buckets.Finish().ok());
  EXPECT_EQ(a[0], 1.0f);  // one rank: the sum is the value itself
}

// A BucketMemory that behaves like a GPU stream: copies are only queued, and run when a bucket's fence is
// waited for (on the all-reduce thread) or at Check. An all-reduce that did not wait for its bucket's
// fence would sum stale zeros.
class QueuedCopyMemory : public BucketMemory {
 public:
  explicit QueuedCopyMemory(int max_buckets = 100) : max_buckets_(max_buckets) {}
  absl::StatusOr<float*> Allocate(int64_t elements) override {
    if (static_cast<int>(buffers_.size()) >= max_buckets_) return absl::ResourceExhaustedError("out of device memory");
    buffers_.emplace_back(static_cast<size_t>(elements), 0.0f);
    return buffers_.back().data();
  }
  void Copy(float* dst, const float* src, int64_t n) override {
    absl::MutexLock lock(&mu_);
    queued_.push_back({dst, src, n});
  }
  BucketFence Fence(int) override {
    return [this] {
      Drain();
      absl::MutexLock lock(&mu_);
      ++fences_;
      return absl::OkStatus();
    };
  }
  absl::Status Check() override {
    Drain();
    return check_;
  }
  void Drain() {
    absl::MutexLock lock(&mu_);
    for (const auto& [dst, src, n] : queued_) std::copy(src, src + n, dst);
    queued_.clear();
  }
  int fences() {
    absl::MutexLock lock(&mu_);
    return fences_;
  }
  absl::Status check_;

 private:
  const int max_buckets_;
  std::deque<std::vector<float>> buffers_;
  absl::Mutex mu_;
  std::vector<std::tuple<float*, const float*, int64_t>> queued_ ABSL_GUARDED_BY(mu_);
  int fences_ ABSL_GUARDED_BY(mu_) = 0;
};

// A middle pipeline stage has no embeddings: its last group is empty. It gets no bucket (an empty all-reduce still
// exchanges messages, a round trip per ring step across sites), and reporting it is still required once.
TEST(Collectives, GradientBucketsGiveAnEmptyGroupNoBucket) {
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  std::atomic<int> calls{0};
  AllReduceFn all_reduce = [&calls](absl::Span<float> data, std::string_view) {
    ++calls;
    for (float& x : data) x *= 3.0f;  // a stand-in sum: three ranks of equal values
    return absl::OkStatus();
  };
  QueuedCopyMemory memory;
  // Both blocks fill their bucket; the empty group comes after a full bucket, where a group would open a new one.
  GradientBuckets buckets(all_reduce, &memory, {{absl::MakeSpan(a)}, {absl::MakeSpan(b)}, {}},
                          /*bucket_bytes=*/4 * 1000);
  ASSERT_TRUE(buckets.status().ok());
  EXPECT_EQ(buckets.num_buckets(), 2);
  for (int step = 0; step < 2; ++step) {
    buckets.GroupReady(0);
    buckets.GroupReady(1);
    EXPECT_EQ(buckets.Finish().code(), absl::StatusCode::kFailedPrecondition) << "the empty group was not reported";
    buckets.GroupReady(0);
    buckets.GroupReady(1);
    buckets.GroupReady(2);
    buckets.GroupReady(2);
    EXPECT_EQ(buckets.Finish().code(), absl::StatusCode::kInternal) << "the empty group reported twice";
    buckets.GroupReady(2);
    buckets.GroupReady(0);
    buckets.GroupReady(1);
    ASSERT_TRUE(buckets.Finish().ok());
  }
  // Per step: both buckets ran before each of the three Finish calls, none for the empty group.
  EXPECT_EQ(calls.load(), 2 * 3 * 2);
  // Only a Finish that returns OK writes the sums back: once per step.
  EXPECT_EQ(a[0], 9.0f);
  EXPECT_EQ(b[0], 18.0f);
}

TEST(Collectives, GradientBucketsWaitForEachBucketsFenceInTheirMemory) {
  Cluster cluster(2, {"east", "east"}, Options("none", "none", AllReduceAlgorithm::kRing));
  std::vector<std::vector<float>> grads(2);
  for (int r = 0; r < 2; ++r) grads[r].assign(3000, static_cast<float>(r + 1));
  std::vector<int> fences(2);
  ExpectAllOk(cluster.Run([&](int r) -> absl::Status {
    QueuedCopyMemory memory;
    std::vector<std::vector<absl::Span<float>>> groups;
    for (int g = 0; g < 3; ++g) groups.push_back({absl::MakeSpan(grads[r]).subspan(1000 * g, 1000)});
    AllReduceFn all_reduce = [&cluster, r](absl::Span<float> data, std::string_view tag) {
      return cluster.comm(r).AllReduceSum(data, tag);
    };
    GradientBuckets buckets(all_reduce, &memory, groups, /*bucket_bytes=*/4 * 1000);
    if (!buckets.status().ok()) return buckets.status();
    EXPECT_EQ(buckets.num_buckets(), 3);
    for (int g = 0; g < 3; ++g) buckets.GroupReady(g);
    absl::Status finished = buckets.Finish();
    fences[r] = memory.fences();
    return finished;
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(fences[r], 3);
    for (float x : grads[r]) ASSERT_EQ(x, 3.0f);  // 1 + 2, written back through the queued copies
  }
}

TEST(Collectives, GradientBucketsReportTheirMemorysErrors) {
  Cluster cluster(1, {"east"}, Options("none", "none", AllReduceAlgorithm::kRing));
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  AllReduceFn all_reduce = [&cluster](absl::Span<float> data, std::string_view tag) {
    return cluster.comm(0).AllReduceSum(data, tag);
  };
  QueuedCopyMemory tight(/*max_buckets=*/1);
  GradientBuckets unallocated(all_reduce, &tight, {{absl::MakeSpan(a)}, {absl::MakeSpan(b)}}, 4 * 1000);
  EXPECT_EQ(unallocated.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(unallocated.status().message()),
              testing::AllOf(testing::HasSubstr("gradient bucket 1"), testing::HasSubstr("more pipeline stages")));
  unallocated.GroupReady(0);
  EXPECT_EQ(unallocated.Finish().code(), absl::StatusCode::kResourceExhausted);

  QueuedCopyMemory failing;
  failing.check_ = absl::InternalError("gradient bucket copies on cuda:0: an illegal memory access");
  GradientBuckets buckets(all_reduce, &failing, {{absl::MakeSpan(a)}, {absl::MakeSpan(b)}}, 4 * 1000);
  ASSERT_TRUE(buckets.status().ok());
  buckets.GroupReady(0);
  buckets.GroupReady(1);
  EXPECT_THAT(buckets.Finish().message(), testing::HasSubstr("illegal memory access"));
}

TEST(Collectives, AMissingRankMakesTheOthersFailAtTheDeadline) {
  CommunicatorOptions options = Options("none", "none", AllReduceAlgorithm::kRing);
  options.timeout = absl::Milliseconds(500);
  Cluster cluster(4, kTwoSites, options);
  std::vector<std::vector<float>> data(4, std::vector<float>(1000, 1.0f));
  const absl::Time start = absl::Now();
  auto statuses = cluster.Run([&](int r) -> absl::Status {
    if (r == 3) return absl::OkStatus();  // rank 3 never joins
    return cluster.comm(r).AllReduceSum(absl::MakeSpan(data[r]), "late");
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded) << statuses[r];
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(Collectives, APairWhosePeerNeverComesFailsAtTheDeadlineAndKeepsItsTensor) {
  CommunicatorOptions options = Options("none", "bf16", AllReduceAlgorithm::kRing);
  options.timeout = absl::Milliseconds(500);
  Cluster cluster(2, {"east", "west"}, options);
  std::vector<float> data(1000, 1.1f);  // not a bf16 value: rounding it would show
  const std::vector<float> before = data;
  const absl::Status status = cluster.comm(0).AllReduceSum(absl::MakeSpan(data), "alone");
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_EQ(data, before) << "a failed exchange must not change the caller's tensor";
}

}  // namespace
}  // namespace geotrain::comm
