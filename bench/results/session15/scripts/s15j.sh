#!/usr/bin/env bash
# Session 15, call 11: streamed SplitZip, s15 (61dc09c) vs tree (encode behind sends and decode
# before more chunks in worker threads), unpaced twice and on links; the tree's GPU tests.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_gpu_transfers.py tests/engine/test_pipeline.py \
   tests/engine/test_faults.py 2>&1 | tail -3 | tee $OUT/tests.log
for round in 1 2; do
for v in s15 nooverlap new; do
  unset KVF_NO_OVERLAP
  case $v in s15) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/s15_pkg;; nooverlap) export PYTHONPATH=$PWD/bench/.prof/ab_site:$base KVF_NO_OVERLAP=1;; new) export PYTHONPATH=$base;; esac
  echo "== peers $v $round"
  timeout 150 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 12 \
     --codecs splitzip --no-nixl --json $OUT/peers_${v}_$round.json 2>&1 | grep -v "NIXL INFO" | grep "|" | grep -v receiver | tail -3
done
done
unset KVF_NO_OVERLAP
for v in s15 new; do
  case $v in s15) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/s15_pkg;; new) export PYTHONPATH=$base;; esac
  echo "== links $v"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 8 --links 12.5,25,50 \
     --codecs splitzip --no-nixl --json $OUT/peers_links_$v.json 2>&1 | grep -v "NIXL INFO" | grep "|" | grep -v "receiver\|vLLM" | tail -4
done
