# kvstrata container images. One file, three targets (`make images` builds all):
#
#   operator      kvstrata[operator] on a slim Python base        CMD: kvstrata operator
#   sidecar       the cache sidecar for host transfer mode, slim   CMD: kvstrata sidecar
#                 Python base: no torch, no CUDA. The webhook's init
#                 container runs `python -m kvstrata.operator.install`
#                 from this image too.
#   sidecar-cuda  the same sidecar on a CUDA runtime base, its wheel built on the CUDA
#                 devel base so that setup.py compiles the csrc/ libraries with nvcc.
#
# Every final stage: user 65532:65532, ENTRYPOINT kvstrata, no compiler, no pip
# cache, bytecode precompiled (pods run with a read-only root filesystem), no
# HEALTHCHECK: Kubernetes probes the sidecar's /readyz and /healthz and the
# operator's /healthz itself.
#
# The bases are build arguments pinned to digests. Behind a TLS-intercepting
# proxy, hand its CA bundle to pip as the build secret `pip-ca`
# (`--secret id=pip-ca,src=/path/ca.crt`); it never lands in a layer.

ARG PYTHON_BASE=docker.io/library/python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
ARG CUDA_DEVEL_BASE=docker.io/nvidia/cuda:12.8.1-devel-ubuntu22.04@sha256:6617a625f4090c76c545a0e7d63f2e441718ef9af7f4efe7dd1242a29e289fd7
ARG CUDA_RUNTIME_BASE=docker.io/nvidia/cuda:12.8.1-runtime-ubuntu22.04@sha256:fcbbd60a5ad3db3a1c7375bf14546b369b54064c513224310b2026df50c7a9bd

# -- the project's wheel, built once and installed by every slim target ----------
# setup.py compiles the csrc/ libraries where it finds their compilers. This stage
# adds a C compiler for the sidecar's accept guard (csrc/kvs_accept_guard.c, which
# keeps libzmq from ever seeing EMFILE; KVSTRATA_BUILD_PRELOAD=1: no wheel without
# it); the compiler stays here, the runtime stages get the built library. No C++
# compiler and no nvcc: the wheel carries neither transfer library (host mode
# needs none).
FROM ${PYTHON_BASE} AS wheel
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /tmp/build-env \
    && KVSTRATA_BUILD_CUDA=0 KVSTRATA_BUILD_PRELOAD=1 /tmp/build-env/bin/pip wheel \
       --disable-pip-version-check --no-deps -w /dist /src

# -- /opt/kvstrata: a venv holding kvstrata and its runtime dependencies --------
# The venv's interpreter is the base's, so its runtime stage uses the same base.
# pip and setuptools leave the venv once it is filled: nothing installs at run time.
FROM ${PYTHON_BASE} AS sidecar-env
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    --mount=type=bind,from=wheel,source=/dist,target=/dist \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/kvstrata \
    && /opt/kvstrata/bin/pip install --disable-pip-version-check /dist/kvstrata-*.whl \
    && /opt/kvstrata/bin/pip uninstall --disable-pip-version-check -y pip setuptools

FROM ${PYTHON_BASE} AS operator-env
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    --mount=type=bind,from=wheel,source=/dist,target=/dist \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/kvstrata \
    && /opt/kvstrata/bin/pip install --disable-pip-version-check "$(ls /dist/kvstrata-*.whl)[operator]" \
    && /opt/kvstrata/bin/pip uninstall --disable-pip-version-check -y pip setuptools

# -- the runtime stages ----------------------------------------------------------
FROM ${PYTHON_BASE} AS runtime
# 65532: the conventional non-root id of distroless images; the chart and the
# webhook run the containers as non-root (the sidecar as the vLLM container's user).
RUN groupadd --gid 65532 kvstrata \
    && useradd --uid 65532 --gid 65532 --home-dir /home/kvstrata --create-home \
       --shell /usr/sbin/nologin kvstrata
ENV PATH=/opt/kvstrata/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/kvstrata
USER 65532:65532
ENTRYPOINT ["kvstrata"]

FROM runtime AS operator
COPY --from=operator-env /opt/kvstrata /opt/kvstrata
# 9443: admission webhook (HTTPS); 8080: /healthz.
EXPOSE 9443 8080
CMD ["operator"]

FROM runtime AS sidecar
COPY --from=sidecar-env /opt/kvstrata /opt/kvstrata
# 9464: /metrics /healthz /readyz /status.
EXPOSE 9464
CMD ["sidecar"]

# -- the sidecar for GPU nodes ---------------------------------------------------
# Its wheel is built where nvcc is: there setup.py must compile the CUDA library
# (KVSTRATA_BUILD_CUDA=1 turns a failed compile into a failed build). On a base
# without nvcc the wheel is the slim one and the image a host-mode sidecar.
# The CUDA bases have no Python: Ubuntu's python3 (3.10) comes from apt, with
# venv support only in the stages that build.
FROM ${CUDA_DEVEL_BASE} AS cuda-wheel
# (The devel base has gcc for nvcc; the accept guard needs it too, so a base
# without it gets it here.)
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null || ! command -v gcc >/dev/null; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         python3 python3-venv gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY . /src
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    if command -v nvcc >/dev/null; then export KVSTRATA_BUILD_CUDA=1; \
    else export KVSTRATA_BUILD_CUDA=0; echo "kvstrata: no nvcc here: no CUDA library"; fi; \
    export KVSTRATA_BUILD_PRELOAD=1; \
    python3 -m venv /tmp/build-env \
    && /tmp/build-env/bin/pip wheel --disable-pip-version-check --no-deps -w /dist /src

FROM ${CUDA_RUNTIME_BASE} AS sidecar-cuda-env
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    --mount=type=bind,from=cuda-wheel,source=/dist,target=/dist \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/kvstrata \
    && /opt/kvstrata/bin/pip install --disable-pip-version-check /dist/kvstrata-*.whl \
    && /opt/kvstrata/bin/pip uninstall --disable-pip-version-check -y pip setuptools

FROM ${CUDA_RUNTIME_BASE} AS sidecar-cuda
RUN if ! command -v python3 >/dev/null; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 65532 kvstrata \
    && useradd --uid 65532 --gid 65532 --home-dir /home/kvstrata --create-home \
       --shell /usr/sbin/nologin kvstrata
COPY --from=sidecar-cuda-env /opt/kvstrata /opt/kvstrata
# The CUDA base says NVIDIA_REQUIRE_CUDA=cuda>=12.8, and the NVIDIA container
# runtime refuses to start a container whose requirement the node's driver
# does not meet: the whole Pod, vLLM included, would not start. Our CUDA
# library links cudart statically and ships SASS for its architectures, so
# CUDA's minor-version compatibility runs it on any 12.x driver (>= 525).
# The requirement says that; and because a cache must never take its vLLM
# down, the check is off: on a driver too old for it, the sidecar's first CUDA
# call fails, it says why and serves host mode.
ENV PATH=/opt/kvstrata/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_REQUIRE_CUDA="cuda>=12.0" \
    NVIDIA_DISABLE_REQUIRE=true
WORKDIR /home/kvstrata
USER 65532:65532
EXPOSE 9464
ENTRYPOINT ["kvstrata"]
CMD ["sidecar"]
