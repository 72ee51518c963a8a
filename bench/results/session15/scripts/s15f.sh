#!/usr/bin/env bash
# Session 15, call 6: streamed SplitZip, old (HEAD) vs new without the deferred check vs new, twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
for round in 1 2; do
for v in old nodefer new; do
  case $v in old) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg;; nodefer) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/nodefer_pkg;; new) export PYTHONPATH=$base;; esac
  echo "== peers $v"
  timeout 150 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 10 \
     --codecs splitzip --no-nixl --json $OUT/peers_${v}_$round.json 2>&1 | grep -v "NIXL INFO" | grep "|" | tail -6
done
done
