#!/usr/bin/env bash
# One device call (see /work/.library/device) for the GPU codec: carry .whl (nvCOMP, pytest,
# hypothesis), .whl-svc and .whl-ucx (bench/make_device_bundles.sh, bench/device_setup.sh). Runs every GPU test (codec, CUDA
# buffers over both transports, the daemon on a GPU), the GPU codec benchmark, then the host
# profile of the sidecar's 64 MiB block calls.
# Usage there: bash bench/gpu_session.sh [codec_gpu.py options]   (logs and JSON under $OUT)
set -uo pipefail
. bench/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -m pytest -q -p no:cacheprovider -m gpu tests/codec tests/transport tests/service 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 bench/codec_gpu.py --json "$OUT/codec_gpu.json" "$@" 2>&1 | tee "$OUT/codec_gpu.log"
python3 bench/codec_gpu.py --elements 64M --host-profile > "$OUT/host_profile.log" 2>&1
grep -- "--- host profile\|steps, us" "$OUT/host_profile.log"
