#!/usr/bin/env bash
# One device call for the engine: what a control message and a GPU write cost here, the engine's
# and the connector's GPU tests, one-block latency on the GPU (64 KiB, 2 MiB) and on this host's
# CPU (owned and shared-memory destinations), kvferry beside NIXL unpaced and on emulated links,
# and the vLLM connector's core (in place and through a mirror).
# Carry .whl-svc, .whl-ucx and .whl-nixl (bench/make_device_bundles.sh).
# Usage there: bash bench/lease_session.sh
set -uo pipefail
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ "${HOP:-1}" = 1 ] && timeout 120 python3 bench/control_hop.py --n 2000 --json "$OUT/control_hop.json" 2>&1 | tail -14
[ "${TESTS:-1}" = 1 ] && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/transport/test_gpu_buffers.py \
    tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py tests/engine/test_leases.py \
    tests/codec/test_blockcopy.py tests/client/test_vllm_core_gpu.py 2>&1 \
    | tee "$OUT/gpu_engine_tests.log" | tail -8
[ "${LATENCY:-1}" = 1 ] && for backend in ${LATENCY_BACKENDS:-tcp}; do for block in 64 2048; do
  timeout 90 python3 bench/latency.py --device cuda --backend $backend --block-kib $block --n 1000 --long 0 \
      --cpu-threads 0 2>&1 | tee "$OUT/latency_gpu_${backend}_${block}k.log" | tail -6
done; done
[ "${LATENCY_CPU:-1}" = 1 ] && for kind in owned shm; do
  timeout 120 python3 bench/latency.py --device cpu --n 1000 --long ${LONG:-0} --cpu-threads 1 --dst-kind $kind 2>&1 \
      | tee "$OUT/latency_cpu_$kind.log" | tail -8
done
[ "${PEERS:-1}" = 1 ] && timeout 480 python3 bench/peers.py --device cuda --backend ucxx --sizes "${SIZES:-2M,64M,256M,1G,4G}" \
    --repeats "${REPEATS:-10}" --links "${LINKS:-12.5,25,50}" --codecs "${CODECS:-raw,splitzip,auto}" \
    --link-min-bytes "${LINK_MIN:-1G}" --json "$OUT/peers.json" 2>&1 | grep -v "NIXL INFO" \
    | tee "$OUT/peers.md" | tail -40
[ "${SMALL_TCP:-0}" = 1 ] && timeout 200 python3 bench/peers.py --device cuda --backend tcp --codecs raw \
    --sizes 2M,64M,256M --repeats 30 --json "$OUT/peers_small_tcp.json" 2>&1 | grep -v "NIXL INFO" \
    | tee "$OUT/peers_small_tcp.md" | tail -14
[ "${HARNESS:-1}" = 1 ] && for layout in ${HARNESS_LAYOUTS:-in-place}; do for codec in ${HARNESS_CODECS:-raw}; do
  timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec $codec --layout $layout \
      --json "$OUT/vllm_gpu_harness_${codec}_$layout.json" 2>&1 | tail -4
done; done
