# The two commands: `make train` and `make test`. Each installs what is missing, configures and
# builds, then does its job. Other targets are conveniences for developers.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps configure build test train bench clean

all: build

deps:
	@bash scripts/install-deps.sh

configure: deps
	@if [ ! -f $(BUILD_DIR)/build.ninja ]; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS); \
	fi

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	@cd $(BUILD_DIR) && ctest -j $(JOBS) --output-on-failure --timeout 900

train: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target fashion_mnist emberrun
	@$(BUILD_DIR)/launcher/emberrun --standalone --nproc-per-node 2 $(BUILD_DIR)/examples/fashion_mnist \
	  --model cnn --epochs 3

bench: build
	@cmake --build $(BUILD_DIR) --target ref_libtorch -j $(JOBS)
	@/usr/bin/python3 benchmarks/run_tensor_bench.py --build $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR)
