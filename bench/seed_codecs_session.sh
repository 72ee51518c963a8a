#!/usr/bin/env bash
# One device call for the seed codecs (k8v4/k4v2, lowrank, tca-tbe): their GPU tests (GPU bytes
# and values == the CPU reference's), bench/codec_gpu.py --seed-codecs (every registered codec
# on real all-layer KV blocks in one run, beside the copy roofline), then each codec's own check
# with its tile/warp variants. Carry .whl-svc (bench/make_device_bundles.sh). Logs under $OUT.
# Usage there: bash bench/seed_codecs_session.sh [quant|tcatbe|lowrank|tests|rows ...]  (default: all)
set -uo pipefail
. bench/device_setup.sh
parts=${*:-tests rows quant tcatbe lowrank}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for part in $parts; do
  case $part in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/codec/test_quant_gpu.py \
             tests/codec/test_tcatbe_gpu.py tests/codec/test_lowrank_gpu.py 2>&1 | tee "$OUT/seed_gpu_tests.log" | tail -25 ;;
    rows) timeout 200 python3 bench/codec_gpu.py --seed-codecs 1G --repeats 5 --json "$OUT/seed_codecs.json" 2>&1 \
             | tee "$OUT/seed_codecs.log" | tail -14 ;;
    quant) timeout 150 python3 bench/quant_gpu_check.py --gib 1 --json "$OUT/quant_gpu.json" 2>&1 | tee "$OUT/quant.log" | tail -30 ;;
    tcatbe) timeout 150 python3 bench/tcatbe_gpu_check.py --gib 1 --repeats 20 --skip-reference --json "$OUT/tcatbe_gpu.json" 2>&1 \
             | tee "$OUT/tcatbe.log" | tail -30 ;;
    lowrank) timeout 150 python3 bench/lowrank_gpu_check.py --mib 1024 --skip-cpu 2>&1 | tee "$OUT/lowrank.log" | tail -20
             timeout 120 python3 bench/lowrank_gpu_check.py --mib 1024 --quantize k8v4 --skip-cpu 2>&1 | tee -a "$OUT/lowrank.log" | tail -20 ;;
  esac
done
