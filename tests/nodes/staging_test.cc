// Data staging between real gRPC servers in one process: the head's DataStaging service serving shards from its
// disk, workers' caches fetching them (directly, or relayed by a site peer's DataStaging), and the cache's handling
// of a corrupt copy, a fetch broken off, and a shard missing on the head.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "common/rpc.h"
#include "gtest/gtest.h"
#include "head/staging_service.h"
#include "worker/shard_cache.h"
#include "worker/staging_service.h"

namespace geotrain {
namespace {

namespace fs = std::filesystem;
using worker::ShardCache;
using worker::ShardCacheOptions;
using worker::ShardOrigin;
using worker::ShardServer;

constexpr char kToken[] = "staging-test-token";

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class StagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("geotrain_staging_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    std::mt19937 rng(7);
    for (int i = 0; i < 2; ++i) {
      std::string bytes(3 * (1 << 20) + 1234 * (i + 1), '\0');  // several 1 MiB chunks
      for (char& c : bytes) c = static_cast<char>(rng());
      const std::string path = (dir_ / "data" / ("train_" + std::to_string(i) + ".bin")).string();
      std::ofstream(path, std::ios::binary) << bytes;
      contents_[path] = bytes;
    }
    job_.set_job_id("job-1");
    job_.set_state(JOB_RUNNING);
    job_.mutable_spec()->mutable_data()->set_train((dir_ / "data" / "train_*.bin").string());
    head_service_ = std::make_unique<head::HeadStagingService>(
        kToken, (dir_ / "head").string(),
        head::HeadStagingService::Hooks{
            .get_job = [this](const std::string&) -> absl::StatusOr<JobInfo> { return job_; },
            .log = [](const std::string&, const std::string&) {}},
        nullptr);
    fs::create_directories(dir_ / "head");
    head_ = Serve(head_service_.get(), &head_address_);
  }

  void TearDown() override {
    relay_server_.reset();
    relay_service_.reset();
    relay_cache_.reset();
    head_->Shutdown();
    fs::remove_all(dir_);
  }

  std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    auto server = builder.BuildAndStart();
    *address = "127.0.0.1:" + std::to_string(port);
    return server;
  }

  std::unique_ptr<ShardCache> Cache(const std::string& name) {
    ShardCacheOptions options;
    options.dir = (dir_ / name / "cache").string();
    options.site = "site-a";
    options.token = kToken;
    options.worker_id = [name] { return name; };
    options.retry_for_ms = 2000;
    return std::make_unique<ShardCache>(options);
  }

  // The shard as the head lists it (size and time as it reports them).
  ShardInfo ListedByHead(const std::string& path) {
    auto stub = DataStaging::NewStub(grpc::CreateChannel(head_address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    AttachToken(&ctx, kToken);
    ListShardsRequest request;
    request.set_job_id("job-1");
    request.set_pattern(job_.spec().data().train());
    ListShardsReply reply;
    EXPECT_TRUE(stub->ListShards(&ctx, request, &reply).ok());
    for (const ShardInfo& s : reply.shards()) {
      if (s.path() == path) return s;
    }
    ADD_FAILURE() << path << " not listed";
    return {};
  }

  ShardServer Head() const { return ShardServer{head_address_, "the head", ShardOrigin::kHead}; }

  absl::StatusOr<std::string> Get(ShardCache* cache, const ShardInfo& shard, const ShardServer& source,
                                  std::map<ShardOrigin, uint64_t>* bytes) {
    return cache->Get("job-1", shard, source, Head(), nullptr,
                      [bytes](uint64_t n, ShardOrigin origin) { (*bytes)[origin] += n; });
  }

  fs::path dir_;
  std::map<std::string, std::string> contents_;
  JobInfo job_;
  std::unique_ptr<head::HeadStagingService> head_service_;
  std::unique_ptr<grpc::Server> head_;
  std::string head_address_;
  std::unique_ptr<ShardCache> relay_cache_;
  std::unique_ptr<worker::WorkerStagingService> relay_service_;
  std::unique_ptr<grpc::Server> relay_server_;
};

TEST_F(StagingTest, FetchesVerifiesAndReusesTheCachedCopy) {
  const std::string path = contents_.begin()->first;
  const ShardInfo shard = ListedByHead(path);
  auto cache = Cache("w1");
  std::map<ShardOrigin, uint64_t> bytes;
  absl::StatusOr<std::string> local = Get(cache.get(), shard, Head(), &bytes);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(ReadAll(*local), contents_[path]);
  EXPECT_EQ(bytes[ShardOrigin::kHead], contents_[path].size());
  // The head recorded the checksum when it first served the shard; a listing now carries it.
  EXPECT_EQ(ListedByHead(path).crc32c().size(), 8u);
  EXPECT_TRUE(fs::exists(dir_ / "head" / "staged_shards.json"));

  // Another job (a new cache object on the same dir, as after a restart): the copy verifies, nothing is fetched.
  auto again = Cache("w1");
  bytes.clear();
  ASSERT_TRUE(Get(again.get(), ListedByHead(path), Head(), &bytes).ok());
  EXPECT_EQ(bytes[ShardOrigin::kHead], 0u);
  EXPECT_EQ(bytes[ShardOrigin::kCache], contents_[path].size());
}

TEST_F(StagingTest, CorruptCopyIsFetchedAgain) {
  const std::string path = contents_.begin()->first;
  std::string local;
  {
    auto cache = Cache("w1");
    std::map<ShardOrigin, uint64_t> bytes;
    absl::StatusOr<std::string> got = Get(cache.get(), ListedByHead(path), Head(), &bytes);
    ASSERT_TRUE(got.ok()) << got.status();
    local = *got;
  }
  {
    std::fstream f(local, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    f << "corrupted";
  }
  auto cache = Cache("w1");
  std::map<ShardOrigin, uint64_t> bytes;
  absl::StatusOr<std::string> got = Get(cache.get(), ListedByHead(path), Head(), &bytes);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(ReadAll(*got), contents_[path]);
  EXPECT_EQ(bytes[ShardOrigin::kHead], contents_[path].size());
}

TEST_F(StagingTest, BrokenFetchResumesFromTheBytesOnDisk) {
  const std::string path = contents_.begin()->first;
  const ShardInfo shard = ListedByHead(path);
  std::string local;
  {
    auto cache = Cache("w1");
    std::map<ShardOrigin, uint64_t> bytes;
    absl::StatusOr<std::string> got = Get(cache.get(), shard, Head(), &bytes);
    ASSERT_TRUE(got.ok()) << got.status();
    local = *got;
  }
  // As if the worker died after 1 MiB: the file is cut and its record says incomplete.
  const std::string record = local.substr(0, local.size() - 4) + ".json";
  std::string text = ReadAll(record);
  const size_t at = text.find("\"complete\":true");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 15, "\"complete\":false");
  std::ofstream(record, std::ios::trunc) << text;
  fs::resize_file(local, 1 << 20);
  auto cache = Cache("w1");
  std::map<ShardOrigin, uint64_t> bytes;
  absl::StatusOr<std::string> got = Get(cache.get(), ListedByHead(path), Head(), &bytes);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(ReadAll(*got), contents_[path]);
  EXPECT_EQ(bytes[ShardOrigin::kHead], contents_[path].size() - (1 << 20));
}

TEST_F(StagingTest, SitePeerRelaysSoTheShardCrossesTheWanOnce) {
  relay_cache_ = Cache("relay");
  relay_service_ = std::make_unique<worker::WorkerStagingService>(relay_cache_.get(), kToken, (dir_ / "relay").string(),
                                                                  Head(), nullptr);
  std::string relay_address;
  relay_server_ = Serve(relay_service_.get(), &relay_address);
  const ShardServer relay{relay_address, "worker relay", ShardOrigin::kPeer};
  for (const auto& [path, bytes_expected] : contents_) {
    auto cache = Cache("peer");
    std::map<ShardOrigin, uint64_t> bytes;
    absl::StatusOr<std::string> got = Get(cache.get(), ListedByHead(path), relay, &bytes);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(ReadAll(*got), bytes_expected);
    EXPECT_EQ(bytes[ShardOrigin::kPeer], bytes_expected.size());
    EXPECT_EQ(bytes[ShardOrigin::kHead], 0u);
  }
  // The relay fetched each shard from the head for itself (and keeps it).
  int cached = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "relay" / "cache")) cached += e.path().extension() == ".bin";
  EXPECT_EQ(cached, 2);
}

TEST_F(StagingTest, MissingShardNamesTheShardAndTheWorker) {
  const std::string path = contents_.begin()->first;
  const ShardInfo shard = ListedByHead(path);
  fs::remove(path);
  auto cache = Cache("w1");
  std::map<ShardOrigin, uint64_t> bytes;
  absl::StatusOr<std::string> got = Get(cache.get(), shard, Head(), &bytes);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find(path), std::string::npos) << got.status();
  EXPECT_NE(got.status().message().find("worker w1"), std::string::npos) << got.status();
}

}  // namespace
}  // namespace geotrain
