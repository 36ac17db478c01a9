# The two commands: `make train` and `make test`. Each installs what is missing, configures and
# builds, then does its job. Other targets are conveniences for developers.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)

# Fuzzing (fuzz/, docs/reliability.md): a Clang build folder of its own; FUZZ_SECONDS per target.
FUZZ_BUILD_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
# Sanitizer builds (docs/reliability.md), each in its own folder; the test binaries are run
# directly (ctest names cases, not binaries). ASan+UBSan: every test of the layers below, every
# library instrumented. TSan: the store, process-group and DDP tests, with the layers under them
# built without TSan (and so shared with the plain build through ccache): TSan checks the threads
# of the code it tests. Each has a -build target that only builds (.ci/run gives a build the time
# CI has left and skips the step if a cold ccache makes it longer).
ASAN_BUILD_DIR ?= build-asan
TSAN_BUILD_DIR ?= build-tsan
ASAN_LAYERS ?= tensor autograd nn distributed launcher
ASAN_TESTS ?= $(foreach l,$(ASAN_LAYERS),$(foreach f,$(shell find tests/$(l) -name '*_test.cpp'),$(l)_$(basename $(notdir $(f)))))
# ASAN_SKIP: libraries built without ASan, with exactly the plain build's compile commands (so
# ccache serves them), e.g. "ember_log;ember_tensor" for a quick build of the layers above; ASan's
# allocator still sees their allocations. CUDA stays on: the sanitizers instrument C and C++ only,
# and the .cu files keep the plain build's compile commands.
ASAN_SKIP ?=
ASAN_CI_BUILD_DIR ?= build-asan-ci
# ASAN_RUN: `binaries` runs each test binary in turn; `ctest` runs a process per case in
# parallel; `shards` runs the cases of ASAN_SHARDED's layers in processes of up to 40 cases,
# JOBS at a time (tests/sanitizers/run_shards.py), and the rest as `ctest` does. An ASan process's
# start and leak check cost the same whatever it runs (most of it the dynamic loader applying
# UBSan's check data's relocations in libember_tensor), so one process per case made that most
# of the tensor, autograd and nn cases' time. The layers above stay one case per process: their
# multi-process cases fork, which needs a process with no thread left by an earlier case (an
# OpenMP pool, a group's worker). The cases under mpirun (names with "Mpi"; none in the sharded
# layers) run in a ctest pass of their own with full stacks on every malloc, which the
# suppressions of Open MPI's leaks need (tests/sanitizers/lsan.supp) and which would slow every
# other case. The downstream project is not built with ASan, so it cannot load these libraries:
# left out, as are the checks of the repository's scripts and build (repo., cmake., scripts.),
# which run no sanitized code (the CUDA architectures check alone took 40 s under ASan's ctest).
ASAN_RUN ?= binaries
ASAN_NOT_RUN = ^(downstream|repo|cmake|scripts)[.]
ASAN_SHARDED ?= tensor autograd nn
ASAN_SHARDED_TESTS = $(filter $(addsuffix _%,$(ASAN_SHARDED)),$(ASAN_TESTS))
ASAN_EXTRA ?= $(if $(filter binaries,$(ASAN_RUN)),:fast_unwind_on_malloc=0,)
ASAN_SLOW_UNWIND = ASAN_OPTIONS=$(ASAN_BASE):fast_unwind_on_malloc=0
ASAN_CTEST = ctest -j $(JOBS) --output-on-failure --timeout 900
# distributed_ddp_threads_test is left out: its ranks are threads that share tensors, whose
# reference counts are then dropped in the layers built without TSan, where TSan cannot see
# them; run it with TSAN_SKIP= (everything instrumented).
TSAN_TESTS ?= distributed_store_test distributed_tcp_store_test distributed_threads_test \
  distributed_gloo_test distributed_ddp_test distributed_shm_single_copy_test \
  distributed_shm_mapped_test distributed_flight_recorder_test
TSAN_SKIP ?= ember_log;ember_tensor;ember_autograd;ember_nn
ASAN_BASE = detect_leaks=1:abort_on_error=1
SANITIZER_ENV = ASAN_OPTIONS=$(ASAN_BASE)$(ASAN_EXTRA) \
  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitizers/lsan.supp \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/sanitizers/tsan.supp
# TSan cannot see libgomp's barriers (libgomp is not built with TSan), so a tensor op's OpenMP
# workers look unordered with whatever touches the tensor next: one OpenMP thread under TSan.
TSAN_ENV = OMP_NUM_THREADS=1
# $(call run_tests,BUILD_DIR,TESTS[,ENV]): runs each test binary, then fails naming those that
# failed.
run_tests = fail=""; for t in $(2); do echo "== $$t"; \
  $(SANITIZER_ENV) $(3) timeout 1200 $(1)/tests/$$t --gtest_brief=1 || fail="$$fail $$t"; done; \
  if [ -n "$$fail" ]; then echo "failed:$$fail"; exit 1; fi

.PHONY: all deps configure build test train bench clean fuzz fuzz-build sanitize asan asan-build \
  asan-ci asan-ci-build tsan tsan-build docs-api

all: build

# PROFILE: which packages `deps` installs (scripts/install-deps.sh): all, or train (what `make
# train` needs; no tests or benchmarks then, as their packages are not there).
PROFILE ?= all
deps:
	@bash scripts/install-deps.sh $(PROFILE)

# CMake runs on a new build folder; on an existing one when CMAKE_ARGS are given (so they take
# effect: `make test CMAKE_ARGS=-DEMBER_WITH_CUDA=OFF`), and when a folder `make train` set up
# is wanted for everything (tests and benchmarks on, their packages installed since).
# $(BUILD_DIR)/.ember-profile records the profile a folder was configured for.
configure: deps
	@have=$$(cat $(BUILD_DIR)/.ember-profile 2>/dev/null || echo all); \
	if [ "$(PROFILE)" = train ]; then tests=OFF; else tests=ON; fi; \
	if [ ! -f $(BUILD_DIR)/build.ninja ]; then \
	  cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	    -DEMBER_BUILD_TESTS=$$tests -DEMBER_BUILD_BENCHMARKS=$$tests $(CMAKE_ARGS) && \
	  echo $(PROFILE) > $(BUILD_DIR)/.ember-profile; \
	elif [ "$$have" = train ] && [ "$(PROFILE)" = all ]; then \
	  cmake -S . -B $(BUILD_DIR) -DEMBER_BUILD_TESTS=ON -DEMBER_BUILD_BENCHMARKS=ON $(CMAKE_ARGS) && \
	  echo all > $(BUILD_DIR)/.ember-profile; \
	elif [ -n "$(strip $(CMAKE_ARGS))" ]; then \
	  cmake -S . -B $(BUILD_DIR) $(CMAKE_ARGS); \
	fi

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	@cd $(BUILD_DIR) && ctest -j $(JOBS) --output-on-failure --timeout 900

train:
	@$(MAKE) --no-print-directory configure PROFILE=train
	@cmake --build $(BUILD_DIR) -j $(JOBS) --target fashion_mnist emberrun
	@$(BUILD_DIR)/launcher/emberrun --standalone --nproc-per-node 2 $(BUILD_DIR)/examples/fashion_mnist \
	  --model cnn --epochs 3

# The API reference from the installed headers' `///` comments, into $(BUILD_DIR)/docs/api/html
# (cmake/EmberDocs.cmake); fails on any Doxygen warning. Builds nothing else. A build folder
# configured before Doxygen was installed has no docs_api target: CMake then runs again and
# finds it. Doxygen never deletes a page: the old html/ goes first, so a class removed from the
# headers loses its page.
docs-api: configure
	@grep -q '^build docs_api:' $(BUILD_DIR)/build.ninja || cmake $(BUILD_DIR) >/dev/null
	@rm -rf $(BUILD_DIR)/docs/api/html
	@cmake --build $(BUILD_DIR) --target docs_api

bench: build
	@cmake --build $(BUILD_DIR) --target ref_libtorch -j $(JOBS)
	@/usr/bin/python3 benchmarks/run_tensor_bench.py --build $(BUILD_DIR)

fuzz-build: deps
	@if [ ! -f $(FUZZ_BUILD_DIR)/build.ninja ]; then \
	  CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	    -DEMBER_BUILD_FUZZERS=ON -DEMBER_BUILD_TESTS=OFF -DEMBER_BUILD_BENCHMARKS=OFF \
	    -DEMBER_WITH_CUDA=OFF; \
	fi
	@cmake --build $(FUZZ_BUILD_DIR) -j $(JOBS) --target fuzzers

fuzz: fuzz-build
	@bash fuzz/run.sh $(FUZZ_BUILD_DIR) $(FUZZ_SECONDS)

sanitize: asan tsan

asan-build: deps
	@if [ ! -f $(ASAN_BUILD_DIR)/build.ninja ]; then \
	  cmake -S . -B $(ASAN_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DEMBER_SANITIZE=address \
	    "-DEMBER_SANITIZE_SKIP=$(ASAN_SKIP)" -DEMBER_BUILD_BENCHMARKS=OFF; \
	fi
	@cmake --build $(ASAN_BUILD_DIR) -j $(JOBS) --target $(ASAN_TESTS)

asan: asan-build
	@if [ "$(ASAN_RUN)" = binaries ]; then $(call run_tests,$(ASAN_BUILD_DIR),$(ASAN_TESTS)); \
	else \
	  sharded=0; skip=""; \
	  if [ "$(ASAN_RUN)" = shards ]; then \
	    $(SANITIZER_ENV) /usr/bin/python3 tests/sanitizers/run_shards.py \
	      --build $(ASAN_BUILD_DIR) --jobs $(JOBS) $(ASAN_SHARDED_TESTS) || sharded=1; \
	    skip="^($$(echo $(ASAN_SHARDED) | tr ' ' '|'))$$"; \
	  fi; \
	  cd $(ASAN_BUILD_DIR); \
	  $(SANITIZER_ENV) $(ASAN_CTEST) $${skip:+-LE "$$skip"} -E '_NOT_BUILT$$|Mpi|$(ASAN_NOT_RUN)'; \
	  rest=$$?; \
	  $(SANITIZER_ENV) $(ASAN_SLOW_UNWIND) $(ASAN_CTEST) $${skip:+-LE "$$skip"} -R Mpi \
	    -E '_NOT_BUILT$$'; mpi=$$?; \
	  [ $$sharded -eq 0 ] && [ $$rest -eq 0 ] && [ $$mpi -eq 0 ]; \
	fi

# CI's ASan+UBSan step (.ci/run): `make asan`'s build; the tensor, autograd and nn cases in shards,
# the rest by ctest, in parallel.
ASAN_CI = ASAN_BUILD_DIR=$(ASAN_CI_BUILD_DIR) ASAN_RUN=shards
asan-ci-build:
	@$(MAKE) --no-print-directory asan-build $(ASAN_CI)
asan-ci:
	@$(MAKE) --no-print-directory asan $(ASAN_CI)

tsan-build: deps
	@if [ ! -f $(TSAN_BUILD_DIR)/build.ninja ]; then \
	  cmake -S . -B $(TSAN_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release -DEMBER_SANITIZE=thread \
	    "-DEMBER_SANITIZE_SKIP=$(TSAN_SKIP)" -DEMBER_BUILD_BENCHMARKS=OFF; \
	fi
	@cmake --build $(TSAN_BUILD_DIR) -j $(JOBS) --target $(TSAN_TESTS)

tsan: tsan-build
	@$(call run_tests,$(TSAN_BUILD_DIR),$(TSAN_TESTS),$(TSAN_ENV))

clean:
	rm -rf $(BUILD_DIR)
