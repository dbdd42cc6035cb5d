// AsyncSender: sends with different tags overlap up to max_in_flight, a tag's sends stay in order, a send to
// another site waits for the group in flight, and every byte is counted once for its site.
#include "worker/async_sender.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace geotrain::worker {
namespace {

// A communicator whose sends take `send_ms` each (a round trip), recording how many overlap and their order.
class SlowComm : public comm::Communicator {
 public:
  explicit SlowComm(int send_ms) : send_ms_(send_ms) {}
  int rank() const override { return 0; }
  int size() const override { return 3; }
  absl::Status AllReduceSum(absl::Span<float>, std::string_view) override { return absl::UnimplementedError(""); }
  absl::Status ReduceScatter(absl::Span<const float>, absl::Span<float>, std::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::Status AllGather(absl::Span<const float>, absl::Span<float>, std::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::Status Broadcast(absl::Span<float>, int, std::string_view) override { return absl::UnimplementedError(""); }
  absl::Status Recv(int, absl::Span<float>, std::string_view) override { return absl::UnimplementedError(""); }
  absl::Status Send(int peer, absl::Span<const float> data, std::string_view tag) override {
    {
      absl::MutexLock lock(&mu_);
      ++in_flight_;
      max_in_flight_ = std::max(max_in_flight_, in_flight_);
      if (peer != last_peer_ && in_flight_ > 1) mixed_peers_ = true;
      last_peer_ = peer;
      order_.push_back(std::string(tag));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(send_ms_));
    bytes_ += data.size() * 2;  // "encoded" at half size
    absl::MutexLock lock(&mu_);
    --in_flight_;
    return absl::OkStatus();
  }
  uint64_t bytes() const { return bytes_; }

  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int last_peer_ ABSL_GUARDED_BY(mu_) = -1;
  bool mixed_peers_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);

 private:
  const int send_ms_;
  std::atomic<uint64_t> bytes_{0};
};

TEST(AsyncSenderTest, DifferentTagsOverlapUpToTheLimitAndBytesCountOnce) {
  SlowComm comm(50);
  AsyncSender sender(
      &comm, [&] { return comm.bytes(); }, "a", nullptr, /*max_in_flight=*/4);
  std::vector<float> data(100, 1.0f);
  const auto start = std::chrono::steady_clock::now();
  for (int m = 0; m < 8; ++m) sender.Send(1, "b", data.data(), data.size(), "act/" + std::to_string(m));
  SiteTraffic traffic;
  ASSERT_TRUE(sender.Flush(&traffic).ok());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  {
    absl::MutexLock lock(&comm.mu_);
    EXPECT_EQ(comm.max_in_flight_, 4);
  }
  EXPECT_LT(seconds, 8 * 0.050);  // one at a time would take 8 round trips
  EXPECT_EQ(traffic.wan_bytes["a>b"], 8 * 200);
  EXPECT_DOUBLE_EQ(traffic.raw_wan_bytes, 8 * 400.0);
}

TEST(AsyncSenderTest, ATagsSendsAndOtherSitesWait) {
  SlowComm comm(5);
  AsyncSender sender(
      &comm, [&] { return comm.bytes(); }, "a", nullptr, /*max_in_flight=*/4);
  std::vector<float> data(10, 1.0f);
  for (int i = 0; i < 4; ++i) sender.Send(1, "b", data.data(), data.size(), "val");  // one tag: in order
  for (int i = 0; i < 4; ++i) {
    sender.Send(1, "b", data.data(), data.size(), "act/" + std::to_string(i));
    sender.Send(2, "c", data.data(), data.size(), "grad/" + std::to_string(i));  // another site
  }
  SiteTraffic traffic;
  ASSERT_TRUE(sender.Flush(&traffic).ok());
  absl::MutexLock lock(&comm.mu_);
  EXPECT_FALSE(comm.mixed_peers_);
  EXPECT_EQ(traffic.wan_bytes["a>b"], 8 * 20);
  EXPECT_EQ(traffic.wan_bytes["a>c"], 4 * 20);
}

TEST(AsyncSenderTest, OneInFlightKeepsTheQueueOrder) {
  SlowComm comm(1);
  AsyncSender sender(
      &comm, [&] { return comm.bytes(); }, "a");
  std::vector<float> data(10, 1.0f);
  std::vector<std::string> tags;
  for (int i = 0; i < 6; ++i) {
    tags.push_back("act/" + std::to_string(i));
    sender.Send(1, "b", data.data(), data.size(), tags.back());
  }
  SiteTraffic traffic;
  ASSERT_TRUE(sender.Flush(&traffic).ok());
  absl::MutexLock lock(&comm.mu_);
  EXPECT_EQ(comm.max_in_flight_, 1);
  EXPECT_EQ(comm.order_, tags);
}

}  // namespace
}  // namespace geotrain::worker
