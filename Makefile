# The two commands: `make demo` and `make test`. Both install what is missing, configure and build.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# ccache: paths below the checkout are hashed relative to it, so a fresh clone reuses the cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true

# Instrumented builds, each in its own directory (docs/architecture.md, "Fuzzing and sanitizers").
# The clang ASan build holds the fuzz targets too (cmake/sanitizers.cmake).
ASAN_BUILD ?= build-asan
FUZZ_BUILD := $(ASAN_BUILD)
TSAN_BUILD ?= build-tsan
FUZZ_SECONDS ?= 60
# TSan runs the tests with threads of their own: the runtime, control-plane and comm tests.
TSAN_TESTS ?= ^(comm_(stream|collective|rendezvous)|netem\.Emulator|control_plane|cluster_up|prometheus_scrape|runtime_|StageActorTest|Collectives|RegistryTest|JobManagerTest|PlaceActorsTest|AuthTest|RpcTest)

.PHONY: all deps configure build demo test study clean format asan-configure fuzz-build fuzz test-asan test-tsan \
        cuda-check

all: build

deps:
	bash deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	bash deploy/demo.sh

# The study at GPU scale by timed compute (EMULATED; docs/geo-study.md): the FABRIC experiment and the planner's
# validation on timed clusters, written to docs/results/data/geo/. About 55 minutes on this 2-core machine.
study: build
	bash bench/geo/run_all.sh $(BUILD)

# The plain suite. The fuzz smoke runs (fuzz.<target>) belong to the ASan build and run with `make test-asan`.
# OpenMP's threads sleep at their barriers instead of spinning: tests run side by side (and several actors in one
# process), and spinning threads of one test take the cores another needs (StageActorTest and TrainerTest: 33 s
# with spinning, 4 s without, on two cores).
test: build
	cd $(BUILD) && OMP_WAIT_POLICY=PASSIVE ctest --output-on-failure -j $(JOBS) --timeout 600

# The ASan + UBSan build (clang, with libFuzzer's coverage instrumentation): configured once for both the fuzz
# targets (fuzz/) and the whole suite.
asan-configure: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DGEOTRAIN_SANITIZE=address

# libFuzzer targets only.
fuzz-build: asan-configure
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzzers

# Every fuzz target for FUZZ_SECONDS, one after the other; new inputs stay in $(FUZZ_BUILD)/corpus/.
fuzz: fuzz-build
	bash fuzz/run_all.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

# The whole suite under ASan + UBSan, with a short run of every fuzz target (fuzz.<target>); integration tests
# start the sanitized binaries.
test-asan: asan-configure
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	bash tests/sanitizers/run_ctest.sh $(ASAN_BUILD) address -j $(JOBS)

# The runtime, control-plane and comm tests under ThreadSanitizer.
test-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DGEOTRAIN_SANITIZE=thread
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	bash tests/sanitizers/run_ctest.sh $(TSAN_BUILD) thread -j $(JOBS) -R '$(TSAN_TESTS)'

# Compiles and links the CUDA backend, the NCCL communicator and the GPU tests for CUDA_ARCHS on a machine without
# a GPU (nvcc and NCCL suffice), in its own build directory, then reads the objects' fat binaries back to check
# that each architecture's machine code is there (and PTX for the newest). E.g. make cuda-check CUDA_ARCHS="75 86".
CUDA_ARCHS ?= 75 80 86 89 90
CUDA_CHECK_BUILD ?= build-cuda-check
empty :=
space := $(empty) $(empty)
cuda_archs_sorted = $(shell echo $(CUDA_ARCHS) | tr ' ' '\n' | sort -n | tr '\n' ' ')
cuda_arch_list = $(subst $(space),;,$(strip $(foreach a,$(filter-out $(lastword $(cuda_archs_sorted)),$(cuda_archs_sorted)),$(a)-real) $(lastword $(cuda_archs_sorted))))
cuda-check: deps
	cmake -S . -B $(CUDA_CHECK_BUILD) -DCMAKE_BUILD_TYPE=Release -DGEOTRAIN_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$(cuda_arch_list)"
	cmake --build $(CUDA_CHECK_BUILD) -j $(JOBS) --target geotrain_model_cuda geotrain_comm_nccl gpu_ops_test \
	  gpu_model_test cublas_loader_test comm_nccl_test
	python3 tests/gpu/check_archs.py $(CUDA_CHECK_BUILD) $(CUDA_ARCHS)

format:
	bash tests/style/check_format.sh $(CURDIR) --fix

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(CUDA_CHECK_BUILD)
