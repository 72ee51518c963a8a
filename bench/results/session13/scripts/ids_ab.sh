# Device check of the session-13 tree: GPU engine tests, then A/B of spinning (default vs 0).
. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/transport/test_gpu_buffers.py \
    tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py tests/engine/test_leases.py \
    tests/codec/test_blockcopy.py tests/client/test_vllm_core_gpu.py 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -4
round() {
  export KVFERRY_SPIN_MS=$1
  for codec in raw auto; do
    timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec $codec --layout in-place \
        --json "$OUT/harness_spin${1}_${codec}_$2.json" 2>&1 | tail -3
  done
  for backend in tcp ucxx; do
    timeout 90 python3 bench/latency.py --device cuda --backend $backend --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 \
      2>&1 | tee "$OUT/latency_spin${1}_${backend}_$2.log" | tail -4
  done
}
for s in -1 0; do echo "=== KVFERRY_SPIN_MS=$s"; round $s 1; done
echo "=== KVFERRY_SPIN_MS=-1 again"; round -1 2
