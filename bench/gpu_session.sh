#!/usr/bin/env bash
# One device call (see /work/.library/device): install the carried wheels (.whl: nvCOMP,
# google-crc32c, pytest, hypothesis), run the codec tests with the GPU, then the GPU benchmark.
# Usage there: bash bench/gpu_session.sh   (writes logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -m pytest -q tests/codec -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 bench/codec_gpu.py --json "$OUT/codec_gpu.json" "$@" 2>&1 | tee "$OUT/codec_gpu.log"
