#!/usr/bin/env bash
# One device call: which UCX transport list moves CUDA buffers between two processes here
# (python -m kvferry.transport.bench --device cuda:0 per UCX_TLS), then bench/e2e.py over ucxx with the
# fastest list that worked. Carry .whl-svc and .whl-ucx (bench/make_device_bundles.sh, bench/device_setup.sh).
# Usage there: bash bench/ucx_gpu_session.sh   (writes probe.log, e2e_* and sidecars.log under $OUT)
set -uo pipefail
. bench/device_setup.sh
# First what UCX itself says (transports found, memory types, errors), and host memory as control.
UCX_TLS=tcp,cuda_copy,cuda_ipc UCX_LOG_LEVEL=info timeout 45 python3 -m kvferry.transport.bench --backend ucxx \
    --device cuda:0 --size 4MiB --count 2 > "$OUT/ucx_info.log" 2>&1
grep -i "cuda\|memtype\|transport\|error" "$OUT/ucx_info.log" | sed 's/^\[[^]]*\] *//' | sort | uniq -c | head -20
UCX_TLS=tcp timeout 45 python3 -m kvferry.transport.bench --backend ucxx --size 64MiB --count 8 2>&1 | tail -1
best=""; best_rate=0
for tls in tcp,cuda_copy,cuda_ipc tcp,cuda_copy all sm,cuda_copy,cuda_ipc,tcp; do
  echo "== UCX_TLS=$tls" >> "$OUT/probe.log"
  UCX_TLS=$tls UCX_LOG_LEVEL=warn timeout 45 python3 -m kvferry.transport.bench --backend ucxx --device cuda:0 \
      --size 64MiB --count 8 >> "$OUT/probe.log" 2>&1
  rate=$(tail -1 "$OUT/probe.log" | grep -o '[0-9.]* GB/s$' | cut -d' ' -f1)
  echo "UCX_TLS=$tls: ${rate:-failed} GB/s"
  if [ -n "$rate" ] && awk "BEGIN{exit !($rate > $best_rate)}"; then best=$tls; best_rate=$rate; fi
done
echo "== tcp backend" >> "$OUT/probe.log"
timeout 45 python3 -m kvferry.transport.bench --backend tcp --device cuda:0 --size 64MiB --count 8 2>&1 | tee -a "$OUT/probe.log" | tail -1
grep -v "^\[" "$OUT/probe.log" | grep -i "error\|GB/s" | sort | uniq -c | head -20
[ -z "$best" ] && { echo "no UCX transport list moved CUDA buffers"; exit 0; }
echo "e2e over ucxx with UCX_TLS=$best"
timeout 220 python3 bench/e2e.py --backend ucxx --ucx-tls "$best" --budget-s 150 --transfer-timeout 20 \
    --logs /tmp/e2e-logs --out "$OUT/e2e_ucxx.json" --plot "$OUT/e2e_ucxx.png" > "$OUT/e2e_ucxx.log" 2> "$OUT/e2e_ucxx.err"
echo "e2e rc $?"; grep -v "UCX  WARN" "$OUT/e2e_ucxx.err" | tail -25; tail -3 "$OUT/e2e_ucxx.log"
tail -n 30 /tmp/e2e-logs/*.log > "$OUT/sidecars.log" 2>&1
