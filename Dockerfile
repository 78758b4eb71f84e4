# syntax=docker/dockerfile:1
#
# encoder-service image: CUDA runtime base + a virtual environment holding the CUDA builds of torch and
# torchvision and this package. Build:
#   docker build -t encoder-service:0.1.0 --build-arg VCS_REF="$(git rev-parse HEAD)" .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 ...   # other CUDA
# VERSION and VCS_REF become the OCI version and revision labels. CI builds and runs this file with no Docker
# daemon, on a local Debian 12 base and CPU torch (scripts/tiers/image.sh, deploy/README.md "The image").
# TORCH_VERSION / TORCH_INDEX_URL must name a wheel that exists on that index, and the node's driver must
# support that CUDA (torch wheels carry their own CUDA user-space libraries; the base image gives the
# driver-facing environment the NVIDIA container toolkit expects).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- base: the OS Python both stages share (the venv's interpreter is a symlink into /usr/bin) -------------
# apt-get clean: the downloaded .debs stay in the image unless the base's apt config deletes them (Docker's
# Ubuntu images do; not every base does).
FROM ${CUDA_IMAGE} AS base
# An ARG, not ENV: apt's front end is a build setting, not the runtime's environment.
ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*

# ---- build: create /opt/venv with torch and torchvision (CUDA) and the package -------------------------------
FROM base AS build
ARG DEBIAN_FRONTEND=noninteractive
ARG TORCH_VERSION=2.13.0
# torchvision gives the opt-in `--preprocess torchvision-nvjpeg` its nvJPEG decoder (without it, JPEGs are
# decoded by Pillow on the CPU). It must be the release built for TORCH_VERSION: 0.28.x for torch 2.13.
ARG TORCHVISION_VERSION=0.28.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch and torchvision first and on their own (their own layer, cached across code changes), from the
# PyTorch index, so the package's loose `torch>=` requirement is already met and never pulls another build.
# An empty TORCHVISION_VERSION leaves torchvision out: for a CPU image only, whose default preprocessing is pil
# (the CPU test build: scripts/tiers/image.sh).
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" ${TORCHVISION_VERSION:+"torchvision==${TORCHVISION_VERSION}"} \
      --index-url "${TORCH_INDEX_URL}"
# Optional: FlashAttention-4 (pyproject extra [fa4]; ops/attention_fa4.py), its own layer after that. Its CuTe
# DSL runtime comes per CUDA major: nvidia-cutlass-dsl pulls its cu12 libraries by default (the [cu13] extra
# adds cu13 ones), which is what the cu128 torch above needs; cuda-bindings stays 12.x for the same reason
# (for a cu13 torch: --build-arg CUTLASS_DSL="nvidia-cutlass-dsl[cu13]" --build-arg CUDA_BINDINGS="13.0.3").
# --build-arg WITH_FA4=0 leaves it out. Either way the service starts: without it (or if its import, JIT or
# startup check fails) ops/attention.py runs our Triton and torch's kernels, and logs which.
# The versions are those benchmarks/attention/candidates.py measures (there with the cu13 libraries of the
# GPU machine's CUDA 13 torch; benchmarks/RESULTS.md).
ARG WITH_FA4=1
ARG FA4_VERSION=4.0.0b36
ARG CUTLASS_DSL=nvidia-cutlass-dsl
ARG CUTLASS_DSL_VERSION=4.8.1
ARG CUDA_BINDINGS=12.9.6
RUN if [ "${WITH_FA4}" = "1" ]; then \
      pip install --no-cache-dir "flash-attn-4==${FA4_VERSION}" "${CUTLASS_DSL}==${CUTLASS_DSL_VERSION}" \
        "cuda-bindings==${CUDA_BINDINGS}" "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.15.post2" \
        "torch-c-dlpack-ext==0.1.5"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY encoder_service ./encoder_service
# A regular (not editable) install: the runtime stage gets only /opt/venv, not /src. The sglang extra (pyzmq)
# lets the image serve --sglang-protocol (off unless enabled).
RUN pip install --no-cache-dir "/src[sglang]"

# ---- runtime ---------------------------------------------------------------------------------------------------
FROM base AS runtime
ARG VERSION=0.1.0
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="encoder-service" \
      org.opencontainers.image.description="Vision-encoder microservice for Qwen-VL models (HTTP :8000, gRPC :50051)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/encoder-service/encoder_service"

# Fixed numeric UID/GID so Kubernetes' runAsNonRoot can verify it and the chart can pin runAsUser/fsGroup.
RUN groupadd --system --gid 10001 encoder \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin encoder \
 && mkdir -p /models/hf-cache \
 && chown -R 10001:10001 /models

COPY --from=build /opt/venv /opt/venv

# ENCODER_HOST: bind all interfaces inside a container (the CLI's default is loopback).
# HF_HOME: the hub cache; mount a volume here (the chart does) so downloads survive restarts.
# HOME=/tmp: libraries that write under ~ (triton, torch) land on the writable /tmp.
# ENCODER_GIT_COMMIT: the commit encoder_build_info reports (an installed package has no .git to read it from).
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    ENCODER_GIT_COMMIT=${VCS_REF} \
    ENCODER_HOST=0.0.0.0 \
    ENCODER_HTTP_PORT=8000 \
    ENCODER_GRPC_PORT=50051 \
    HF_HOME=/models/hf-cache

WORKDIR /tmp
USER 10001:10001
EXPOSE 8000 50051

# Liveness only (never readiness: model load and graph capture take minutes). Python, not curl: the image
# has no curl. Exec form does not expand variables, so the port is read from the environment by Python.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/live' % os.environ.get('ENCODER_HTTP_PORT', '8000'), timeout=4)"]

ENTRYPOINT ["encoder-service"]
CMD ["serve"]
