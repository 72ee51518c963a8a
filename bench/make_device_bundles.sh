#!/usr/bin/env bash
# Packs what a device call needs that the GPU image lacks (its Python is 3.12, x86-64) into
# git-ignored folders a `run` call carries (64 MiB per call in all), and prints their sizes:
#   .whl-svc/  the daemon's pure-Python and small binary wheels (FastAPI stack, google-crc32c, ...)
#   .whl-ucx/  ucx-site.tar.xz: ucxx with its UCX libraries (the ucxx backend: CUDA IPC / RDMA
#              between GPUs), installed for the GPU image's Python, static libraries, headers and
#              UCX's perftest dropped, xz-compressed (47 MiB of wheels -> ~5 MiB)
# The GPU image already holds torch, CuPy, numpy, httpx, anyio, h11, click, pyyaml,
# prometheus-client, uvloop (KINDS.md); the versions below match this repository's CPU venv.
# Usage: bash bench/make_device_bundles.sh   then in the call: carry [".whl-svc", ".whl-ucx"] and
#   . bench/device_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
SVC=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
     typing-inspection==0.4.5 uvicorn==0.54.0 google-crc32c==1.9.0 opentelemetry-api==1.45.2
     annotated-doc==0.0.7)
UCX=(ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.22.0 rapids-logger==0.3.0)
mkdir -p .whl-svc .whl-ucx .git/info
for folder in .whl-svc .whl-ucx; do
    grep -qxF "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl-svc "${SVC[@]}"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --target "$site" "${UCX[@]}"
find "$site" \( -name '*.a' -o -name '__pycache__' \) -prune -exec rm -rf {} +
rm -rf "$site"/libucx/bin "$site"/libucx/include "$site"/libucxx/include "$site"/libucx/lib/ucx/libucx_perftest*
# libucxx loads the wheel's UCX only if librmm imports (else it takes the system's, UCX 1.16 on the
# GPU image, which ucxx refuses); kvferry makes no RMM allocations, so a stub stands in for it.
mkdir -p "$site/librmm"
printf 'def load_library():\n    """A stand-in: kvferry makes no RMM allocations."""\n    return []\n' > "$site/librmm/__init__.py"
tar -C "$site" -cf - . | xz -9 -T2 > .whl-ucx/ucx-site.tar.xz
du -sh .whl-svc .whl-ucx
