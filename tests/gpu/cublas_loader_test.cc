// cuBLAS opened on first use (model/cuda/cublas_loader.h), on any machine the CUDA build runs on: opening the
// library and resolving its entry points needs no device. Not in the "gpu" label: it runs in every CUDA build's
// ctest, where a GPU host's run (tests/gpu/run.sh) would be the first to notice a lost entry point otherwise.
#include "model/cuda/cublas_loader.h"

#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

// Whether a file whose path contains `name` is mapped into this process.
bool Mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(name) != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLoader, AContextWithoutADeviceFailsBeforeOpeningCublas) {
  if (DeviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device: tests/gpu/ covers contexts on it";
  if (Mapped("libcublas")) GTEST_SKIP() << "cuBLAS is already open in this process";
  absl::StatusOr<std::unique_ptr<CudaContext>> ctx = CudaContext::Create(0, GemmPrecision::kFp32);
  EXPECT_FALSE(ctx.ok());
  EXPECT_FALSE(Mapped("libcublas")) << "a context that cannot exist opened cuBLAS";
}

TEST(CublasLoader, OpensCublasOnFirstUseOnly) {
  // This test binary links the CUDA ops library as geotrain does: cuBLAS must not come with it.
  ASSERT_FALSE(Mapped("libcublas")) << "cuBLAS was loaded at start: something links it again";
  absl::StatusOr<const CublasApi*> api = LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(Mapped("libcublas.so")) << "LoadCublas succeeded without mapping libcublas";
  EXPECT_TRUE(Mapped("libcublasLt")) << "libcublas came without its libcublasLt";

  // The entry points are cuBLAS's own: its status strings, distinct per status.
  const std::string success = (*api)->status_string(CUBLAS_STATUS_SUCCESS);
  const std::string not_initialized = (*api)->status_string(CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_FALSE(success.empty());
  EXPECT_FALSE(not_initialized.empty());
  EXPECT_NE(success, not_initialized);

  // Loaded once: the same table again.
  absl::StatusOr<const CublasApi*> again = LoadCublas();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *api);
}

}  // namespace
}  // namespace geotrain::model::cuda
