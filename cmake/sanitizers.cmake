# Compiler flags of the sanitizer builds (GEOTRAIN_SANITIZE); included by the top-level CMakeLists.txt before
# any target is defined, so the flags reach every library and executable. The sanitizer builds never compile
# CUDA (nvcc and the sanitizers do not mix).
#   address  ASan + UBSan, every finding fatal (build-asan/: `make test-asan`). With clang the code also gets
#            libFuzzer's coverage instrumentation and the fuzz targets of fuzz/ are built in the same directory
#            (`make fuzz-build`, `make fuzz`): one instrumented build serves both, which halves CI's compile time.
#   thread   ThreadSanitizer (build-tsan/: `make test-tsan`).
set(GEOTRAIN_BUILD_FUZZERS OFF)
if(GEOTRAIN_SANITIZE STREQUAL "")
  return()
endif()
set(GEOTRAIN_CUDA "OFF" CACHE STRING "Build the CUDA backend: AUTO, ON or OFF" FORCE)

if(GEOTRAIN_SANITIZE STREQUAL "address")
  set(sanitizers address,undefined)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    set(sanitizers fuzzer-no-link,${sanitizers})
    set(GEOTRAIN_BUILD_FUZZERS ON)
  endif()
  # -fno-sanitize-recover: a UBSan finding aborts like an ASan one (a fuzzer keeps the input; a test fails).
  add_compile_options(-fsanitize=${sanitizers} -fno-sanitize-recover=all -fno-omit-frame-pointer -g1)
  add_link_options(-fsanitize=address,undefined)
elseif(GEOTRAIN_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -g1)
  add_link_options(-fsanitize=thread)
else()
  message(FATAL_ERROR "GEOTRAIN_SANITIZE='${GEOTRAIN_SANITIZE}': use address, thread or leave it empty")
endif()
