#!/usr/bin/env bash
# Timelines of kvferry transfers (bench/.prof/tl_site.py as sitecustomize).
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
export PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name, then peers.py arguments
  local name=$1; shift
  rm -f /tmp/kvtl/*
  KVF_TL=1 timeout 240 python3 bench/peers.py --device cuda --no-nixl "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/$name.md" | tail -6
  python3 bench/.prof/tl.py /tmp/kvtl ${KEEP:-2} > "$OUT/$name.txt"
}
eval "${TL_RUNS:-run tl_1g --backend ucxx --sizes 1G --repeats 4 --links 50 --codecs splitzip --link-min-bytes 1G; KEEP=3 run tl_2m --backend ucxx --sizes 2M --repeats 20 --codecs raw}"
