// NCCL communicator and the NCCL + WAN hierarchical all-reduce (see nccl_communicator.h).
#include "comm/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/rendezvous.h"
#include "common/status.h"

namespace geotrain::comm {
namespace {

std::string CudaError(cudaError_t e) { return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e)); }

// The NCCL error string, plus NCCL's last error message when there is one (it says which peer or
// transport failed).
std::string NcclError(ncclResult_t r, ncclComm_t comm) {
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') absl::StrAppend(&text, " (", last, ")");
  return text;
}

// Makes `device` current for the scope and restores the caller's device afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_;
};

// Polls without burning a core for long waits: yields for the first millisecond (small collectives finish
// in microseconds), then sleeps 50 us between polls.
class Poller {
 public:
  void Pause() {
    if (absl::Now() - start_ < absl::Milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  const absl::Time start_ = absl::Now();
};

// Waits until `comm`'s asynchronous state leaves ncclInProgress (a non-blocking init, enqueue or group
// end), by `deadline`.
absl::Status AwaitNccl(ncclComm_t comm, absl::Time deadline, const std::string& what) {
  Poller poller;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return absl::InternalError(absl::StrCat(what, ": ", NcclError(r, comm)));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return absl::InternalError(absl::StrCat(what, ": ", NcclError(state, comm)));
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(what);
    poller.Pause();
  }
}

// An enqueueing NCCL call's result: ncclInProgress is fine (AwaitNccl follows).
absl::Status Enqueued(ncclResult_t r, ncclComm_t comm) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::InternalError(NcclError(r, comm));
}

absl::Status Enqueued(cudaError_t e) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(CudaError(e));
}

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r),
                                            " (does this machine have a network interface NCCL can use? "
                                            "see NCCL_SOCKET_IFNAME)"));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(int rank, int size,
                                                                           const std::string& unique_id, int device,
                                                                           absl::Duration timeout,
                                                                           absl::Time join_deadline) {
  const absl::Time deadline = std::min(absl::Now() + timeout, join_deadline);
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: rank ", rank, " is not in [0, ", size, ")"));
  }
  if (unique_id.size() != sizeof(ncclUniqueId::internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: a unique id has ", sizeof(ncclUniqueId::internal), " bytes, not ", unique_id.size()));
  }
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: cannot use CUDA device ", device, ": ", CudaError(scope.status())));
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("nccl: cudaStreamCreate on device ", device, ": ", CudaError(e)));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every step is polled against our deadline, and can be aborted
  ncclComm_t comm = nullptr;
  const std::string what = absl::StrCat("nccl: rank ", rank, " of ", size, " on device ", device);
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  absl::Status joined =
      comm == nullptr ? absl::InternalError(absl::StrCat(what, ": ncclCommInitRankConfig: ", ncclGetErrorString(r)))
                      : Enqueued(r, comm);
  if (joined.ok()) joined = AwaitNccl(comm, deadline, what);
  if (!joined.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    if (absl::IsDeadlineExceeded(joined)) {
      return absl::DeadlineExceededError(absl::StrCat(what, " could not join the communicator by its deadline",
                                                      " (did every rank start, with the same unique id?)"));
    }
    return absl::InternalError(absl::StrCat("nccl: joining the communicator: ", joined.message()));
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(rank, size, device, timeout, comm, stream));
}

NcclCommunicator::NcclCommunicator(int rank, int size, int device, absl::Duration timeout, ncclComm_t comm,
                                   cudaStream_t stream)
    : rank_(rank), size_(size), device_(device), timeout_(timeout), stream_(stream), comm_(comm) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock lock(&mu_);
  DeviceScope scope(device_);
  if (comm_ != nullptr) {
    // Finalize flushes and waits for the peers to quiesce; a peer that is gone must not hang us.
    const absl::Time deadline = absl::Now() + std::min(timeout_, absl::Seconds(10));
    absl::Status finalized = Enqueued(ncclCommFinalize(comm_), comm_);
    if (finalized.ok()) finalized = AwaitNccl(comm_, deadline, "nccl: finalize");
    if (finalized.ok()) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  cudaStreamDestroy(stream_);
}

absl::Status NcclCommunicator::health() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

absl::Status NcclCommunicator::CheckDevice(std::string_view op, const void* data) const {
  DeviceScope scope(device_);  // so that the query never makes a context on another device
  cudaPointerAttributes attributes;
  if (cudaError_t e = cudaPointerGetAttributes(&attributes, data); e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return absl::InvalidArgumentError(
        absl::StrCat("nccl ", std::string(op), ": cannot inspect the buffer: ", CudaError(e)));
  }
  const bool device_memory = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  if (!device_memory || (attributes.type == cudaMemoryTypeDevice && attributes.device != device_)) {
    return absl::InvalidArgumentError(absl::StrCat("nccl ", std::string(op),
                                                   ": the buffer is not in the memory of CUDA device ", device_,
                                                   " (NcclCommunicator works on device pointers)"));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AbortLocked(absl::Status cause) {
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (broken_.ok()) broken_ = cause;
  return cause;
}

absl::Status NcclCommunicator::Run(std::string_view op, std::string_view tag, int64_t elements,
                                   const std::function<absl::Status()>& enqueue) {
  const absl::Time deadline = absl::Now() + timeout_;
  const std::string what = absl::StrCat("nccl ", std::string(op), " (tag '", std::string(tag), "', ", elements,
                                        " floats) on rank ", rank_, " of ", size_);
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the communicator was aborted after an earlier error: ", broken_.message()));
  }
  DeviceScope scope(device_);
  if (scope.status() != cudaSuccess) {
    return AbortLocked(absl::InternalError(absl::StrCat(what, ": cudaSetDevice: ", CudaError(scope.status()))));
  }
  absl::Status status = enqueue();
  if (status.ok()) status = AwaitNccl(comm_, deadline, "enqueue");
  Poller poller;
  while (status.ok()) {
    cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      status = absl::InternalError(CudaError(e));
      break;
    }
    // A peer's failure shows up here (a remote or network error) rather than on the stream.
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      status = absl::InternalError(NcclError(state, comm_));
      break;
    }
    if (absl::Now() >= deadline) {
      status = absl::DeadlineExceededError("did not complete");
      break;
    }
    poller.Pause();
  }
  if (absl::IsDeadlineExceeded(status)) {
    return AbortLocked(absl::DeadlineExceededError(
        absl::StrCat(what, ": ", status.message(), " within ", absl::FormatDuration(timeout_),
                     " (a rank missing or making different calls?); communicator aborted")));
  }
  return AbortLocked(absl::InternalError(absl::StrCat(what, ": ", status.message(), "; communicator aborted")));
}

absl::Status NcclCommunicator::AllReduceSum(absl::Span<float> data, std::string_view tag) {
  if (data.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("AllReduceSum", data.data()));
  return Run("AllReduceSum", tag, data.size(), [&] {
    return Enqueued(ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat, ncclSum, comm_, stream_), comm_);
  });
}

absl::Status NcclCommunicator::Reduce(absl::Span<float> data, int root, std::string_view tag) {
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(absl::StrCat("nccl Reduce: root ", root, " is not in [0, ", size_, ")"));
  }
  if (data.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("Reduce", data.data()));
  return Run("Reduce", tag, data.size(), [&] {
    return Enqueued(ncclReduce(data.data(), data.data(), data.size(), ncclFloat, ncclSum, root, comm_, stream_), comm_);
  });
}

absl::Status NcclCommunicator::ReduceScatter(absl::Span<const float> input, absl::Span<float> output,
                                             std::string_view tag) {
  if (input.size() != output.size() * size_) {
    return absl::InvalidArgumentError(absl::StrCat("nccl ReduceScatter: input has ", input.size(),
                                                   " floats, expected size() * output = ", output.size() * size_));
  }
  if (output.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("ReduceScatter", input.data()));
  RETURN_IF_ERROR(CheckDevice("ReduceScatter", output.data()));
  return Run("ReduceScatter", tag, input.size(), [&] {
    return Enqueued(ncclReduceScatter(input.data(), output.data(), output.size(), ncclFloat, ncclSum, comm_, stream_),
                    comm_);
  });
}

absl::Status NcclCommunicator::AllGather(absl::Span<const float> input, absl::Span<float> output,
                                         std::string_view tag) {
  if (output.size() != input.size() * size_) {
    return absl::InvalidArgumentError(absl::StrCat("nccl AllGather: output has ", output.size(),
                                                   " floats, expected size() * input = ", input.size() * size_));
  }
  if (input.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("AllGather", input.data()));
  RETURN_IF_ERROR(CheckDevice("AllGather", output.data()));
  return Run("AllGather", tag, output.size(), [&] {
    return Enqueued(ncclAllGather(input.data(), output.data(), input.size(), ncclFloat, comm_, stream_), comm_);
  });
}

absl::Status NcclCommunicator::Broadcast(absl::Span<float> data, int root, std::string_view tag) {
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(absl::StrCat("nccl Broadcast: root ", root, " is not in [0, ", size_, ")"));
  }
  if (data.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("Broadcast", data.data()));
  return Run("Broadcast", tag, data.size(), [&] {
    return Enqueued(ncclBroadcast(data.data(), data.data(), data.size(), ncclFloat, root, comm_, stream_), comm_);
  });
}

absl::Status NcclCommunicator::SendRecv(absl::Span<const NcclSend> sends, absl::Span<const NcclRecv> receives,
                                        std::string_view tag) {
  int64_t elements = 0;
  auto check = [&](int peer, const void* data, size_t n) -> absl::Status {
    if (peer < 0 || peer >= size_) {
      return absl::InvalidArgumentError(absl::StrCat("nccl SendRecv: peer ", peer, " is not in [0, ", size_, ")"));
    }
    elements += n;
    return n == 0 ? absl::OkStatus() : CheckDevice("SendRecv", data);
  };
  for (const NcclSend& s : sends) {
    RETURN_IF_ERROR(check(s.peer, s.data.data(), s.data.size()));
  }
  for (const NcclRecv& r : receives) {
    RETURN_IF_ERROR(check(r.peer, r.data.data(), r.data.size()));
  }
  if (elements == 0) return health();
  return Run("SendRecv", tag, elements, [&]() -> absl::Status {
    // In non-blocking mode the group's end may return ncclInProgress; Run polls the communicator after it.
    RETURN_IF_ERROR(Enqueued(ncclGroupStart(), comm_));
    absl::Status status;
    for (const NcclSend& s : sends) {
      if (status.ok() && !s.data.empty()) {
        status = Enqueued(ncclSend(s.data.data(), s.data.size(), ncclFloat, s.peer, comm_, stream_), comm_);
      }
    }
    for (const NcclRecv& r : receives) {
      if (status.ok() && !r.data.empty()) {
        status = Enqueued(ncclRecv(r.data.data(), r.data.size(), ncclFloat, r.peer, comm_, stream_), comm_);
      }
    }
    absl::Status ended = Enqueued(ncclGroupEnd(), comm_);
    return status.ok() ? ended : status;
  });
}

absl::Status NcclCommunicator::Send(int peer, absl::Span<const float> data, std::string_view tag) {
  const NcclSend send{peer, data};
  return SendRecv(absl::MakeConstSpan(&send, 1), {}, tag);
}

absl::Status NcclCommunicator::Recv(int peer, absl::Span<float> data, std::string_view tag) {
  const NcclRecv receive{peer, data};
  return SendRecv({}, absl::MakeConstSpan(&receive, 1), tag);
}

absl::Status NcclCommunicator::CopyToHost(absl::Span<const float> device_data, float* host) {
  if (device_data.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("CopyToHost", device_data.data()));
  return Run("CopyToHost", "", device_data.size(), [&] {
    return Enqueued(
        cudaMemcpyAsync(host, device_data.data(), device_data.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  });
}

absl::Status NcclCommunicator::CopyFromHost(const float* host, absl::Span<float> device_data) {
  if (device_data.empty()) return health();
  RETURN_IF_ERROR(CheckDevice("CopyFromHost", device_data.data()));
  return Run("CopyFromHost", "", device_data.size(), [&] {
    return Enqueued(
        cudaMemcpyAsync(device_data.data(), host, device_data.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
  });
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicatorWithRendezvous(
    geotrain::internal::HeadControl::StubInterface* head, const std::string& token, const std::string& job_id,
    const std::string& key, int rank, int size, int device, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string id;
  if (rank == 0) {
    ASSIGN_OR_RETURN(std::string made, NewNcclUniqueId());
    id = std::move(made);
  }
  ASSIGN_OR_RETURN(std::string shared, ExchangeRendezvous(head, token, job_id, key, rank == 0, id, timeout));
  ASSIGN_OR_RETURN(auto communicator, NcclCommunicator::Create(rank, size, shared, device, timeout, deadline));
  return communicator;
}

absl::StatusOr<std::unique_ptr<NcclHierarchicalAllReduce>> NcclHierarchicalAllReduce::Create(
    NcclCommunicator* site, Communicator* leaders, int64_t max_chunk_elements) {
  if (site == nullptr) return absl::InvalidArgumentError("hierarchical all-reduce: no site communicator");
  if ((site->rank() == 0) != (leaders != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hierarchical all-reduce: the site leader (NCCL rank 0) needs the leaders' communicator and the other "
        "ranks must not have one; this is rank ",
        site->rank(), (leaders != nullptr ? " with one" : " without one")));
  }
  if (max_chunk_elements < 1) {
    return absl::InvalidArgumentError("hierarchical all-reduce: max_chunk_elements must be positive");
  }
  float* staging = nullptr;
  if (leaders != nullptr) {
    DeviceScope scope(site->device());
    if (cudaError_t e = cudaMallocHost(&staging, max_chunk_elements * sizeof(float)); e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("hierarchical all-reduce: cudaMallocHost of ",
                                                       max_chunk_elements * sizeof(float), " bytes: ", CudaError(e)));
    }
  }
  return std::unique_ptr<NcclHierarchicalAllReduce>(
      new NcclHierarchicalAllReduce(site, leaders, staging, max_chunk_elements));
}

NcclHierarchicalAllReduce::NcclHierarchicalAllReduce(NcclCommunicator* site, Communicator* leaders, float* staging,
                                                     int64_t chunk_elements)
    : site_(site), leaders_(leaders), staging_(staging), chunk_elements_(chunk_elements) {}

NcclHierarchicalAllReduce::~NcclHierarchicalAllReduce() {
  if (staging_ != nullptr) cudaFreeHost(staging_);
}

absl::Status NcclHierarchicalAllReduce::AllReduceSum(absl::Span<float> device_data, std::string_view tag) {
  const int64_t n = static_cast<int64_t>(device_data.size());
  const bool chunked = n > chunk_elements_;
  for (int64_t begin = 0, chunk = 0; begin < n; begin += chunk_elements_, ++chunk) {
    absl::Span<float> part = device_data.subspan(begin, std::min(chunk_elements_, n - begin));
    const std::string part_tag = chunked ? absl::StrCat(std::string(tag), "/", chunk) : std::string(tag);
    RETURN_IF_ERROR(site_->Reduce(part, 0, part_tag));
    if (leaders_ != nullptr) {
      absl::Span<float> host(staging_, part.size());
      RETURN_IF_ERROR(site_->CopyToHost(part, host.data()));
      RETURN_IF_ERROR(leaders_->AllReduceSum(host, part_tag));
      RETURN_IF_ERROR(site_->CopyFromHost(host.data(), part));
    }
    RETURN_IF_ERROR(site_->Broadcast(part, 0, part_tag));
  }
  return absl::OkStatus();
}

// --- DeviceBucketMemory -------------------------------------------------------------------------------

DeviceBucketMemory::~DeviceBucketMemory() {
  DeviceScope scope(device_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (void* b : buffers_) cudaFree(b);
}

absl::StatusOr<float*> DeviceBucketMemory::Allocate(int64_t elements) {
  DeviceScope scope(device_);
  if (scope.status() != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("cuda:", device_, ": ", CudaError(scope.status())));
  }
  cudaEvent_t event;
  // Blocking sync: the all-reduce thread sleeps on the event instead of spinning on a core backward needs.
  if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync);
      e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("cudaEventCreate on cuda:", device_, ": ", CudaError(e)));
  }
  void* data = nullptr;
  if (cudaError_t e = cudaMalloc(&data, std::max<int64_t>(1, elements) * sizeof(float)); e != cudaSuccess) {
    cudaEventDestroy(event);
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", elements * sizeof(float), " bytes on cuda:", device_, ": ", CudaError(e)));
  }
  events_.push_back(event);
  buffers_.push_back(data);
  return static_cast<float*>(data);
}

void DeviceBucketMemory::Copy(float* dst, const float* src, int64_t n) {
  cudaError_t e = cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_);
  if (e != cudaSuccess && first_error_ == cudaSuccess) first_error_ = e;
}

BucketFence DeviceBucketMemory::Fence(int bucket) {
  if (bucket < 0 || bucket >= static_cast<int>(events_.size())) {
    return [bucket] { return absl::InternalError(absl::StrCat("no device event for gradient bucket ", bucket)); };
  }
  cudaEvent_t event = events_[bucket];
  if (cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
    if (first_error_ == cudaSuccess) first_error_ = e;
    return [e] { return absl::InternalError(absl::StrCat("cudaEventRecord for a gradient bucket: ", CudaError(e))); };
  }
  return [event, device = device_]() -> absl::Status {
    DeviceScope scope(device);
    if (cudaError_t e = cudaEventSynchronize(event); e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("waiting for a gradient bucket's copies on cuda:", device, ": ", CudaError(e)));
    }
    return absl::OkStatus();
  };
}

absl::Status DeviceBucketMemory::Check() {
  if (first_error_ == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("gradient bucket copies on cuda:", device_, ": ",
                                          CudaError(std::exchange(first_error_, cudaSuccess))));
}

}  // namespace geotrain::comm
