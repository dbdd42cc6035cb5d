// In-process tensor-parallel group: ranks are threads that meet at a barrier.
#include "model/tp_comm.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain::model {

class InProcessTensorParallelGroup::Comm : public TensorParallelComm {
 public:
  Comm(InProcessTensorParallelGroup* group, int rank) : group_(group), rank_(rank) {}
  absl::Status AllReduceSum(float* data, int64_t n) override { return group_->AllReduce(rank_, data, n); }
  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }

 private:
  InProcessTensorParallelGroup* group_;
  const int rank_;
};

InProcessTensorParallelGroup::InProcessTensorParallelGroup(int size)
    : size_(size), barrier_(size), buffers_(size, nullptr), sizes_(size, 0) {
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<Comm>(this, r));
}

InProcessTensorParallelGroup::~InProcessTensorParallelGroup() = default;

TensorParallelComm* InProcessTensorParallelGroup::comm(int r) { return comms_[r].get(); }

absl::Status InProcessTensorParallelGroup::AllReduce(int rank, float* data, int64_t n) {
  if (size_ == 1) return absl::OkStatus();
  buffers_[rank] = data;
  sizes_[rank] = n;
  barrier_.arrive_and_wait();
  // Phase 1 is over: every rank's buffer is posted. Rank 0 sizes the result; all check sizes.
  for (int r = 0; r < size_; ++r) {
    if (sizes_[r] != n) {
      barrier_.arrive_and_wait();
      barrier_.arrive_and_wait();
      return absl::InternalError(absl::StrCat("tensor-parallel all-reduce: rank ", rank, " has ", n,
                                              " floats but rank ", r, " has ", sizes_[r],
                                              "; ranks called collectives out of order"));
    }
  }
  if (rank == 0 && static_cast<int64_t>(result_.size()) < n) result_.resize(n);
  barrier_.arrive_and_wait();
  // Phase 2: each rank sums its chunk of the result, in rank order.
  const int64_t chunk = (n + size_ - 1) / size_;
  const int64_t begin = std::min(n, rank * chunk), end = std::min(n, begin + chunk);
  for (int64_t i = begin; i < end; ++i) {
    float s = buffers_[0][i];
    for (int r = 1; r < size_; ++r) s += buffers_[r][i];
    result_[i] = s;
  }
  barrier_.arrive_and_wait();
  std::copy(result_.begin(), result_.begin() + n, data);
  // Nobody may post the next buffer or resize the result before everyone has copied.
  barrier_.arrive_and_wait();
  return absl::OkStatus();
}

}  // namespace geotrain::model
