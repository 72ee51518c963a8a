#!/usr/bin/env bash
# A/B: ucxx parts posted at once (new) or one after another (KVF_SEQ_SEND=1, the old way).
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
mkdir -p /tmp/kvprof/tlsite /tmp/kvtl && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
export PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in ${MODES:-new seq new seq}; do
  if [ $mode = seq ]; then export KVF_SEQ_SEND=1; else unset KVF_SEQ_SEND; fi
  echo "===== $mode"
  timeout 90 python3 bench/latency.py --device cuda --backend ucxx --block-kib 2048 --n 1000 --long 0 --cpu-threads 0 --json 2>&1 | tail -1 | cut -c1-200
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 2M,256M,1G --repeats 8 --codecs raw,splitzip 2>&1 | grep "^| kvferry" | grep -v "at the rec"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --no-nixl --sizes 1G --repeats 8 --links 50 --link-min-bytes 1G --codecs splitzip 2>&1 | grep "GB/s | 1 GiB" | grep -v "at the rec"
done
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_pipeline.py tests/transport/test_checksum.py tests/transport/test_gpu_buffers.py 2>&1 | tail -2
