#!/usr/bin/env bash
# One device call for the end-to-end benchmark (see /work/.library/device); carry .whl-svc and
# .whl-ucx (bench/make_device_bundles.sh, bench/device_setup.sh). Runs bench/e2e.py over ucxx (CUDA buffers moved by UCX), then
# over TCP (staged through the host) for comparison.
# Usage there: bash bench/e2e_session.sh   (writes logs, JSON, PNG under $OUT)
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 230 python3 bench/e2e.py --backend ucxx --budget-s 150 --transfer-timeout 20 --logs "$OUT/logs-ucxx" \
    --out "$OUT/e2e_ucxx.json" --plot "$OUT/e2e_ucxx.png" > "$OUT/e2e_ucxx.log" 2> "$OUT/e2e_ucxx.err"
rc=$?; echo "ucxx rc $rc"; grep -v "UCX  WARN" "$OUT/e2e_ucxx.err" | tail -25; tail -4 "$OUT/e2e_ucxx.log"
if [ "$rc" != 0 ]; then  # isolate: the same over ucxx with small chunks (the GPU tests' setting)
  timeout 90 python3 bench/e2e.py --backend ucxx --chunk-mib 4 --tokens 1K,4K,16K --links 12.5,100,max \
      --repeats 1 --budget-s 40 --transfer-timeout 10 --logs "$OUT/logs-ucxx-small" --out "$OUT/e2e_ucxx_small.json" \
      --plot "$OUT/e2e_ucxx_small.png" > "$OUT/e2e_ucxx_small.log" 2> "$OUT/e2e_ucxx_small.err"
  echo "ucxx small-chunk rc $?"; grep -v "UCX  WARN" "$OUT/e2e_ucxx_small.err" | tail -12
fi
timeout 170 python3 bench/e2e.py --backend tcp --tokens 1K,2K,4K,8K,16K --repeats 2 --budget-s 90 \
    --transfer-timeout 20 --logs "$OUT/logs-tcp" --out "$OUT/e2e_tcp.json" --plot "$OUT/e2e_tcp.png" \
    > "$OUT/e2e_tcp.log" 2> "$OUT/e2e_tcp.err"
echo "tcp rc $?"; tail -12 "$OUT/e2e_tcp.err"; tail -3 "$OUT/e2e_tcp.log"
