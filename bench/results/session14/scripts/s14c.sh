#!/usr/bin/env bash
# A/B: the spinning loop progresses ucxx each turn (poll) or not (nopoll).
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
mkdir -p /tmp/kvprof/tlsite /tmp/kvtl && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
export PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in ${MODES:-poll nopoll poll nopoll}; do
  if [ $mode = nopoll ]; then export KVF_NOPOLL=1; else unset KVF_NOPOLL; fi
  echo "===== $mode"
  timeout 90 python3 bench/latency.py --device cuda --backend ucxx --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 2>&1 | grep -i "median\|p99" | head -3
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 2M,256M,1G --repeats 8 --codecs raw,splitzip 2>&1 | grep "^| kvferry"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 1G --repeats 8 --links 25,50 --link-min-bytes 1G --codecs splitzip 2>&1 | grep "GB/s | 1 GiB"
done
unset KVF_NOPOLL
bash bench/.prof/tl.sh
