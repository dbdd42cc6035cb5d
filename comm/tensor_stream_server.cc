// The receiving end of tensor streams over gRPC: the server reactor that checks a stream's token and feeds its
// chunks to the assembler (tensor_chunks.h), and the mailbox with its budgets, RecvInto buffers and job
// cancellation (see tensor_stream_server.h for the contract).
//
// The TensorStream method is served with grpc::ByteBuffer messages instead of generated protobuf types, so that
// the assembler walks gRPC's received slices and copies (or decodes) the payload straight into the tensor's
// buffer. The bytes on the wire are ordinary protobuf (tests send malformed chunks through the generated stub).
#include "comm/tensor_stream_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/tensor_chunks.h"
#include "comm/tensor_stream_transport.h"
#include "common/rpc.h"  // ToGrpc
#include "common/token.h"
#include "tensor.grpc.pb.h"
#include "tensor.pb.h"

namespace geotrain::comm {

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
constexpr absl::string_view kStoppedOnReceiver = " was stopped on the receiver; its tensors are no longer taken";
constexpr absl::string_view kFailedOnReceiver = " failed on the receiver; its tensors are no longer taken";
}  // namespace

absl::Status JobFailedOnReceiverError(const std::string& job_id) {
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, kFailedOnReceiver));
}

bool IsJobFailedOnReceiver(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StrContains(status.message(), kFailedOnReceiver);
}

absl::Status JobStoppedOnReceiverError(const std::string& job_id) {
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, kStoppedOnReceiver));
}

bool IsJobStoppedOnReceiver(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StrContains(status.message(), kStoppedOnReceiver);
}

void TensorStreamServer::Register(grpc::ServerBuilder* builder) {
  ApplyTransportOptions(options_, builder);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_streams);
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
    if (!cancelled->second) return JobFailedOnReceiverError(tensor.key.job_id);
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

}  // namespace geotrain::comm
