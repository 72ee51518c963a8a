. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
python3 bench/control_hop.py --n 1000 2>&1 | grep -E "uvloop, round|healthz, raw"
for i in 1 2 3; do
  timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec raw --layout in-place --json "$OUT/harness_raw_$i.json" 2>&1 | tail -3
done
for b in tcp ucxx; do timeout 90 python3 bench/latency.py --device cuda --backend $b --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 2>&1 | tail -4; done
