#!/usr/bin/env bash
# One device call for the engine: the engine's GPU tests, then one-block latency between two
# sidecars on one GPU (bench/latency.py --device cuda: 64 KiB and 2 MiB blocks written over CUDA
# IPC; 2 MiB streamed with SplitZip for comparison), the CPU latency on this host's CPU (1,000
# then 10,000), the payload checksums' cost (bench/checksum.py) and the entropy codec's GPU
# benchmark. Carry .whl-svc and .whl-ucx (bench/make_device_bundles.sh).
# Usage there: bash bench/gpu_engine_session.sh
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
python3 -c 'import ucxx; print("ucxx", ucxx.__version__)' || echo "no ucxx: its tests skip"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/transport/test_checksum.py tests/transport/test_gpu_buffers.py \
    tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -8
timeout 60 python3 bench/checksum.py --sizes 2M,64M,256M 2>&1 | tee "$OUT/checksum_gpu.log" | tail -12
for block in 64 2048; do
  timeout 90 python3 bench/latency.py --device cuda --block-kib $block --n 1000 --long 0 --cpu-threads 0 --json \
      > "$OUT/latency_gpu_${block}k.json" && tail -c 900 "$OUT/latency_gpu_${block}k.json"; echo
done
timeout 90 python3 bench/latency.py --device cuda --block-kib 2048 --codec splitzip --n 300 --long 0 --cpu-threads 0 \
    2>&1 | tail -6
timeout 120 python3 bench/latency.py --device cpu --n 1000 --long 10000 --cpu-threads 1 2>&1 | tee "$OUT/latency_cpu.log" | tail -9
[ "${ENTROPY:-0}" = 1 ] && timeout 150 python3 bench/entropy_gpu.py --elements 256M --repeats 5 2>&1 | tee "$OUT/entropy_gpu.log" | tail -30
