#!/usr/bin/env bash
# One device call: what ucxx's progress mode (KVFERRY_UCX_PROGRESS_MODE) does to kvferry's control
# messages and transfers on this host, beside the tcp backend in the same run. The one-block
# latency (2 MiB, GPU) and kvferry's rows of bench/peers.py (raw, unpaced; SplitZip on links),
# per mode. Carry .whl-svc and .whl-ucx (bench/make_device_bundles.sh).
# Usage there: bash bench/ucx_modes.sh   (MODES="thread blocking", LINK_MODES="thread", REPEATS=10)
set -uo pipefail
. bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
timeout 90 python3 bench/latency.py --device cuda --backend tcp --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 \
    2>&1 | tee "$OUT/latency_tcp.log" | tail -4
for mode in ${MODES:-thread thread-polling blocking polling}; do
  echo "=== KVFERRY_UCX_PROGRESS_MODE=$mode"
  KVFERRY_UCX_PROGRESS_MODE=$mode timeout 90 python3 bench/latency.py --device cuda --backend ucxx --block-kib 2048 --n 1000 \
      --long 0 --cpu-threads 0 2>&1 | tee "$OUT/latency_ucxx_$mode.log" | tail -4
  KVFERRY_UCX_PROGRESS_MODE=$mode timeout 150 python3 bench/peers.py --device cuda --backend ucxx --codecs raw \
      --sizes 2M,64M,256M,1G --repeats "${REPEATS:-10}" --no-nixl --json "$OUT/peers_ucxx_$mode.json" 2>&1 \
      | grep "^|" | tail -9
done
for mode in ${LINK_MODES:-blocking thread}; do
  echo "=== links, KVFERRY_UCX_PROGRESS_MODE=$mode"
  KVFERRY_UCX_PROGRESS_MODE=$mode timeout 200 python3 bench/peers.py --device cuda --backend ucxx --codecs raw,splitzip \
      --sizes 1G --repeats 5 --links 12.5,50 --link-min-bytes 1G --no-nixl --json "$OUT/links_ucxx_$mode.json" 2>&1 \
      | grep "^|" | grep "GB/s |" | tail -9
done
