# A/B on the device: the sidecars' event loop spinning after activity (spin_ms default 50 on a GPU) vs not (0).
. bench/device_setup.sh
export UCX_TLS=tcp,cuda_copy,cuda_ipc
mkdir -p /tmp/kvprof/site; cp bench/.prof/resolve_site.py /tmp/kvprof/site/sitecustomize.py
round() {
  export KVFERRY_SPIN_MS=$1
  for codec in raw auto; do
    rm -f /tmp/resolve.txt
    PYTHONPATH=/tmp/kvprof/site:$PYTHONPATH KVF_RES=1 timeout 120 python3 bench/vllm_gpu_harness.py --tokens 4096 --requests 20 --codec $codec --layout in-place \
        --json "$OUT/harness_spin${1}_$codec.json" 2>&1 | tail -4
    tail -n 2 /tmp/resolve.txt
  done
  for backend in tcp ucxx; do
    timeout 90 python3 bench/latency.py --device cuda --backend $backend --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 \
      2>&1 | tee "$OUT/latency_spin${1}_$backend.log" | tail -4
  done
}
for s in -1 0 -1 0; do echo "=== KVFERRY_SPIN_MS=$s"; round $s; done
