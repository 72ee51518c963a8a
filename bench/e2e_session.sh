#!/usr/bin/env bash
# One device call for the end-to-end benchmark (see /work/.library/device). Carried: .whl-svc
# (the daemon's wheels the GPU image lacks) and .carry/ucx-site.tar.xz (ucxx + UCX libraries,
# librmm stubbed: kvferry makes no RMM allocations). Runs the GPU service tests on both
# transports, then bench/e2e.py with ucxx (TCP if ucxx cannot move CUDA buffers here).
# Usage there: bash bench/e2e_session.sh [e2e.py arguments]   (writes logs, JSON, PNG under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT" /tmp/ucx
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-svc/*.whl || exit 1
tar -xJf .carry/ucx-site.tar.xz -C /tmp/ucx || exit 1
export PYTHONPATH=/tmp/site:/tmp/ucx/.ucx-site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
nvidia-smi topo -m 2>&1 | head -8
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/service/test_gpu_service.py 2>&1 | tee "$OUT/gpu_service_tests.log" | tail -15
backend=ucxx
grep -q "ucxx.*PASSED\|passed" "$OUT/gpu_service_tests.log" && ! grep -q "FAILED.*ucxx" "$OUT/gpu_service_tests.log" || backend=tcp
echo "e2e backend: $backend"
python3 bench/e2e.py --backend "$backend" --progress --out "$OUT/e2e.json" --plot "$OUT/e2e.png" "$@" 2>&1 | tee "$OUT/e2e.log"
cp -r /tmp/kvferry-e2e-* "$OUT/" 2>/dev/null
