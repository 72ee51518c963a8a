. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
lscpu | grep -i "model name\|^CPU(s)\|MHz" | head -4
for s in -1 0 -1 0; do
  export KVFERRY_SPIN_MS=$s; echo "=== KVFERRY_SPIN_MS=$s"
  timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec raw --layout in-place 2>&1 | tail -3
  timeout 90 python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 2>&1 | tail -4
done
