// GrpcCommunicator: ring and hierarchical collectives over tensor streams, and the bucketed gradient
// all-reduce (see communicator.h for the contract).
//
// Each step of a ring sends one chunk to the next rank on a helper thread while receiving one from the previous
// rank; a Send completes once the peer's mailbox holds the chunk, so no step waits on the peer's Recv and the
// ring cannot deadlock. Reduce-scatter encodes each partial sum with the codec of the link it crosses; the
// all-gather phase encodes each final chunk once (by its owner, who also keeps the decoded value) and forwards
// the same bytes around the ring, so every rank ends with identical values even with lossy codecs.
#include "comm/communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace geotrain::comm {

struct GrpcCommunicator::Call {
  std::string prefix;  // "<op>:<tag>"
  int64_t sequence = 0;
  absl::Time deadline;
};

namespace {

int Mod(int a, int n) { return ((a % n) + n) % n; }

// Bounds of chunk c of n over `total` elements (balanced; sizes differ by at most one).
std::pair<size_t, size_t> ChunkBounds(size_t total, int n, int c) {
  const size_t begin = static_cast<size_t>(static_cast<unsigned __int128>(total) * c / n);
  const size_t end = static_cast<size_t>(static_cast<unsigned __int128>(total) * (c + 1) / n);
  return {begin, end};
}

absl::Status CheckElements(const ReceivedTensor& t, size_t expected) {
  if (t.num_elements() != static_cast<int64_t>(expected) || t.shape.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("collective received tensor ", t.key.ToString(), " with ",
                                                   t.num_elements(), " elements, expected ", expected,
                                                   "; do all ranks pass the same sizes?"));
  }
  return absl::OkStatus();
}

// Runs `send` on a helper thread while the caller receives; joins before returning.
class AsyncStatus {
 public:
  template <typename F>
  explicit AsyncStatus(F&& f) : thread_([this, f = std::forward<F>(f)]() mutable { status_ = f(); }) {}
  ~AsyncStatus() {
    if (thread_.joinable()) thread_.join();
  }
  absl::Status Wait() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  std::thread thread_;
};

}  // namespace

GrpcCommunicator::GrpcCommunicator(int rank, std::vector<PeerInfo> peers, TensorStreamServer* server,
                                   TensorStreamClient* client, CommunicatorOptions options)
    : rank_(rank), peers_(std::move(peers)), server_(server), client_(client), options_(std::move(options)) {
  absl::flat_hash_set<std::string> names;
  for (const PeerInfo& p : peers_) {
    if (p.name.empty() || !names.insert(p.name).second) {
      config_status_ =
          absl::InvalidArgumentError(absl::StrCat("communicator peers need unique, non-empty names ('", p.name, "')"));
    }
  }
  if (rank_ < 0 || rank_ >= static_cast<int>(peers_.size())) {
    config_status_ = absl::InvalidArgumentError(
        absl::StrCat("communicator rank ", rank_, " is outside the ", peers_.size(), " peers"));
  }
  if (server_ == nullptr || client_ == nullptr) {
    config_status_ = absl::InvalidArgumentError("communicator needs a tensor stream server and client");
  }
}

const Codec& GrpcCommunicator::LinkCodec(int a, int b) const {
  return peers_[a].site == peers_[b].site ? options_.lan_codec : options_.wan_codec;
}

const Codec& GrpcCommunicator::GatherCodec(const std::vector<int>& group) const {
  for (size_t i = 0; i < group.size(); ++i) {
    if (peers_[group[i]].site != peers_[group[(i + 1) % group.size()]].site) return options_.wan_codec;
  }
  return options_.lan_codec;
}

GrpcCommunicator::Call GrpcCommunicator::Begin(std::string_view op, std::string_view tag) {
  Call call;
  call.prefix = absl::StrCat(std::string(op), ":", std::string(tag));
  call.deadline = absl::Now() + options_.timeout;
  absl::MutexLock lock(&mu_);
  call.sequence = sequence_[call.prefix]++;
  return call;
}

TensorKey GrpcCommunicator::MakeKey(const Call& call, const std::string& part, int src) const {
  return TensorKey{options_.job_id, call.sequence, 0, absl::StrCat(call.prefix, "/", part), peers_[src].name};
}

std::vector<float>* GrpcCommunicator::Residual(const std::string& key) {
  absl::MutexLock lock(&mu_);
  return &residuals_[key];
}

absl::Status GrpcCommunicator::SendWithRetries(const Call& call, int peer, const std::function<absl::Status()>& send) {
  absl::Duration backoff = absl::Milliseconds(50);
  for (int attempt = 0;; ++attempt) {
    absl::Status status = send();
    // A retry of a tensor whose first delivery was taken but not acknowledged finds it waiting.
    if (attempt > 0 && status.code() == absl::StatusCode::kAlreadyExists) return absl::OkStatus();
    if (status.code() != absl::StatusCode::kUnavailable) return status;
    if (server_->JobCancelled(options_.job_id)) {
      return absl::CancelledError(absl::StrCat("job ", options_.job_id, " is stopping: ", status.message()));
    }
    if (attempt == 0 && options_.on_peer_unavailable) options_.on_peer_unavailable(peers_[peer].name);
    if (absl::Now() + backoff >= call.deadline) {
      return absl::UnavailableError(
          absl::StrCat(status.message(), " (retried ", attempt + 1, " time(s) until the deadline)"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

absl::Status GrpcCommunicator::SendTo(const Call& call, const std::string& part, int peer, absl::Span<const float> data,
                                      const Codec& codec, const std::string& residual_key) {
  // Prepared once, however many attempts it takes (top-k's error feedback must see the tensor once).
  std::vector<float>* residual = codec.error_feedback() ? Residual(residual_key) : nullptr;
  ASSIGN_OR_RETURN(OutgoingTensor tensor, OutgoingTensor::Prepare(codec, data, residual));
  return SendOutgoing(call, part, peer, tensor);
}

absl::Status GrpcCommunicator::SendOutgoing(const Call& call, const std::string& part, int peer,
                                            const OutgoingTensor& tensor) {
  const TensorKey key = MakeKey(call, part, rank_);
  const int64_t elements = static_cast<int64_t>(tensor.size());
  return SendWithRetries(call, peer,
                         [&] { return client_->Send(peers_[peer].address, key, {elements}, tensor, call.deadline); });
}

absl::Status GrpcCommunicator::SendEncodedTo(const Call& call, const std::string& part, int peer, const Codec& codec,
                                             const Bytes& encoded, int64_t elements) {
  const TensorKey key = MakeKey(call, part, rank_);
  return SendWithRetries(call, peer, [&] {
    return client_->SendEncoded(peers_[peer].address, key, {elements}, codec, encoded, call.deadline);
  });
}

absl::StatusOr<ReceivedTensor> GrpcCommunicator::RecvFrom(const Call& call, const std::string& part, int peer) {
  return server_->Recv(MakeKey(call, part, peer), call.deadline);
}

absl::Status GrpcCommunicator::RecvFromInto(const Call& call, const std::string& part, int peer,
                                            absl::Span<float> out) {
  absl::Status status = server_->RecvInto(MakeKey(call, part, peer), out, call.deadline);
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    return absl::InvalidArgumentError(
        absl::StrCat("collective: ", status.message(), "; do all ranks pass the same sizes?"));
  }
  return status;
}

absl::Status GrpcCommunicator::RingReduceScatter(const Call& call, const std::vector<int>& group,
                                                 absl::Span<float> data) {
  const int n = static_cast<int>(group.size());
  if (n == 1) return absl::OkStatus();
  const int p = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
  const int next = group[Mod(p + 1, n)];
  const int prev = group[Mod(p - 1, n)];
  const Codec& codec = LinkCodec(rank_, next);
  for (int s = 0; s < n - 1; ++s) {
    const auto [send_begin, send_end] = ChunkBounds(data.size(), n, Mod(p - s - 1, n));
    const auto [recv_begin, recv_end] = ChunkBounds(data.size(), n, Mod(p - s - 2, n));
    const std::string part = absl::StrCat("rs/", s);
    AsyncStatus sent([&, part, send_begin = send_begin, send_end = send_end] {
      return SendTo(call, part, next, data.subspan(send_begin, send_end - send_begin), codec,
                    absl::StrCat(call.prefix, "/", part));
    });
    absl::StatusOr<ReceivedTensor> got = RecvFrom(call, part, prev);
    absl::Status status = got.status();
    if (status.ok()) status = CheckElements(*got, recv_end - recv_begin);
    if (status.ok()) status = got->DecodeAddInto(data.subspan(recv_begin, recv_end - recv_begin));
    RETURN_IF_ERROR(sent.Wait());
    RETURN_IF_ERROR(status);
  }
  return absl::OkStatus();
}

absl::Status GrpcCommunicator::RingAllGather(const Call& call, const std::vector<int>& group, absl::Span<float> data,
                                             const Codec& codec) {
  const int n = static_cast<int>(group.size());
  if (n == 1) return absl::OkStatus();
  const int p = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
  const int next = group[Mod(p + 1, n)];
  const int prev = group[Mod(p - 1, n)];
  // This rank's final chunk: encoded once; with a lossy codec the owner keeps the decoded value too.
  const auto [own_begin, own_end] = ChunkBounds(data.size(), n, p);
  absl::Span<float> own = data.subspan(own_begin, own_end - own_begin);
  Bytes forward;
  std::vector<float>* residual = codec.error_feedback() ? Residual(absl::StrCat(call.prefix, "/ag")) : nullptr;
  RETURN_IF_ERROR(EncodeTensor(codec, own, &forward, residual));
  if (!codec.lossless()) {
    RETURN_IF_ERROR(DecodeTensor(forward.span(), own));
  }
  const std::string codec_name = codec.ToString();
  for (int s = 0; s < n - 1; ++s) {
    const auto [send_begin, send_end] = ChunkBounds(data.size(), n, Mod(p - s, n));
    const auto [recv_begin, recv_end] = ChunkBounds(data.size(), n, Mod(p - s - 1, n));
    const std::string part = absl::StrCat("ag/", s);
    AsyncStatus sent([&, part, elements = static_cast<int64_t>(send_end - send_begin)] {
      return SendEncodedTo(call, part, next, codec, forward, elements);
    });
    absl::StatusOr<ReceivedTensor> got = RecvFrom(call, part, prev);
    absl::Status status = got.status();
    if (status.ok()) status = CheckElements(*got, recv_end - recv_begin);
    if (status.ok() && got->codec != codec_name) {
      status = absl::InvalidArgumentError(absl::StrCat("all-gather chunk uses codec ", got->codec, ", expected ",
                                                       codec_name, "; do all ranks use the same codecs?"));
    }
    if (status.ok()) status = got->DecodeInto(data.subspan(recv_begin, recv_end - recv_begin));
    RETURN_IF_ERROR(sent.Wait());
    RETURN_IF_ERROR(status);
    forward = got->encoded;  // forwarded unchanged at the next step
  }
  return absl::OkStatus();
}

absl::Status GrpcCommunicator::AllReduceSum(absl::Span<float> data, std::string_view tag) {
  if (size() == 2 && data.size() <= kPairMaxElements) return PairAllReduce(data, tag);
  return options_.all_reduce == AllReduceAlgorithm::kHierarchical ? HierarchicalAllReduce(data, tag)
                                                                  : RingAllReduce(data, tag);
}

absl::Status GrpcCommunicator::PairAllReduce(absl::Span<float> data, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("PairAllReduce needs 2 ranks, this group has ", size()));
  }
  return PairExchange(Begin("pair-allreduce", tag), 1 - rank_, "x", data);
}

absl::Status GrpcCommunicator::PairExchange(const Call& call, int peer, const std::string& part,
                                            absl::Span<float> data) {
  const Codec& codec = LinkCodec(rank_, peer);
  // OutgoingTensor decides how the codec is sent (an element-wise one encoded as it streams, the others now: top-k's
  // error feedback sees the tensor once); a lossy codec's own operand is rounded once the send has read it.
  std::vector<float>* residual = codec.error_feedback() ? Residual(absl::StrCat(call.prefix, "/", part)) : nullptr;
  ASSIGN_OR_RETURN(OutgoingTensor outgoing, OutgoingTensor::Prepare(codec, data, residual));
  AsyncStatus sent([&] { return SendOutgoing(call, part, peer, outgoing); });
  absl::StatusOr<ReceivedTensor> got = RecvFrom(call, part, peer);
  absl::Status status = got.status();
  if (status.ok()) status = CheckElements(*got, data.size());
  if (status.ok() && got->codec != codec.ToString()) {
    status = absl::InvalidArgumentError(absl::StrCat("pair all-reduce tensor uses codec ", got->codec, ", expected ",
                                                     codec.ToString(), "; do both ranks use the same codecs?"));
  }
  RETURN_IF_ERROR(sent.Wait());
  RETURN_IF_ERROR(status);
  if (!codec.lossless()) {  // the operand the peer adds: this rank's tensor as the peer decodes it
    ASSIGN_OR_RETURN(Bytes encoded, outgoing.Encoded());
    RETURN_IF_ERROR(DecodeTensor(encoded.span(), data));
  }
  return got->DecodeAddInto(data);
}

absl::Status GrpcCommunicator::RingAllReduce(absl::Span<float> data, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  const Call call = Begin("ring-allreduce", tag);
  std::vector<int> all(peers_.size());
  for (int r = 0; r < size(); ++r) all[r] = r;
  RETURN_IF_ERROR(RingReduceScatter(call, all, data));
  return RingAllGather(call, all, data, GatherCodec(all));
}

absl::Status GrpcCommunicator::HierarchicalAllReduce(absl::Span<float> data, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  const Call call = Begin("hier-allreduce", tag);
  // Sites in order of their lowest rank; the lowest rank of a site leads it.
  std::vector<std::string> sites;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < size(); ++r) {
    auto it = std::find(sites.begin(), sites.end(), peers_[r].site);
    if (it == sites.end()) {
      sites.push_back(peers_[r].site);
      members.push_back({r});
    } else {
      members[it - sites.begin()].push_back(r);
    }
  }
  const size_t my_site = std::find(sites.begin(), sites.end(), peers_[rank_].site) - sites.begin();
  const std::vector<int>& site_ranks = members[my_site];
  const int leader = site_ranks.front();
  if (rank_ != leader) {
    RETURN_IF_ERROR(SendTo(call, "up", leader, data, LinkCodec(rank_, leader), call.prefix + "/up"));
    return RecvFromInto(call, absl::StrCat("down/", rank_), leader, data);
  }
  // Leader: reduce the site (in rank order), all-reduce among leaders, broadcast to the site.
  for (size_t i = 1; i < site_ranks.size(); ++i) {
    ASSIGN_OR_RETURN(ReceivedTensor got, RecvFrom(call, "up", site_ranks[i]));
    RETURN_IF_ERROR(CheckElements(got, data.size()));
    RETURN_IF_ERROR(got.DecodeAddInto(data));
  }
  std::vector<int> leaders;
  for (const auto& m : members) leaders.push_back(m.front());
  if (leaders.size() == 2 && data.size() <= kPairMaxElements) {  // one exchange, as AllReduceSum of two ranks
    RETURN_IF_ERROR(PairExchange(call, leaders[0] == rank_ ? leaders[1] : leaders[0], "leaders", data));
  } else if (leaders.size() > 1) {
    RETURN_IF_ERROR(RingReduceScatter(call, leaders, data));
    RETURN_IF_ERROR(RingAllGather(call, leaders, data, GatherCodec(leaders)));
  }
  if (site_ranks.size() == 1) return absl::OkStatus();
  const Codec& codec = options_.lan_codec;
  Bytes encoded;
  std::vector<float>* residual = codec.error_feedback() ? Residual(call.prefix + "/down") : nullptr;
  RETURN_IF_ERROR(EncodeTensor(codec, data, &encoded, residual));
  if (!codec.lossless()) {
    RETURN_IF_ERROR(DecodeTensor(encoded.span(), data));
  }
  std::vector<std::unique_ptr<AsyncStatus>> sends;
  for (size_t i = 1; i < site_ranks.size(); ++i) {
    const int member = site_ranks[i];
    sends.push_back(std::make_unique<AsyncStatus>([&, member] {
      return SendEncodedTo(call, absl::StrCat("down/", member), member, codec, encoded,
                           static_cast<int64_t>(data.size()));
    }));
  }
  absl::Status first_error;
  for (auto& send : sends) {
    absl::Status s = send->Wait();
    if (first_error.ok()) first_error = s;
  }
  return first_error;
}

absl::Status GrpcCommunicator::ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                             std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (input.size() != output.size() * peers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReduceScatter: input has ", input.size(),
                     " elements, expected size() x output = ", output.size() * peers_.size()));
  }
  const Call call = Begin("reduce-scatter", tag);
  std::vector<float> work(input.begin(), input.end());
  std::vector<int> all(peers_.size());
  for (int r = 0; r < size(); ++r) all[r] = r;
  RETURN_IF_ERROR(RingReduceScatter(call, all, absl::MakeSpan(work)));
  std::memcpy(output.data(), work.data() + rank_ * output.size(), output.size() * sizeof(float));
  return absl::OkStatus();
}

absl::Status GrpcCommunicator::AllGather(absl::Span<const float> input, absl::Span<float> output,
                                         std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (output.size() != input.size() * peers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllGather: output has ", output.size(),
                     " elements, expected size() x input = ", input.size() * peers_.size()));
  }
  const Call call = Begin("all-gather", tag);
  std::copy(input.begin(), input.end(), output.begin() + static_cast<ptrdiff_t>(rank_ * input.size()));
  std::vector<int> all(peers_.size());
  for (int r = 0; r < size(); ++r) all[r] = r;
  return RingAllGather(call, all, output, GatherCodec(all));
}

absl::Status GrpcCommunicator::Broadcast(absl::Span<float> data, int root, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (root < 0 || root >= size()) return absl::InvalidArgumentError(absl::StrCat("Broadcast: bad root ", root));
  const Call call = Begin("broadcast", tag);
  if (rank_ != root) return RecvFromInto(call, absl::StrCat("b/", rank_), root, data);
  std::vector<std::unique_ptr<AsyncStatus>> sends;
  for (int r = 0; r < size(); ++r) {
    if (r == root) continue;
    sends.push_back(std::make_unique<AsyncStatus>([&, r] {
      return SendTo(call, absl::StrCat("b/", r), r, data, LinkCodec(root, r), absl::StrCat(call.prefix, "/b/", r));
    }));
  }
  absl::Status first_error;
  for (auto& send : sends) {
    absl::Status s = send->Wait();
    if (first_error.ok()) first_error = s;
  }
  return first_error;
}

absl::Status GrpcCommunicator::Send(int peer, absl::Span<const float> data, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (peer < 0 || peer >= size() || peer == rank_) return absl::InvalidArgumentError("Send: bad peer");
  const Call call = Begin(absl::StrCat("p2p-", rank_, ">", peer), tag);
  return SendTo(call, "m", peer, data, LinkCodec(rank_, peer), call.prefix);
}

absl::Status GrpcCommunicator::Recv(int peer, absl::Span<float> data, std::string_view tag) {
  RETURN_IF_ERROR(config_status_);
  if (peer < 0 || peer >= size() || peer == rank_) return absl::InvalidArgumentError("Recv: bad peer");
  const Call call = Begin(absl::StrCat("p2p-", peer, ">", rank_), tag);
  return RecvFromInto(call, "m", peer, data);
}

// --- BucketedAllReduce -----------------------------------------------------------------------------------

BucketedAllReduce::BucketedAllReduce(Communicator* communicator, std::string tag_prefix)
    : BucketedAllReduce([communicator](absl::Span<float> data,
                                       std::string_view tag) { return communicator->AllReduceSum(data, tag); },
                        std::move(tag_prefix)) {}

BucketedAllReduce::BucketedAllReduce(AllReduceFn all_reduce, std::string tag_prefix)
    : all_reduce_(std::move(all_reduce)), tag_prefix_(std::move(tag_prefix)), thread_([this] { Loop(); }) {}

BucketedAllReduce::~BucketedAllReduce() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (failed_.ok() && !queue_.empty()) failed_ = absl::CancelledError("the gradient all-reduce was abandoned");
  }
  thread_.join();
}

std::shared_future<absl::Status> BucketedAllReduce::Start(int bucket_id, absl::Span<float> bucket, BucketFence fence) {
  Item item{bucket_id, bucket, std::move(fence), std::promise<absl::Status>()};
  std::shared_future<absl::Status> shared = item.done.get_future().share();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(item));
  pending_.push_back(shared);
  return shared;
}

absl::Status BucketedAllReduce::WaitAll() {
  std::vector<std::shared_future<absl::Status>> pending;
  {
    absl::MutexLock lock(&mu_);
    pending.swap(pending_);
  }
  absl::Status first_error;
  for (auto& f : pending) {
    absl::Status s = f.get();
    if (first_error.ok()) first_error = s;
  }
  absl::MutexLock lock(&mu_);
  failed_ = absl::OkStatus();  // the next buckets start afresh
  return first_error;
}

void BucketedAllReduce::Loop() {
  while (true) {
    Item item;
    absl::Status failed;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BucketedAllReduce* self) { return self->stop_ || !self->queue_.empty(); }, this));
      if (queue_.empty()) return;  // stop_ and nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
      failed = failed_;
    }
    absl::Status status = failed;
    if (status.ok() && item.fence) status = item.fence();
    if (status.ok()) status = all_reduce_(item.data, absl::StrCat(tag_prefix_, "/", item.bucket_id));
    if (!status.ok()) {
      absl::MutexLock lock(&mu_);
      if (failed_.ok()) failed_ = status;
    }
    item.done.set_value(status);
  }
}

// --- GradientBuckets -------------------------------------------------------------------------------------

namespace {

// Buckets in host memory; copies happen at once.
class HostBucketMemory : public BucketMemory {
 public:
  absl::StatusOr<float*> Allocate(int64_t elements) override {
    buffers_.emplace_back(static_cast<size_t>(elements));
    return buffers_.back().data();
  }
  void Copy(float* dst, const float* src, int64_t n) override { std::copy(src, src + n, dst); }
  BucketFence Fence(int) override { return nullptr; }

 private:
  std::deque<std::vector<float>> buffers_;  // stable addresses
};

}  // namespace

GradientBuckets::GradientBuckets(Communicator* communicator, std::vector<std::vector<absl::Span<float>>> groups,
                                 int64_t bucket_bytes, std::string tag_prefix)
    : GradientBuckets([communicator](absl::Span<float> data,
                                     std::string_view tag) { return communicator->AllReduceSum(data, tag); },
                      nullptr, std::move(groups), bucket_bytes, std::move(tag_prefix)) {}

GradientBuckets::GradientBuckets(AllReduceFn all_reduce, BucketMemory* memory,
                                 std::vector<std::vector<absl::Span<float>>> groups, int64_t bucket_bytes,
                                 std::string tag_prefix)
    : own_memory_(memory ? nullptr : std::make_unique<HostBucketMemory>()),
      memory_(memory ? memory : own_memory_.get()),
      groups_(std::move(groups)),
      bucket_of_group_(groups_.size()),
      offset_in_bucket_(groups_.size()),
      ready_(groups_.size(), false),
      all_reduce_(std::move(all_reduce), std::move(tag_prefix)) {
  const int64_t bucket_elements = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  for (size_t g = 0; g < groups_.size(); ++g) {
    int64_t size = 0;
    for (const absl::Span<float>& piece : groups_[g]) size += static_cast<int64_t>(piece.size());
    elements_ += size;
    if (size == 0) {  // nothing to sum (a middle stage's non-layer group): no bucket, no all-reduce
      bucket_of_group_[g] = -1;
      continue;
    }
    if (buckets_.empty() || buckets_.back().elements >= bucket_elements) {
      buckets_.push_back(Bucket{static_cast<int>(g), static_cast<int>(g), 0, nullptr, 0});
    }
    bucket_of_group_[g] = static_cast<int>(buckets_.size()) - 1;
    offset_in_bucket_[g] = buckets_.back().elements;
    buckets_.back().end_group = static_cast<int>(g) + 1;
    buckets_.back().elements += size;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    absl::StatusOr<float*> data = memory_->Allocate(buckets_[b].elements);
    if (!data.ok()) {
      status_ = absl::Status(
          data.status().code(),
          absl::StrCat("cannot allocate gradient bucket ", b, " (", buckets_[b].elements * sizeof(float) / (1 << 20),
                       " MiB): ", data.status().message(),
                       "; the buckets hold a second copy of the stage's gradients: use "
                       "more pipeline stages or more tensor parallelism"));
      return;
    }
    buckets_[b].data = *data;
  }
}

void GradientBuckets::GroupReady(int group) {
  if (!status_.ok()) return;
  if (group < 0 || group >= static_cast<int>(groups_.size()) || ready_[group]) {
    if (misuse_.ok()) {
      misuse_ = absl::InternalError(absl::StrCat("gradient group ", group, " reported twice or unknown"));
    }
    return;
  }
  ready_[group] = true;
  const int b = bucket_of_group_[group];
  if (b < 0) return;  // an empty group
  Bucket& bucket = buckets_[b];
  float* out = bucket.data + offset_in_bucket_[group];
  for (const absl::Span<float>& piece : groups_[group]) {
    memory_->Copy(out, piece.data(), static_cast<int64_t>(piece.size()));
    out += piece.size();
  }
  if (++bucket.groups_ready == bucket.end_group - bucket.first_group) {
    all_reduce_.Start(b, absl::MakeSpan(bucket.data, static_cast<size_t>(bucket.elements)), memory_->Fence(b));
  }
}

absl::Status GradientBuckets::Finish() {
  RETURN_IF_ERROR(status_);
  absl::Status status = all_reduce_.WaitAll();  // always drain, so no bucket is in flight after Finish
  const bool complete = std::all_of(ready_.begin(), ready_.end(), [](bool r) { return r; });
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& bucket : buckets_) bucket.groups_ready = 0;
  RETURN_IF_ERROR(std::exchange(misuse_, absl::OkStatus()));
  RETURN_IF_ERROR(status);
  if (!complete) return absl::FailedPreconditionError("gradient all-reduce finished before every group was ready");
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (bucket_of_group_[g] < 0) continue;
    const float* in = buckets_[bucket_of_group_[g]].data + offset_in_bucket_[g];
    for (const absl::Span<float>& piece : groups_[g]) {
      memory_->Copy(piece.data(), in, static_cast<int64_t>(piece.size()));
      in += piece.size();
    }
  }
  return memory_->Check();
}

}  // namespace geotrain::comm
