# Compiler flags of the instrumented builds (GEOTRAIN_FUZZ, GEOTRAIN_SANITIZE); included by the top-level
# CMakeLists.txt before any target is defined, so the flags reach every library and executable.
if(NOT GEOTRAIN_FUZZ AND GEOTRAIN_SANITIZE STREQUAL "")
  return()
endif()
if(GEOTRAIN_FUZZ AND NOT GEOTRAIN_SANITIZE STREQUAL "")
  message(FATAL_ERROR "GEOTRAIN_FUZZ and GEOTRAIN_SANITIZE are separate builds; configure one per build directory")
endif()
set(GEOTRAIN_CUDA "OFF" CACHE STRING "Build the CUDA backend: AUTO, ON or OFF" FORCE)

if(GEOTRAIN_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "GEOTRAIN_FUZZ needs clang (libFuzzer): configure with -DCMAKE_C_COMPILER=clang "
                        "-DCMAKE_CXX_COMPILER=clang++ (Debian packages clang and libclang-rt-14-dev)")
  endif()
  # Coverage for libFuzzer everywhere; the fuzz targets themselves link -fsanitize=fuzzer (fuzz/CMakeLists.txt).
  # Every UBSan finding aborts, so that the fuzzer stops on it and keeps the input.
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
                      -gline-tables-only)
  add_link_options(-fsanitize=address,undefined)
elseif(GEOTRAIN_SANITIZE STREQUAL "address")
  # ASan + UBSan (gcc or clang). UBSan reports go on (recoverable) unless UBSAN_OPTIONS says halt_on_error=1,
  # which the tests' environment does (tests/sanitizers/).
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -g1)
  add_link_options(-fsanitize=address,undefined)
elseif(GEOTRAIN_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -g1)
  add_link_options(-fsanitize=thread)
else()
  message(FATAL_ERROR "GEOTRAIN_SANITIZE='${GEOTRAIN_SANITIZE}': use address, thread or leave it empty")
endif()
