#!/usr/bin/env bash
# One device call: the vLLM connector's core on a GPU (bench/vllm_gpu_harness.py: 4K-token
# requests of a Llama-3-8B-shaped cache between two GPU sidecars, auto / raw / splitzip), then
# bench/peers.py's small sizes with more repeats (one-block latency beside NIXL). Carry .whl-svc,
# .whl-ucx and .whl-nixl (bench/make_device_bundles.sh). Usage there: bash bench/vllm_gpu_session.sh
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for codec in auto raw splitzip; do
  timeout 150 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec "$codec" \
      --json "$OUT/vllm_gpu_harness_$codec.json" 2>&1 | tail -3
done
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
timeout 300 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,64M,256M --repeats 30 \
    --json "$OUT/peers_h100_small.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/peers_h100_small.md" | tail -16
