#!/usr/bin/env bash
# Session 15, call 13: early sends only (a yield after each send task, eager write tasks) vs the
# committed code, 1 GiB SplitZip unpaced and on links, twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
for round in 1 2; do
for v in head early; do
  case $v in head) export PYTHONPATH=$base;; early) export PYTHONPATH=/tmp/site:$PWD/bench/.prof/early_pkg;; esac
  echo "== $v $round"
  timeout 100 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 6 --links 12.5,25,50 \
     --codecs splitzip --no-nixl --json $OUT/links_${v}_$round.json 2>&1 | grep "|" | grep -v "receiver" | tail -4
done
done
