// The communicator a tensor-parallel (Megatron) group of ranks needs: one collective, a sum all-reduce
// over float buffers. GPT2Stage calls it twice per block in forward (after the attention projection and
// after the MLP projection) and twice per block in backward (on the gradients of the two LayerNorm
// outputs). The distributed runtime implements this interface over its transport; the in-process group
// below makes TP testable in one process (one thread per rank).
//
//   InProcessTensorParallelGroup group(2);
//   // thread r: GPT2Stage stage(config, {.tp_comm = group.comm(r), ...});
//
// Contract: every rank of a group calls AllReduceSum in the same order with the same n; on return every
// rank holds the elementwise sum, identical bit for bit on every rank (so replicated parameters stay
// identical). A call blocks until all ranks have joined it. A non-OK status means the group is broken.
#pragma once

#include <barrier>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace geotrain::model {

class TensorParallelComm {
 public:
  virtual ~TensorParallelComm() = default;
  // In place: data[0..n) becomes the sum of every rank's data[0..n).
  virtual absl::Status AllReduceSum(float* data, int64_t n) = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // True when AllReduceSum takes device pointers of the stage's CUDA backend (e.g. an NCCL comm on the
  // same device and stream). Otherwise a CUDA stage stages its all-reduces through host memory.
  virtual bool accepts_device_memory() const { return false; }
};

// A group of `size` ranks in one process, each driven by its own thread. Sums in rank order, so results
// are deterministic and identical on every rank.
class InProcessTensorParallelGroup {
 public:
  explicit InProcessTensorParallelGroup(int size);
  ~InProcessTensorParallelGroup();
  InProcessTensorParallelGroup(const InProcessTensorParallelGroup&) = delete;
  InProcessTensorParallelGroup& operator=(const InProcessTensorParallelGroup&) = delete;

  int size() const { return size_; }
  // The communicator of rank r (0 <= r < size); owned by the group.
  TensorParallelComm* comm(int r);

 private:
  class Comm;
  absl::Status AllReduce(int rank, float* data, int64_t n);

  const int size_;
  std::barrier<> barrier_;
  // Written by each rank for its own slot between barriers, read by all after the barrier.
  std::vector<float*> buffers_;
  std::vector<int64_t> sizes_;
  std::vector<float> result_;
  std::vector<std::unique_ptr<Comm>> comms_;
};

}  // namespace geotrain::model
