# The two commands: `make demo` and `make test`. Both install what is missing, configure and build.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# ccache: paths below the checkout are hashed relative to it, so a fresh clone reuses the cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true

.PHONY: all deps configure build demo test clean format

all: build

deps:
	bash deploy/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	bash deploy/demo.sh

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

format:
	bash tests/style/check_format.sh $(CURDIR) --fix

clean:
	rm -rf $(BUILD)
