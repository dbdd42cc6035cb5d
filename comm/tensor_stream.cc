// Tensor streams over gRPC: the raw-ByteBuffer chunk writer and parser, the server reactor that validates and
// assembles tensors into the mailbox, and the blocking client (see tensor_stream.h for the contract).
//
// The TensorStream method is served and called with grpc::ByteBuffer messages instead of generated protobuf
// types: the writer lays out a TensorChunk by hand (small fields, then the payload as a slice that points into
// the encoded tensor) and the parser walks the received slices, copying the payload straight into the
// tensor's buffer. The bytes on the wire are ordinary protobuf, so the generated stub also works (tests use
// it to send malformed chunks).
#include "comm/tensor_stream.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/sync_stream.h>
#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/tensor_chunks.h"
#include "common/rpc.h"  // FromGrpc, ToGrpc, SetReconnectBackoff
#include "common/status.h"
#include "tensor.grpc.pb.h"
#include "tensor.pb.h"

namespace geotrain::comm {
namespace {

constexpr char kStreamMethod[] = "/geotrain.TensorStream/Stream";

// --- Protobuf wire helpers ----------------------------------------------------------------------------

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

void KeyToProto(const TensorKey& k, geotrain::TensorKey* out) {
  out->set_job_id(k.job_id);
  out->set_step(k.step);
  out->set_microbatch(k.microbatch);
  out->set_tensor_id(k.tensor_id);
  out->set_src(k.src);
}

// gRPC reads the socket into 64 KiB buffers that it frees on another thread once the message is consumed.
// With glibc's default trim threshold (128 KiB) every such free can hand the pages back to the kernel
// (madvise/brk shrink, with TLB shoot-downs), so the next read page-faults fresh zeroed pages: on loopback
// that cost ~10x the transfer itself (docs/results/2026-12-02-comm.md). Keeping up to kRetainFreedBytes of freed heap
// makes the buffers warm again. Setting a threshold turns off glibc's dynamic mmap threshold (which would
// otherwise rise to 32 MiB as large blocks are freed), so the mmap threshold is set to that ceiling too, or
// every allocation above 128 KiB elsewhere in the process would be mmap'ed and faulted in afresh.
// Process-wide; skipped when GLIBC_TUNABLES already sets either threshold.
constexpr int kRetainFreedBytes = 256 << 20;
constexpr int kMmapThresholdBytes = 32 << 20;

void RetainFreedMemory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (tunables != nullptr &&
        (std::strstr(tunables, "trim_threshold") != nullptr || std::strstr(tunables, "mmap_threshold") != nullptr)) {
      return;
    }
    mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
    mallopt(M_TRIM_THRESHOLD, kRetainFreedBytes);
  });
#endif
}

void DestroySharedBytes(void* user_data) { delete static_cast<std::shared_ptr<uint8_t[]>*>(user_data); }

}  // namespace

// --- Server ----------------------------------------------------------------------------------------------

// One TensorStream call: reads chunks and hands each to the stream's TensorChunkAssembler (tensor_chunks.h: the
// parsing, validation and assembly, into a mailbox buffer or decoded straight into a waiting RecvInto's buffer),
// acknowledges each tensor it delivers, then reads the next tensor's chunks, until the client ends the call.
// The reactor is the assembler's sink: it forwards to the server with this stream's peer. Reactions run one at
// a time on gRPC's threads and hold mu_ throughout; Close() comes from TensorStreamServer::Shutdown on another
// thread.
class TensorStreamServer::Reactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                    public TensorSink {
 public:
  Reactor(TensorStreamServer* owner, grpc::CallbackServerContext* context)
      : owner_(owner), assembler_(owner->options_, this) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kTokenMetadataKey);
    const std::string_view presented =
        it == metadata.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
    if (!owner_->Authorized(presented)) {
      owner_->CountRejected();
      Close(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                         absl::StrCat("missing or wrong cluster token in '", kTokenMetadataKey,
                                      "'; use the token the head printed (GEOTRAIN_TOKEN)")));
      return;
    }
    StartRead(&request_);
    // Registered only now: until then nothing else knows of this reactor. Once registered, Shutdown may Close it.
    const absl::Status added = owner_->AddReactor(this);
    registered_ = added.ok();
    if (!registered_) {
      owner_->CountRejected();
      Close(ToGrpc(added));
    }
  }

  ~Reactor() override { assembler_.Abandon(); }

  // Ends the call with `status` unless it has ended already (a pending read then fails).
  void Close(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    FinishOnce(status);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // closed by Shutdown
    if (!ok) {              // the client ended the call or it was cancelled
      if (assembler_.in_progress()) {
        const std::string key = assembler_.current_key().ToString();
        assembler_.Abandon();
        owner_->CountRejected();
        FinishOnce(grpc::Status(grpc::StatusCode::DATA_LOSS, absl::StrCat("stream ended inside tensor ", key)));
      } else {
        FinishOnce(grpc::Status::OK);
      }
      return;
    }
    absl::StatusOr<bool> delivered = HandleChunk();
    request_.Clear();
    if (!delivered.ok()) {
      assembler_.Abandon();  // before the status reaches the sender
      owner_->CountRejected();
      FinishOnce(ToGrpc(delivered.status()));
      return;
    }
    if (*delivered) {
      geotrain::TensorAck ack;
      KeyToProto(assembler_.delivered_key(), ack.mutable_key());
      ack.set_bytes(assembler_.delivered_bytes());
      const std::string serialized = ack.SerializeAsString();
      grpc::Slice slice(serialized);
      ack_ = grpc::ByteBuffer(&slice, 1);
      StartWrite(&ack_);
    } else {
      StartRead(&request_);
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    if (registered_) owner_->RemoveReactor(this);
    delete this;
  }

  // TensorSink: the server's mailbox and RecvInto buffers (called by assembler_, under mu_).
  absl::Status Reserve(const TensorKey& key, uint64_t bytes) override { return owner_->Reserve(key, bytes); }
  void Release(const TensorKey& key, uint64_t bytes) override { owner_->Release(key, bytes); }
  absl::Status Deliver(ReceivedTensor tensor) override {
    const TensorKey key = tensor.key;
    const uint64_t bytes = tensor.encoded.size();
    absl::Status delivered = owner_->Deliver(std::move(tensor));
    if (!delivered.ok()) owner_->Release(key, bytes);
    return delivered;
  }
  std::shared_ptr<TensorDestination> Claim(const TensorKey& key, uint64_t elements) override {
    return owner_->Claim(key, elements);
  }
  absl::Status BeginWrite(TensorDestination* d, const TensorKey& key) override { return owner_->BeginWrite(d, key); }
  void EndWrite(TensorDestination* d) override { owner_->EndWrite(d); }
  absl::Status CompleteClaim(TensorDestination* d, const TensorKey& key, uint64_t bytes) override {
    return owner_->CompleteClaim(d, key, bytes);
  }
  void Unclaim(TensorDestination* d) override { owner_->Unclaim(d); }

 private:
  void FinishOnce(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  absl::StatusOr<bool> HandleChunk() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    slices_.clear();
    if (!request_.Dump(&slices_).ok()) return absl::InvalidArgumentError("chunk: unreadable message");
    pieces_.clear();
    for (const grpc::Slice& slice : slices_) pieces_.emplace_back(slice.begin(), slice.size());
    return assembler_.AddChunk(pieces_);
  }

  TensorStreamServer* const owner_;
  bool registered_ = false;  // in owner_'s reactor set (set in the constructor, read in OnDone)
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer ack_;
  std::vector<grpc::Slice> slices_;                // the message being handled, as gRPC's slices
  std::vector<absl::Span<const uint8_t>> pieces_;  // the same, as the assembler takes them
  TensorChunkAssembler assembler_;
};

class TensorStreamServer::Service
    : public geotrain::TensorStream::WithRawCallbackMethod_Stream<geotrain::TensorStream::Service> {
 public:
  explicit Service(TensorStreamServer* owner) : owner_(owner) {}
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(grpc::CallbackServerContext* context) override {
    return new Reactor(owner_, context);
  }

 private:
  TensorStreamServer* owner_;
};

TensorStreamServer::TensorStreamServer(std::string token, TensorStreamOptions options)
    : token_(std::move(token)), options_(options), service_(std::make_unique<Service>(this)) {
  RetainFreedMemory();
  janitor_ = std::thread([this] { DropOrphansLoop(); });
}

TensorStreamServer::~TensorStreamServer() {
  Shutdown();
  janitor_.join();
}

void TensorStreamServer::DropOrphansLoop() {
  const absl::Duration period = std::clamp(options_.orphan_timeout / 4, absl::Milliseconds(10), absl::Seconds(30));
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&shutdown_), period)) {
    const absl::Time now = absl::Now();
    for (auto it = mailbox_.begin(); it != mailbox_.end();) {
      auto next = std::next(it);
      if (now - it->second.arrived >= options_.orphan_timeout) {
        ++stats_.orphans_dropped;
        TakeLocked(it);
      }
      it = next;
    }
  }
}

ReceivedTensor TensorStreamServer::TakeLocked(absl::flat_hash_map<TensorKey, Waiting>::iterator it) {
  ReceivedTensor tensor = std::move(it->second.tensor);
  mailbox_.erase(it);
  ReleaseLocked(tensor.key, tensor.encoded.size());
  return tensor;
}

namespace {
template <typename Args>
void ApplyTransportOptions(const TensorStreamOptions& o, Args* args) {
  if (o.http2_window_bytes > 0) {
    args->SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.http2_window_bytes);
    // BDP probing would shrink the window back to its (tiny, on a fast link) estimate.
    args->SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  if (o.http2_max_frame_bytes > 0) args->SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, o.http2_max_frame_bytes);
  if (o.tcp_read_chunk_bytes > 0) {
    args->SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
    args->SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
  }
}
// ServerBuilder has AddChannelArgument rather than SetInt.
struct BuilderArgs {
  grpc::ServerBuilder* builder;
  void SetInt(const char* key, int value) { builder->AddChannelArgument(key, value); }
};
}  // namespace

namespace {
constexpr absl::string_view kStoppedOnReceiver = " was stopped on the receiver; its tensors are no longer taken";
}  // namespace

absl::Status JobStoppedOnReceiverError(const std::string& job_id) {
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, kStoppedOnReceiver));
}

bool IsJobStoppedOnReceiver(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StrContains(status.message(), kStoppedOnReceiver);
}

void TensorStreamServer::Register(grpc::ServerBuilder* builder) {
  BuilderArgs args{builder};
  ApplyTransportOptions(options_, &args);
  args.SetInt(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_streams);
  builder->RegisterService(service_.get());
}

bool TensorStreamServer::Authorized(std::string_view presented) const { return TokenMatches(presented, token_); }

absl::Status TensorStreamServer::Reserve(const TensorKey& key, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  const uint64_t job = job_bytes_.contains(key.job_id) ? job_bytes_[key.job_id] : 0;
  const uint64_t peer = peer_bytes_.contains(key.src) ? peer_bytes_[key.src] : 0;
  const struct {
    uint64_t held, limit;
    const char* name;
    std::string whose;
  } budgets[] = {{reserved_bytes_, options_.max_mailbox_bytes, "max_mailbox_bytes", "all jobs"},
                 {job, options_.max_job_bytes, "max_job_bytes", absl::StrCat("job ", key.job_id)},
                 {peer, options_.max_peer_bytes, "max_peer_bytes", absl::StrCat("sender ", key.src)}};
  for (const auto& b : budgets) {
    if (bytes > b.limit || b.held > b.limit - bytes) {
      ++stats_.over_budget;
      return absl::ResourceExhaustedError(absl::StrCat(
          "receiver mailbox over budget: ", b.whose, " holds ", b.held, " bytes, tensor ", key.ToString(), " of ",
          bytes, " more would pass ", b.name, "=", b.limit, "; the receiver is not calling Recv for them"));
    }
  }
  reserved_bytes_ += bytes;
  job_bytes_[key.job_id] += bytes;
  peer_bytes_[key.src] += bytes;
  return absl::OkStatus();
}

void TensorStreamServer::Release(const TensorKey& key, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  ReleaseLocked(key, bytes);
}

void TensorStreamServer::ReleaseLocked(const TensorKey& key, uint64_t bytes) {
  reserved_bytes_ -= std::min(bytes, reserved_bytes_);
  for (auto [held, name] : {std::pair{&job_bytes_, &key.job_id}, std::pair{&peer_bytes_, &key.src}}) {
    auto h = held->find(*name);
    if (h == held->end()) continue;
    h->second -= std::min(bytes, h->second);
    if (h->second == 0) held->erase(h);
  }
}

absl::Status TensorStreamServer::Deliver(ReceivedTensor tensor) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (auto cancelled = cancelled_jobs_.find(tensor.key.job_id); cancelled != cancelled_jobs_.end()) {
    if (!cancelled->second) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", tensor.key.job_id, " failed on the receiver; its tensors are no longer taken"));
    }
    return JobStoppedOnReceiverError(tensor.key.job_id);
  }
  const uint64_t bytes = tensor.encoded.size();
  const TensorKey key = tensor.key;
  auto [it, inserted] = mailbox_.try_emplace(key, Waiting{std::move(tensor), absl::Now()});
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("tensor ", it->first.ToString(), " is already waiting in the receiver's mailbox"));
  }
  ++stats_.tensors_received;
  stats_.bytes_received += bytes;
  return absl::OkStatus();
}

void TensorStreamServer::CountRejected() {
  absl::MutexLock lock(&mu_);
  ++stats_.streams_rejected;
}

absl::StatusOr<ReceivedTensor> TensorStreamServer::Recv(const TensorKey& key, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() { return shutdown_ || mailbox_.contains(key) || cancelled_jobs_.contains(key.job_id); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("no tensor ", key.ToString(), " arrived before the deadline"));
  }
  if (cancelled_jobs_.contains(key.job_id)) {
    return absl::CancelledError(absl::StrCat("receives of job ", key.job_id, " were cancelled (the job is stopping)"));
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) return absl::CancelledError("tensor stream endpoint shut down");
  return TakeLocked(it);
}

void TensorStreamServer::CancelJob(const std::string& job_id, bool stopped) {
  absl::MutexLock lock(&mu_);
  if (!cancelled_jobs_.emplace(job_id, stopped).second) return;
  cancelled_order_.push_back(job_id);
  if (cancelled_order_.size() > kMaxCancelledJobs) {
    cancelled_jobs_.erase(cancelled_order_.front());
    cancelled_order_.pop_front();
  }
}

bool TensorStreamServer::JobCancelled(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return cancelled_jobs_.contains(job_id);
}

size_t TensorStreamServer::DiscardJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  size_t dropped = 0;
  for (auto it = mailbox_.begin(); it != mailbox_.end();) {
    auto next = std::next(it);
    if (it->first.job_id == job_id) {
      TakeLocked(it);
      ++dropped;
    }
    it = next;
  }
  return dropped;
}

absl::Status TensorStreamServer::RecvInto(const TensorKey& key, absl::Span<float> out, absl::Time deadline) {
  auto destination = std::make_shared<TensorDestination>();
  destination->out = out;
  TensorDestination* const d = destination.get();
  ReceivedTensor tensor;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::CancelledError("tensor stream endpoint shut down");
    if (!destinations_.try_emplace(key, destination).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("another RecvInto is already waiting for tensor ", key.ToString()));
    }
    // A cancelled job ends the wait at once, also while its tensor is being decoded into `out` (as Recv).
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || d->done || (!d->claimed && mailbox_.contains(key)) || cancelled_jobs_.contains(key.job_id);
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
    const bool in_mailbox = !d->done && !d->claimed && mailbox_.contains(key);
    if (!d->done && (!in_mailbox || cancelled_jobs_.contains(key.job_id))) {
      // Giving up: a reactor writing into `out` finishes its block first, and writes nothing after.
      d->withdrawn = true;
      auto idle = [d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !d->writing; };
      mu_.Await(absl::Condition(&idle));
      destinations_.erase(key);
      if (shutdown_) return absl::CancelledError("tensor stream endpoint shut down");
      if (cancelled_jobs_.contains(key.job_id)) {
        return absl::CancelledError(
            absl::StrCat("receives of job ", key.job_id, " were cancelled (the job is stopping)"));
      }
      return absl::DeadlineExceededError(absl::StrCat("no tensor ", key.ToString(), " arrived before the deadline"));
    }
    destinations_.erase(key);
    if (d->done) return absl::OkStatus();
    tensor = TakeLocked(mailbox_.find(key));
  }
  if (tensor.num_elements() != static_cast<int64_t>(out.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", key.ToString(), " has ", tensor.num_elements(),
                                                   " elements, the receive buffer ", out.size()));
  }
  return tensor.DecodeInto(out);
}

std::shared_ptr<TensorDestination> TensorStreamServer::Claim(const TensorKey& key, uint64_t elements) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return nullptr;
  auto it = destinations_.find(key);
  if (it == destinations_.end()) return nullptr;
  TensorDestination* d = it->second.get();
  if (d->claimed || d->withdrawn || d->done || d->out.size() != elements || cancelled_jobs_.contains(key.job_id)) {
    return nullptr;
  }
  d->claimed = true;
  return it->second;
}

absl::Status TensorStreamServer::BeginWrite(TensorDestination* destination, const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (destination->withdrawn) {
    return absl::DeadlineExceededError(
        absl::StrCat("the receiver stopped waiting for tensor ", key.ToString(), " (its deadline passed)"));
  }
  destination->writing = true;
  return absl::OkStatus();
}

void TensorStreamServer::EndWrite(TensorDestination* destination) {
  absl::MutexLock lock(&mu_);
  destination->writing = false;
}

absl::Status TensorStreamServer::CompleteClaim(TensorDestination* destination, const TensorKey& key,
                                               uint64_t delivered_bytes) {
  absl::MutexLock lock(&mu_);
  destination->claimed = false;
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (destination->withdrawn) {
    return absl::DeadlineExceededError(
        absl::StrCat("the receiver stopped waiting for tensor ", key.ToString(), " (its deadline passed)"));
  }
  destination->done = true;
  ++stats_.tensors_received;
  ++stats_.tensors_decoded_on_arrival;
  stats_.bytes_received += delivered_bytes;
  return absl::OkStatus();
}

void TensorStreamServer::Unclaim(TensorDestination* destination) {
  absl::MutexLock lock(&mu_);
  destination->claimed = false;
  destination->writing = false;
}

absl::Status TensorStreamServer::AddReactor(Reactor* reactor) {
  absl::MutexLock lock(&reactors_mu_);
  absl::MutexLock state_lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (reactors_.size() >= static_cast<size_t>(options_.max_streams)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("receiver has ", reactors_.size(), " tensor streams open, its limit (max_streams); retry later"));
  }
  reactors_.insert(reactor);
  stats_.streams_open = reactors_.size();
  return absl::OkStatus();
}

void TensorStreamServer::RemoveReactor(Reactor* reactor) {
  absl::MutexLock lock(&reactors_mu_);
  reactors_.erase(reactor);
  absl::MutexLock state_lock(&mu_);
  stats_.streams_open = reactors_.size();
}

void TensorStreamServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  // Clients keep streams open between tensors; end them, or the grpc::Server's Shutdown would wait for them.
  // A reactor stays registered (alive) until its OnDone, which waits for reactors_mu_.
  absl::MutexLock lock(&reactors_mu_);
  for (Reactor* reactor : reactors_) {
    reactor->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "tensor stream endpoint is shutting down"));
  }
}

TensorStreamServer::Stats TensorStreamServer::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.mailbox_tensors = mailbox_.size();
  s.mailbox_bytes = reserved_bytes_;
  s.receivers_waiting = destinations_.size();
  return s;
}

// --- Client ----------------------------------------------------------------------------------------------

// One TensorStream call to a peer, kept open across Sends and used by one Send at a time. It has a completion queue
// of its own (gRPC's asynchronous API), so that a Send can encode the next chunk while the previous one is being
// written, have the last chunk's write and the ack's read outstanding together, and wait with its own deadline.
class TensorStreamClient::Stream {
 public:
  enum class Wait { kOk, kFailed, kTimedOut };

  explicit Stream(std::shared_ptr<grpc::Channel> channel) : channel_(std::move(channel)) {}
  ~Stream() { Close(); }

  // Starts the call. The metadata (the token) goes out with the first write, so this never blocks.
  void Open(const std::string& token) {
    context_.AddMetadata(kTokenMetadataKey, token);
    context_.set_initial_metadata_corked(true);
    grpc::internal::RpcMethod method(kStreamMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel_);
    // Allocated in the call's arena: freed with the call, not deleted here.
    call_ = grpc::internal::ClientAsyncReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        channel_.get(), &queue_, method, &context_, /*start=*/true, /*tag=*/nullptr);
  }
  bool opened() const { return call_ != nullptr; }

  // At most one write and one read outstanding. gRPC references `message`'s slices until the write completes.
  void StartWrite(grpc::ByteBuffer message) {
    outgoing_ = std::move(message);
    write_pending_ = true;
    call_->Write(outgoing_, &write_pending_);
  }
  void StartRead(grpc::ByteBuffer* message) {
    read_pending_ = true;
    call_->Read(message, &read_pending_);
  }
  bool write_pending() const { return write_pending_; }
  bool write_ok() const { return write_ok_; }

  // Waits until the outstanding write (if `write`) and read (if `read`) have completed, or `deadline`. kFailed: one
  // of them failed, which means the call is over (Finish says why).
  Wait Await(bool write, bool read, absl::Time deadline) {
    while ((write && write_pending_) || (read && read_pending_)) {
      if (!Next(deadline)) return Wait::kTimedOut;
    }
    return (write && !write_ok_) || (read && !read_ok_) ? Wait::kFailed : Wait::kOk;
  }

  // Ends the call (cancelling it first if `cancel`) and returns its status.
  grpc::Status Finish(bool cancel) {
    if (cancel) context_.TryCancel();
    while (write_pending_ || read_pending_) Next(absl::InfiniteFuture());
    grpc::Status status;
    bool finish_pending = true;
    call_->Finish(&status, &finish_pending);
    while (finish_pending) Next(absl::InfiniteFuture());
    finished_ = true;
    return status;
  }

  bool used = false;  // has carried a tensor

 private:
  // Takes one completion off the queue; false at `deadline`. The tags are the operations' "pending" flags,
  // cleared here.
  bool Next(absl::Time deadline) {
    void* tag = nullptr;
    bool ok = false;
    const auto result = queue_.AsyncNext(&tag, &ok, absl::ToChronoTime(deadline));
    if (result != grpc::CompletionQueue::GOT_EVENT) return false;
    *static_cast<bool*>(tag) = false;
    if (tag == &write_pending_) {
      write_ok_ = ok;
      outgoing_.Clear();  // drops this message's references to the tensor's buffer
    }
    if (tag == &read_pending_) read_ok_ = ok;
    return true;
  }
  // Ends the call without waiting for the peer, then drains the queue.
  void Close() {
    if (call_ != nullptr && !finished_) Finish(/*cancel=*/true);
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::CompletionQueue queue_;
  grpc::ClientContext context_;  // destroyed (releasing the call) before queue_
  grpc::ClientAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* call_ = nullptr;
  grpc::ByteBuffer outgoing_;
  bool write_pending_ = false, read_pending_ = false;
  bool write_ok_ = false, read_ok_ = false;
  bool finished_ = false;
};

TensorStreamClient::TensorStreamClient(std::string token, TensorStreamOptions options)
    : token_(std::move(token)), options_(options) {
  RetainFreedMemory();
}

TensorStreamClient::~TensorStreamClient() {
  std::vector<std::unique_ptr<Stream>> idle;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [address, peer] : peers_) {
      for (auto& stream : peer.idle) idle.push_back(std::move(stream));
    }
  }
  idle.clear();  // each cancels its call
}

std::unique_ptr<TensorStreamClient::Stream> TensorStreamClient::TakeStream(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Peer& peer = peers_[address];
  if (!peer.idle.empty()) {
    std::unique_ptr<Stream> stream = std::move(peer.idle.back());
    peer.idle.pop_back();
    return stream;
  }
  if (peer.channel == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 10);  // acks only
    args.SetMaxSendMessageSize(-1);
    // A separate connection per client object (not shared through gRPC's global subchannel pool), so that
    // benchmarks and tests with several endpoints in one process behave like separate processes.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // After a link outage the connection comes back within a second of the link: senders retry until their
    // deadline (comm/communicator.h).
    SetReconnectBackoff(&args, /*initial_backoff_ms=*/200, /*max_backoff_ms=*/1000);
    ApplyTransportOptions(options_, &args);
    peer.channel = grpc::CreateCustomChannel(
        address, options_.channel_credentials ? options_.channel_credentials : grpc::InsecureChannelCredentials(),
        args);
  }
  ++stats_.streams_opened;
  return std::make_unique<Stream>(peer.channel);
}

void TensorStreamClient::ReturnStream(const std::string& address, std::unique_ptr<Stream> stream) {
  absl::MutexLock lock(&mu_);
  std::vector<std::unique_ptr<Stream>>& idle = peers_[address].idle;
  if (idle.size() < kMaxIdleStreamsPerPeer) {
    idle.push_back(std::move(stream));
    return;
  }
  // Full: `stream` cancels its call as it goes out of scope.
}

// Encodes an element-wise codec a chunk at a time into the tensor's buffer, just before the chunk is written,
// so the encode of one chunk overlaps the receiver's work on the previous one (and the bytes are still in cache
// when gRPC copies them into the socket). The codec header's two CRCs are not known until the end: the buffer
// holds zeros in their place (never changed afterwards, since gRPC may still reference it) and Trailer()
// returns them for the last chunk.
class TensorStreamClient::ChunkEncoder {
 public:
  ChunkEncoder(const Codec& codec, absl::Span<const float> data, Bytes* buffer)
      : codec_(codec), data_(data), element_bytes_(EncodedElementBytes(codec)), buffer_(buffer) {
    WriteCodecHeader(codec, data.size(), 0, buffer->data());
    std::memset(buffer->data() + kCodecHeaderBytes - 8, 0, 8);
  }
  // Makes bytes [0, end) of the buffer ready.
  void EncodeThrough(uint64_t end) {
    if (end <= kCodecHeaderBytes) return;
    const uint64_t target =
        std::min<uint64_t>(data_.size(), (end - kCodecHeaderBytes + element_bytes_ - 1) / element_bytes_);
    // A cache-sized block at a time, so that the CRC reads what the encode has just written.
    while (done_ < target) {
      const uint64_t n = std::min<uint64_t>(target - done_, kStreamCacheBlockBytes / element_bytes_);
      uint8_t* out = buffer_->data() + kCodecHeaderBytes + done_ * element_bytes_;
      EncodeElements(codec_, data_.subspan(done_, n), out);
      crc_ = Crc32c(out, n * element_bytes_, crc_);
      done_ += n;
    }
  }
  // Bytes 32..39 of the finished codec header: the payload CRC, then the header CRC (little endian).
  uint64_t Trailer() const {
    uint8_t header[kCodecHeaderBytes];
    WriteCodecHeader(codec_, data_.size(), crc_, header);
    uint64_t trailer;
    std::memcpy(&trailer, header + kCodecHeaderBytes - 8, 8);
    return trailer;
  }

 private:
  const Codec codec_;
  const absl::Span<const float> data_;
  const size_t element_bytes_;
  Bytes* buffer_;
  uint64_t done_ = 0;  // elements encoded
  uint32_t crc_ = 0;
};

absl::Status TensorStreamClient::Send(const std::string& peer_address, const TensorKey& key,
                                      absl::Span<const int64_t> shape, absl::Span<const float> data, const Codec& codec,
                                      absl::Time deadline, std::vector<float>* residual) {
  const size_t element_bytes = EncodedElementBytes(codec);
  if (element_bytes == 0) {  // int8, top-k, zstd: the whole tensor is encoded before the first chunk
    Bytes encoded;
    RETURN_IF_ERROR(EncodeTensor(codec, data, &encoded, residual));
    return SendEncoded(peer_address, key, shape, codec, encoded, deadline);
  }
  ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, options_.max_rank));
  if (elements != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sending tensor ", key.ToString(), ": shape has ", elements, " elements, the data ", data.size()));
  }
  Bytes buffer(kCodecHeaderBytes + data.size() * element_bytes);
  ChunkEncoder encoder(codec, data, &buffer);
  return SendChunks(peer_address, key, shape, codec, buffer, /*checksum=*/0, &encoder, deadline);
}

absl::Status TensorStreamClient::SendEncoded(const std::string& peer_address, const TensorKey& key,
                                             absl::Span<const int64_t> shape, const Codec& codec, const Bytes& encoded,
                                             absl::Time deadline) {
  ASSIGN_OR_RETURN(EncodedInfo info, InspectEncoded(encoded.span(), /*verify_checksum=*/false));
  ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, options_.max_rank));
  if (elements != info.element_count || info.codec.kind != codec.kind || info.codec.zstd != codec.zstd) {
    return absl::InvalidArgumentError(absl::StrCat("sending tensor ", key.ToString(), " to ", peer_address,
                                                   ": encoded tensor does not match shape or codec"));
  }
  return SendChunks(peer_address, key, shape, codec, encoded, info.payload_crc, /*encoder=*/nullptr, deadline);
}

absl::Status TensorStreamClient::SendChunks(const std::string& peer_address, const TensorKey& key,
                                            absl::Span<const int64_t> shape, const Codec& codec, const Bytes& encoded,
                                            uint32_t checksum, ChunkEncoder* encoder, absl::Time deadline) {
  const std::string context_text = absl::StrCat("sending tensor ", key.ToString(), " to ", peer_address);
  if (options_.chunk_bytes < 1024 || options_.chunk_bytes > options_.max_chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options_.chunk_bytes, " outside [1024, ", options_.max_chunk_bytes, "]"));
  }
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(absl::StrCat(context_text, ": the deadline passed before the send began"));
  }
  // Chunks of equal size, at most options_.chunk_bytes (so a 1 MiB tensor and its 40-byte codec header go as two
  // halves rather than 1 MiB and 40 bytes).
  const uint64_t total = encoded.size();
  const uint64_t pieces = std::max<uint64_t>(1, (total + options_.chunk_bytes - 1) / options_.chunk_bytes);
  const uint64_t chunk_bytes = (total + pieces - 1) / pieces;
  TensorHeader header;
  KeyToProto(key, header.mutable_key());
  header.set_dtype(TENSOR_DTYPE_F32);
  for (int64_t d : shape) header.add_shape(d);
  header.set_codec(codec.ToString());
  header.set_total_bytes(total);
  header.set_checksum(checksum);  // 0 when encoding while sending: the CRCs come with the last chunk
  header.set_chunk_bytes(chunk_bytes);
  const std::string header_bytes = header.SerializeAsString();

  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<Stream> stream = TakeStream(peer_address);
    const bool reused = stream->used;
    if (!stream->opened()) stream->Open(token_);
    const absl::Time started = absl::Now();
    const Outcome outcome = WriteTensor(stream.get(), key, header_bytes, chunk_bytes, encoded, encoder, deadline);
    if (outcome == Outcome::kAcknowledged) {
      {
        absl::MutexLock lock(&mu_);
        ++stats_.tensors_sent;
        stats_.bytes_sent += total;
      }
      if (options_.on_acknowledged) options_.on_acknowledged(peer_address, total, absl::Now() - started);
      stream->used = true;
      ReturnStream(peer_address, std::move(stream));
      return absl::OkStatus();
    }
    if (outcome == Outcome::kTimedOut) {
      (void)stream->Finish(/*cancel=*/true);
      return absl::DeadlineExceededError(absl::StrCat(context_text, ": no acknowledgement before the deadline"));
    }
    if (outcome == Outcome::kBadAck) {
      (void)stream->Finish(/*cancel=*/true);
      return absl::InternalError(absl::StrCat(context_text, ": the receiver acknowledged another tensor"));
    }
    // The call is over (a write or the read failed); its status says why.
    const grpc::Status status = stream->Finish(/*cancel=*/false);
    // A pooled stream the receiver had closed (it restarted, or shut down a stream idle since the last Send):
    // nothing of this tensor was delivered (its first chunk could not be written, or the call ended cleanly
    // without an ack), so send it again on a new stream. The other idle streams to this peer are likely closed too.
    if (reused && (outcome == Outcome::kNotStarted || status.ok()) && attempt < 3) {
      absl::MutexLock lock(&mu_);
      peers_[peer_address].idle.clear();
      continue;
    }
    if (!status.ok()) return FromGrpc(status, context_text);
    return absl::UnavailableError(absl::StrCat(context_text, ": the receiver closed without acknowledging"));
  }
}

TensorStreamClient::Outcome TensorStreamClient::WriteTensor(Stream* stream, const TensorKey& key,
                                                            const std::string& header_bytes, uint64_t chunk_bytes,
                                                            const Bytes& encoded, ChunkEncoder* encoder,
                                                            absl::Time deadline) {
  const uint64_t total = encoded.size();
  uint64_t in_flight = 0;         // payload bytes of the write outstanding
  uint64_t in_flight_offset = 0;  // and their offset (a failed first chunk: nothing of the tensor was sent)
  grpc::ByteBuffer ack_buffer;
  // The write of chunk k is outstanding while chunk k + 1 is encoded: one write outstanding at a time (flow
  // control holds it when the receiver does not read), and one chunk encoded ahead.
  auto finish_write = [&]() -> std::optional<Outcome> {
    switch (stream->Await(/*write=*/true, /*read=*/false, deadline)) {
      case Stream::Wait::kTimedOut:
        return Outcome::kTimedOut;
      case Stream::Wait::kFailed:
        return in_flight_offset == 0 ? Outcome::kNotStarted : Outcome::kFailed;
      case Stream::Wait::kOk:
        break;
    }
    absl::MutexLock lock(&mu_);
    stats_.bytes_written += in_flight;
    return std::nullopt;
  };
  for (uint64_t offset = 0; offset < total;) {
    const uint64_t len = std::min<uint64_t>(chunk_bytes, total - offset);
    const bool last = offset + len == total;
    if (encoder != nullptr) encoder->EncodeThrough(offset + len);
    std::string prefix;
    prefix.reserve(header_bytes.size() + 48);
    if (offset == 0) {
      prefix.push_back(0x0A);  // field 1, length-delimited
      PutVarint(&prefix, header_bytes.size());
      prefix.append(header_bytes);
    }
    prefix.push_back(0x10);  // field 2, varint
    PutVarint(&prefix, offset);
    if (last) {
      prefix.push_back(0x18);  // field 3, varint
      prefix.push_back(1);
      if (encoder != nullptr) {
        prefix.push_back(0x29);  // field 5, fixed64
        const uint64_t trailer = encoder->Trailer();
        prefix.append(reinterpret_cast<const char*>(&trailer), 8);
      }
    }
    prefix.push_back(0x22);  // field 4, length-delimited
    PutVarint(&prefix, len);
    grpc::Slice slices[2] = {grpc::Slice(prefix),
                             grpc::Slice(const_cast<uint8_t*>(encoded.data()) + offset, len, &DestroySharedBytes,
                                         new std::shared_ptr<uint8_t[]>(encoded.shared()))};
    if (stream->write_pending()) {
      if (std::optional<Outcome> failed = finish_write(); failed.has_value()) return *failed;
    }
    stream->StartWrite(grpc::ByteBuffer(slices, 2));
    in_flight = len;
    in_flight_offset = offset;
    if (last) stream->StartRead(&ack_buffer);  // the ack may come before the last write completes
    offset += len;
  }
  switch (stream->Await(/*write=*/true, /*read=*/true, deadline)) {
    case Stream::Wait::kTimedOut:
      return Outcome::kTimedOut;
    case Stream::Wait::kFailed:
      return in_flight_offset == 0 && !stream->write_ok() ? Outcome::kNotStarted : Outcome::kFailed;
    case Stream::Wait::kOk:
      break;
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_written += in_flight;
  }
  std::vector<grpc::Slice> ack_slices;
  std::string ack_bytes;
  if (ack_buffer.Dump(&ack_slices).ok()) {
    for (const grpc::Slice& s : ack_slices) ack_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  geotrain::TensorAck ack;
  if (!ack.ParseFromString(ack_bytes) || KeyFromProto(ack.key()) != key || ack.bytes() != total) {
    return Outcome::kBadAck;
  }
  return Outcome::kAcknowledged;
}

TensorStreamClient::Stats TensorStreamClient::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace geotrain::comm
