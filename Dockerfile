# kvferry sidecar: CUDA 13 runtime, torch + CuPy (cupy-cuda13x) + ucxx-cu13, non-root.
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvferry \
    PATH=/opt/kvferry/bin:$PATH

# The CUDA base image fixes the OS release; its apt packages follow that release's security
# updates, so they are deliberately not pinned to exact versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
# CUDA 13 build of torch from PyTorch's index (PyPI's default wheel would pull another CUDA).
RUN pip install --index-url https://download.pytorch.org/whl/cu130 "torch==2.11.0"
COPY pyproject.toml README.md ./
COPY kvferry ./kvferry
# The P/D proxy the Helm chart runs on this image (one copy: the example's).
COPY examples/vllm-pd/proxy.py /opt/kvferry-proxy/proxy.py
# This installs the project itself (grpc: the control plane over gRPC, kvferry serve --grpc-port);
# its dependencies are constrained in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[gpu,grpc]" && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvferry

USER 10001
WORKDIR /home/kvferry
# control API (HTTP) and data plane (UCX or TCP): the defaults of `kvferry serve` (gRPC is off unless
# --grpc-port names a port)
EXPOSE 7700 7701
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7700/healthz', timeout=2)"]
ENTRYPOINT ["kvferry", "serve"]
