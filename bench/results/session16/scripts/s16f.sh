#!/usr/bin/env bash
# Session 16, call 11: the control API's answer time while a sidecar streams 1 GiB SplitZip
# transfers, old (c1d5b96) vs new (tree), twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
for round in 1 2; do
for v in old new; do
  echo "== $v $round"
  if [ $v = old ]; then P=/tmp/site:$PWD/bench/.prof/old_pkg; else P=$base; fi
  PYTHONPATH=$P timeout 140 python3 bench/.prof/busy.py 2>&1 | grep -v "NIXL INFO" | tail -6
done
done
