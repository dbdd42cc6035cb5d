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

.PHONY: all deps configure build demo test study clean format asan-configure fuzz-build fuzz test-asan test-tsan

all: build

deps:
	bash deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	bash deploy/demo.sh

# Issue 17's study at GPU scale by timed compute (EMULATED; docs/geo-study.md): the FABRIC experiment and the
# planner's validation on timed clusters, written to docs/geo/. About 55 minutes on this 2-core machine.
study: build
	bash bench/geo/run_all.sh $(BUILD)

# The suite includes a short run of every fuzz target (fuzz.<target>), so the fuzz build comes first.
test: build fuzz-build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

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

# The whole suite under ASan + UBSan; integration tests start the sanitized binaries.
test-asan: asan-configure
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	bash tests/sanitizers/run_ctest.sh $(ASAN_BUILD) address -j $(JOBS)

# The runtime, control-plane and comm tests under ThreadSanitizer.
test-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  -DGEOTRAIN_SANITIZE=thread
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	bash tests/sanitizers/run_ctest.sh $(TSAN_BUILD) thread -j $(JOBS) -R '$(TSAN_TESTS)'

format:
	bash tests/style/check_format.sh $(CURDIR) --fix

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD)
