#!/usr/bin/env bash
# Session 15, call 7: GPU tests at the working tree; streamed SplitZip, base (7d2e7a1) vs s15 (61dc09c) vs new (tree), twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/transport/test_checksum.py tests/transport/test_gpu_buffers.py \
   tests/engine/test_gpu_transfers.py tests/engine/test_pipeline.py tests/engine/test_faults.py 2>&1 | tail -6 | tee $OUT/tests.log
for round in 1 2; do
for v in base s15 new; do
  case $v in base) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/base_pkg;; s15) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/s15_pkg;; new) export PYTHONPATH=$base;; esac
  echo "== peers $v $round"
  timeout 150 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 12 \
     --codecs splitzip --no-nixl --json $OUT/peers_${v}_$round.json 2>&1 | grep -v "NIXL INFO" | grep "|" | tail -6
done
done
export PYTHONPATH=$base
echo "== links new"
timeout 200 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G,4G --repeats 8 --links 12.5,25,50 \
     --codecs splitzip --json $OUT/peers_links.json 2>&1 | grep -v "NIXL INFO" | grep "|" | tail -24
