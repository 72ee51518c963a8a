#!/usr/bin/env bash
# One device call for the engine: the GPU codec and engine tests, then one-block latency between
# two sidecars on one GPU (bench/latency.py --device cuda: 64 KiB and 2 MiB blocks), the CPU
# latency on this host's CPU, and the entropy codec's GPU tests last (a crash there must not hide
# the rest). Carry .whl-svc (bench/make_device_bundles.sh). Usage there: bash bench/gpu_engine_session.sh
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py \
    2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -15
for block in 64 2048; do
  timeout 90 python3 bench/latency.py --device cuda --block-kib $block --n 1000 --long 0 --cpu-threads 0 \
      2>&1 | tee -a "$OUT/latency_gpu.log" | tail -8
done
timeout 100 python3 bench/latency.py --device cpu --n 1000 --long 10000 --cpu-threads 1 2>&1 | tee -a "$OUT/latency_cpu.log" | tail -9
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/codec/test_gpu.py 2>&1 | tee "$OUT/gpu_codec_tests.log" | tail -4
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/codec/test_entropy_gpu.py 2>&1 | tee "$OUT/gpu_entropy_tests.log" | tail -6
