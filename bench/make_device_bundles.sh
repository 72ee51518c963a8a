#!/usr/bin/env bash
# Packs what a device call needs that the GPU image lacks (its Python is 3.12, x86-64) into
# git-ignored folders a `run` call carries (64 MiB per call in all), and prints their sizes:
#   .whl-svc/  the daemon's pure-Python and small binary wheels (FastAPI stack, google-crc32c, ...)
#   .whl-ucx/  ucx-site.tar.xz: ucxx with its UCX libraries (the ucxx backend: CUDA IPC / RDMA
#              between GPUs), installed for the GPU image's Python, static libraries, headers and
#              UCX's perftest dropped, xz-compressed (47 MiB of wheels -> ~5 MiB)
#   .whl-nixl/ nixl-site.tar.xz: NIXL (nixl-cu13, for bench/peers.py) pruned to its Python
#              bindings, the UCX plugin and what they load (readelf's NEEDED closure): the 59 MiB
#              wheel's other plugins, cloud SDKs and torch extensions dropped
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
     annotated-doc==0.0.7 httptools==0.9.0)
UCX=(ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.22.0 rapids-logger==0.3.0)
NIXL=nixl-cu13==1.5.1
mkdir -p .whl-svc .whl-ucx .whl-nixl .git/info
for folder in .whl-svc .whl-ucx .whl-nixl; do
    grep -qxF "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl-svc "${SVC[@]}"
site=$(mktemp -d)
python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --target "$site" "${UCX[@]}"
find "$site" \( -name '*.a' -o -name '__pycache__' \) -prune -exec rm -rf {} +
rm -rf "$site"/libucx/bin "$site"/libucx/include "$site"/libucxx/include "$site"/libucx/lib/ucx/libucx_perftest*
# libucxx loads the wheel's UCX only if librmm imports (else it takes the system's, UCX 1.16 on the
# GPU image, which ucxx refuses); kvferry makes no RMM allocations, so a stub stands in for it.
mkdir -p "$site/librmm"
printf 'def load_library():\n    """A stand-in: kvferry makes no RMM allocations."""\n    return []\n' > "$site/librmm/__init__.py"
tar -C "$site" -cf - . | xz -9 -T2 > .whl-ucx/ucx-site.tar.xz
nixl=$(mktemp -d)
trap 'rm -rf "$site" "$nixl"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$nixl/wheel" "$NIXL"
python3 -m zipfile -e "$nixl"/wheel/*.whl "$nixl/site"
python3 - "$nixl/site" <<'PRUNE'
import os, shutil, subprocess, sys
root = sys.argv[1]
index = {f: os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".so" in f}
def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line]
seeds = [p for f, p in index.items() if f.startswith(("_bindings", "_utils")) and "/nixl_cu13/" in p]
seeds += [p for f, p in index.items() if f == "libplugin_UCX.so"]
seeds += [p for f, p in index.items() if "/ucx/" in p and f.endswith(".so.0.0.0") and f.startswith(
    ("libuct_cuda", "libucm_cuda", "libuct_cma", "libuct_ib.", "libuct_ib_mlx5."))]
keep, todo = set(), list(seeds)
while todo:
    path = todo.pop()
    if path not in keep:
        keep.add(path)
        for name in needed(path):
            todo += [index[name]] if name in index else [p for f, p in index.items() if f.startswith(name)][:1]
for path in set(index.values()) - keep:
    os.remove(path)
for folder in ("nixl_ep_cu13", "nixl_cu13-1.5.1.data", "nixl_cu13.scripts"):
    shutil.rmtree(os.path.join(root, folder), ignore_errors=True)
PRUNE
tar -C "$nixl/site" -cf - . | xz -9 -T2 > .whl-nixl/nixl-site.tar.xz
du -sh .whl-svc .whl-ucx .whl-nixl
