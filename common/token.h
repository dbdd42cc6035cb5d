// The cluster token on RPCs: the metadata key that carries it and the one check of it, shared by the control
// services (common/rpc.h TokenAuth) and the tensor streams (comm/tensor_stream.h). No gRPC types here, so
// headers that keep gRPC out can include it.
//
//   if (!TokenMatches(presented, cluster_token)) refuse the call (UNAUTHENTICATED);
#pragma once

#include <string_view>

namespace geotrain {

// The cluster token's metadata key on every RPC.
inline constexpr char kTokenMetadataKey[] = "x-geotrain-token";

// Whether a call's `presented` token is the cluster's `expected` one, in time that depends only on
// `expected`'s length, not on where the strings differ. An empty token never matches: a server without a
// token accepts nobody, and a call without one is refused. Thread-safe.
bool TokenMatches(std::string_view presented, std::string_view expected);

}  // namespace geotrain
