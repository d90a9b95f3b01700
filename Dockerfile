# syntax=docker/dockerfile:1.7
#
# specdec image: one image for the three processes (coordinator, draft_service, target_service);
# the Kubernetes manifests in deploy/ pick the entry point.
#
#   CPU (default):  docker build -t ghcr.io/specdec/specdec:cpu .
#   CUDA:           docker build --build-arg VARIANT=cuda -t ghcr.io/specdec/specdec:cuda .
#
# Both variants run on the same slim Python base: the CUDA variant differs only in the torch wheel
# (PyPI's Linux torch wheels bundle the CUDA runtime; the node supplies the driver through the NVIDIA
# container toolkit / device plugin). The CPU variant takes torch from the PyTorch CPU index so that it
# does not carry ~3 GB of CUDA libraries.
#
# No model weights are baked in: the model cache is the volume /models/cache (XDG_CACHE_HOME), filled at
# pod start by an init container (`specdec.modeling.hub.resolve_model`) or mounted from a pre-populated volume.
# TLS material is never in the image either: it is mounted from Kubernetes Secrets (see docs/operations/deploy.md).

ARG PYTHON_VERSION=3.11
# cpu | cuda
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0

############################ build stages ############################
FROM python:${PYTHON_VERSION}-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# Nothing is compiled here: all dependencies ship wheels, and the runtime stage's gcc builds specdec's C kernels
# on the node.
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

FROM builder AS torch-cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

FROM builder AS torch-cuda
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"

# hadolint ignore=DL3006
FROM torch-${VARIANT} AS app
WORKDIR /src
# Only what the package needs; .dockerignore keeps out .venv, caches, tests and any model weights.
COPY pyproject.toml setup.py constraints.txt README.md LICENSE ./
COPY proto/ ./proto/
COPY scripts/gen_protos.py ./scripts/gen_protos.py
COPY specdec/ ./specdec/
COPY specdec_rpc/ ./specdec_rpc/
COPY specdec_cli/ ./specdec_cli/
COPY specdec_bench/ ./specdec_bench/
COPY specdec_train/ ./specdec_train/
COPY draft_service/ ./draft_service/
COPY target_service/ ./target_service/
COPY coordinator/ ./coordinator/
# Stubs are generated while pip builds the wheel (specdec_rpc/pb is not committed): setup.py's build hook runs
# scripts/gen_protos.py with the grpcio-tools [build-system] pins. The project is installed non-editable, at the
# versions constraints.txt locks (torch: the build above, which `torch==` there matches), without extras (no bench,
# train or dev packages), so that the runtime stage needs nothing from /src. The import check runs isolated (-I),
# on the installed package rather than on /src.
RUN pip install --no-cache-dir -c constraints.txt . \
 && python -I -c "from specdec_rpc.pb import generation_pb2_grpc; import draft_service, target_service, coordinator"

############################ runtime ############################
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Disaggregated speculative decoding: coordinator, draft and target services" \
      org.opencontainers.image.source="https://github.com/specdec/specdec" \
      io.specdec.variant="${VARIANT}"
# gcc builds the native kernels (decode attention, RMSNorm) on the node, for its CPU, at the first model load (in
# the model cache volume, keyed by CPU: specdec/modeling/native.py); without a compiler the servers take the slower torch path.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# Fixed numeric ids: the manifests set runAsUser/fsGroup 10001 and runAsNonRoot.
RUN groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/specdec specdec \
 && mkdir -p /models/cache \
 && chown -R 10001:10001 /models
COPY --from=app /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/models/cache \
    HF_HOME=/models/cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    RAY_USAGE_STATS_ENABLED=0
VOLUME ["/models/cache"]
WORKDIR /home/specdec
USER 10001:10001
# gRPC: coordinator 50051, draft 50061, target 50071; Prometheus metrics 9400/9401/9402
# (specdec/common/defaults.py; tests/test_deploy.py checks that they agree).
EXPOSE 50051 8000 50061 50071 9400 9401 9402
# No HEALTHCHECK: Kubernetes ignores it; the pods use native gRPC probes (deploy/).
CMD ["python", "-m", "coordinator"]
