. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/codec/test_blockcopy.py tests/transport/test_gpu_buffers.py \
    tests/engine/test_gpu_transfers.py tests/engine/test_gpu_service.py tests/engine/test_leases.py \
    tests/client/test_vllm_core_gpu.py 2>&1 | tail -4
python3 bench/.prof/copy_bench.py 2>&1 | grep -v Warning | grep -v "launch(" | grep -v "rows\[" 
for i in 1 2; do
  timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec raw --layout in-place --json "$OUT/harness_raw_$i.json" 2>&1 | tail -3
done
