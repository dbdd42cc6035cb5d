// A stage's training state streamed from a live replica to a joining one (a heal; see stage_trainer.h SendState).
//
// Wire: four tensors on the data-parallel group's exact communicator, tagged "heal/<part>": a header of int64 fields,
// each as four 16-bit pieces in floats (exact in fp32 whatever their bits), then the weights, then AdamW's first and
// second moments (num_params floats each).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {
namespace {

constexpr int64_t kStateMagic = 0x6774'6865'616c'0001;  // "gtheal", version 1

// The header's fields, in order.
enum HeaderField {
  kMagic,
  kNumParams,
  kCompletedStep,
  kAdamStep,
  kScaleBits,
  kCleanSteps,
  kSkipped,
  kHasLoader,
  kShard,
  kOffset,
  kEpoch,
  kFields
};

void Put(std::vector<float>& header, int field, int64_t value) {
  uint64_t bits = static_cast<uint64_t>(value);
  for (int i = 0; i < 4; ++i)
    header[static_cast<size_t>(field * 4 + i)] = static_cast<float>((bits >> (16 * i)) & 0xffff);
}

int64_t Get(const std::vector<float>& header, int field) {
  uint64_t bits = 0;
  for (int i = 0; i < 4; ++i) {
    bits |= static_cast<uint64_t>(header[static_cast<size_t>(field * 4 + i)]) << (16 * i);
  }
  return static_cast<int64_t>(bits);
}

// The header's pieces are whole numbers in [0, 65535]: anything else is not a header.
bool ValidPieces(const std::vector<float>& header) {
  for (float f : header) {
    if (!(f >= 0 && f <= 65535) || f != static_cast<float>(static_cast<uint32_t>(f))) return false;
  }
  return true;
}

// This actor's rank in the data-parallel group of its membership (the present replicas, ascending).
absl::StatusOr<int> GroupRank(const ActorRanks& ranks, int replica) {
  for (size_t i = 0; i < ranks.present.size(); ++i) {
    if (ranks.present[i] == replica) return static_cast<int>(i);
  }
  return absl::InternalError(absl::StrCat("replica ", replica, " is not in the membership (", ranks.present.size(),
                                          " replicas) the heal runs in"));
}

}  // namespace

absl::StatusOr<uint64_t> StageTrainer::SendState(const std::vector<int>& joining) {
  comm::Communicator* comm = collectives_->dp_scalars;
  if (comm == nullptr) return absl::InternalError("a heal needs the data-parallel group, and this stage has none");
  std::vector<float> header(kFields * 4);
  const int64_t n = stage_->num_params();
  const model::LossScaleState& scale = adam_->loss_scaler().state();
  int64_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale.scale, sizeof(scale_bits));
  Put(header, kMagic, kStateMagic);
  Put(header, kNumParams, n);
  Put(header, kCompletedStep, completed_step_);
  Put(header, kAdamStep, adam_->step());
  Put(header, kScaleBits, scale_bits);
  Put(header, kCleanSteps, scale.clean_steps);
  Put(header, kSkipped, scale.skipped);
  Put(header, kHasLoader, loader_ != nullptr);
  const model::DataPosition position = loader_ ? loader_->position() : model::DataPosition{};
  Put(header, kShard, position.shard);
  Put(header, kOffset, position.offset);
  Put(header, kEpoch, position.epoch);
  ASSIGN_OR_RETURN(float* params, HostParams());
  std::vector<float> m, v;
  RETURN_IF_ERROR(adam_->CopyMomentsToHost(&m, &v));
  uint64_t bytes = 0;
  for (int replica : joining) {
    ASSIGN_OR_RETURN(const int peer, GroupRank(ranks_, replica));
    RETURN_IF_ERROR(comm->Send(peer, absl::MakeConstSpan(header), "heal/header"));
    RETURN_IF_ERROR(comm->Send(peer, absl::MakeConstSpan(params, static_cast<size_t>(n)), "heal/params"));
    RETURN_IF_ERROR(comm->Send(peer, absl::MakeConstSpan(m), "heal/m"));
    RETURN_IF_ERROR(comm->Send(peer, absl::MakeConstSpan(v), "heal/v"));
    bytes += (header.size() + 3 * static_cast<size_t>(n)) * sizeof(float);
  }
  return bytes;
}

absl::StatusOr<uint64_t> StageTrainer::ReceiveState(int donor) {
  comm::Communicator* comm = collectives_->dp_scalars;
  if (comm == nullptr) return absl::InternalError("a heal needs the data-parallel group, and this stage has none");
  ASSIGN_OR_RETURN(const int peer, GroupRank(ranks_, donor));
  std::vector<float> header(kFields * 4);
  RETURN_IF_ERROR(comm->Recv(peer, absl::MakeSpan(header), "heal/header"));
  const int64_t n = stage_->num_params();
  if (!ValidPieces(header) || Get(header, kMagic) != kStateMagic) {
    return absl::DataLossError(absl::StrCat("the state replica ", donor,
                                            " sent for a heal has no valid header: a different geotrain version?"));
  }
  if (Get(header, kNumParams) != n || Get(header, kHasLoader) != (loader_ != nullptr)) {
    return absl::DataLossError(absl::StrCat("replica ", donor, " sent the state of a stage of ",
                                            Get(header, kNumParams), " parameters for this stage of ", n,
                                            ": the replicas' plans differ"));
  }
  const int64_t completed = Get(header, kCompletedStep), adam_step = Get(header, kAdamStep);
  const model::DataPosition position{Get(header, kShard), Get(header, kOffset), Get(header, kEpoch)};
  if (completed < 0 || adam_step < 0 || position.shard < 0 || position.offset < 0 || position.epoch < 0) {
    return absl::DataLossError(absl::StrCat("replica ", donor, " sent a state with a negative step or data position"));
  }
  model::LossScaleState scale;
  const int64_t scale_bits = Get(header, kScaleBits);
  std::memcpy(&scale.scale, &scale_bits, sizeof(scale.scale));
  scale.clean_steps = Get(header, kCleanSteps);
  scale.skipped = Get(header, kSkipped);
  std::vector<float> params(static_cast<size_t>(n)), m(params.size()), v(params.size());
  RETURN_IF_ERROR(comm->Recv(peer, absl::MakeSpan(params), "heal/params"));
  RETURN_IF_ERROR(comm->Recv(peer, absl::MakeSpan(m), "heal/m"));
  RETURN_IF_ERROR(comm->Recv(peer, absl::MakeSpan(v), "heal/v"));
  // Every part is in and checked (the data position by the loader itself): only now does any of it replace this
  // stage's state.
  if (loader_) RETURN_IF_ERROR(loader_->Restore(position));
  RETURN_IF_ERROR(adam_->loss_scaler().Restore(scale));
  ASSIGN_OR_RETURN(float* host, HostParams());
  std::memcpy(host, params.data(), params.size() * sizeof(float));
  RETURN_IF_ERROR(ParamsToDevice());
  RETURN_IF_ERROR(adam_->CopyMomentsFromHost(m, v));
  adam_->set_step(adam_step);
  completed_step_ = completed;
  loaded_step_ = completed_step_;
  step_start_position_ = position;
  return (header.size() + 3 * params.size()) * sizeof(float);
}

}  // namespace geotrain::worker
