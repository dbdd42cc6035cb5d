// The client side of the head's rendezvous (Head.PublishRendezvous / Head.FetchRendezvous): one rank
// publishes a small value under a key of its job, the others fetch it. Used to hand an NCCL unique id,
// which must be made in the process of the communicator's rank 0, to the other ranks of a site.
//
//   auto stub = geotrain::internal::HeadControl::NewStub(channel_to_head);
//   std::string id = rank == 0 ? NewNcclUniqueId().value() : "";
//   absl::StatusOr<std::string> shared = ExchangeRendezvous(stub.get(), token, job_id, "nccl/site-a/attempt1",
//                                                           /*publisher=*/rank == 0, id, absl::Seconds(60));
//
// Keys are write-once per job (the head refuses a different value under a used key with ALREADY_EXISTS):
// put everything that distinguishes one communicator from another, including an attempt number when a
// communicator is made again, into the key. Values are at most 4 KiB. The head drops a job's keys when
// the job ends.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "internal.grpc.pb.h"

namespace geotrain::comm {

// The publisher publishes `value` and returns it; the others wait for the key and return its value. Every
// call ends by `timeout` from its start (plus at most 5 s for the head's last answer; a zero timeout still
// asks once): a fetch longer than the head's 60 s limit is split into several waits, and an unreachable
// head (UNAVAILABLE) is retried with backoff until then. Errors: the head's
// (UNAUTHENTICATED for a wrong token, INVALID_ARGUMENT for an oversize value, NOT_FOUND for an unknown
// job, FAILED_PRECONDITION for an ended one), or DEADLINE_EXCEEDED naming the key and the job.
// Thread-safe (the stub is).
absl::StatusOr<std::string> ExchangeRendezvous(geotrain::internal::HeadControl::StubInterface* head,
                                               const std::string& token, const std::string& job_id,
                                               const std::string& key, bool publisher, const std::string& value,
                                               absl::Duration timeout);

}  // namespace geotrain::comm
