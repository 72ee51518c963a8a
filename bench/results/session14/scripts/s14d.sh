#!/usr/bin/env bash
# ucxx progress modes on compressed (streamed) transfers.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in ${MODES:-blocking polling thread-polling blocking polling}; do
  export KVFERRY_UCX_PROGRESS_MODE=$mode
  echo "===== $mode"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 2M,256M,1G --repeats 8 --codecs raw,splitzip 2>&1 | grep "^| kvferry" | grep -v "at the rec"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 1G --repeats 8 --links 50 --link-min-bytes 1G --codecs splitzip 2>&1 | grep "GB/s | 1 GiB" | grep -v "at the rec"
done
