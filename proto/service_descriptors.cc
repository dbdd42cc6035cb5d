// See service_descriptors.h.
#include "service_descriptors.h"

#include "control.pb.h"
#include "geotrain/v1/cluster.pb.h"
#include "geotrain/v1/jobs.pb.h"
#include "geotrain/v1/planner.pb.h"
#include "internal.pb.h"
#include "staging.pb.h"
#include "tensor.pb.h"

namespace geotrain {

// External linkage: the compiler keeps the array, and with it the references that make the linker keep every
// file's generated code (and so its registration with the generated pool).
extern const void* const kGeotrainProtoFiles[];
const void* const kGeotrainProtoFiles[] = {
    &descriptor_table_control_2eproto,
    &descriptor_table_internal_2eproto,
    &descriptor_table_staging_2eproto,
    &descriptor_table_tensor_2eproto,
    &descriptor_table_geotrain_2fv1_2fcluster_2eproto,
    &descriptor_table_geotrain_2fv1_2fjobs_2eproto,
    &descriptor_table_geotrain_2fv1_2fplanner_2eproto,
};

const google::protobuf::ServiceDescriptor* FindServiceDescriptor(const std::string& full_name) {
  return google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(full_name);
}

}  // namespace geotrain
