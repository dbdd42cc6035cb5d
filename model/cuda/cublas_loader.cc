// LoadCublas (cublas_loader.h): dlopen of libcublas on first use.
#include "model/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

#ifndef GEOTRAIN_CUBLAS_DIR
#define GEOTRAIN_CUBLAS_DIR ""
#endif

namespace geotrain::model::cuda {
namespace {

// Resolves `name` into *fn; false (with the loader's message in *error) when the library lacks it.
template <typename Fn>
bool Resolve(void* library, const char* name, Fn* fn, std::string* error) {
  dlerror();
  *fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (*fn != nullptr) return true;
  const char* message = dlerror();
  *error = absl::StrCat("it has no ", name, message != nullptr ? absl::StrCat(" (", message, ")") : "");
  return false;
}

absl::StatusOr<CublasApi> Open() {
  const std::string soname = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  std::string tried = soname, opened = soname;
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string error = library == nullptr ? dlerror() : "";
  const std::string toolkit_dir = GEOTRAIN_CUBLAS_DIR;
  if (library == nullptr && !toolkit_dir.empty()) {
    opened = absl::StrCat(toolkit_dir, "/", soname);
    absl::StrAppend(&tried, " and ", opened);
    library = dlopen(opened.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) error = dlerror();
  }
  if (library == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open cuBLAS for the CUDA backend (tried ", tried,
                                                      "): ", error, "; install the CUDA toolkit's cuBLAS ",
                                                      CUBLAS_VER_MAJOR, " or add its directory to LD_LIBRARY_PATH"));
  }
  CublasApi api;
  // The process keeps the library open: contexts and their handles may live until exit.
  if (!Resolve(library, "cublasCreate_v2", &api.create, &error) ||
      !Resolve(library, "cublasDestroy_v2", &api.destroy, &error) ||
      !Resolve(library, "cublasSetStream_v2", &api.set_stream, &error) ||
      !Resolve(library, "cublasGemmEx", &api.gemm_ex, &error) ||
      !Resolve(library, "cublasGetStatusString", &api.status_string, &error)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the cuBLAS at ", opened, " is not the one geotrain was built against (cuBLAS ", CUBLAS_VER_MAJOR,
                     "): ", error, "; install cuBLAS ", CUBLAS_VER_MAJOR, " or rebuild geotrain"));
  }
  return api;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi>* const loaded = new absl::StatusOr<CublasApi>(Open());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

}  // namespace geotrain::model::cuda
