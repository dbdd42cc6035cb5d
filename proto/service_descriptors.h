// The service descriptors of geotrain's own protos, by full name, for code that enumerates their methods
// (the auth test, the hostile client):
//
//   const google::protobuf::ServiceDescriptor* s = FindServiceDescriptor("geotrain.internal.HeadControl");
//   for (int i = 0; i < s->method_count(); ++i) ...
//
// A .proto file's descriptor reaches protobuf's generated pool when its generated code is linked in. A file
// that declares services only (internal.proto) is named by no other code, so a binary could lose it, as the
// clang builds did; this file names every geotrain file's descriptor table, so linking it links them all.
// Returns nullptr for a name no geotrain file declares. Thread safety: any thread.
#pragma once

#include <string>

#include "google/protobuf/descriptor.h"

namespace geotrain {

const google::protobuf::ServiceDescriptor* FindServiceDescriptor(const std::string& full_name);

}  // namespace geotrain
