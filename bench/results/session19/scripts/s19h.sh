#!/usr/bin/env bash
# Timelines of 1 GiB SplitZip transfers on a 25 GB/s link: 256 MiB chunks (default) and 64 MiB.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
export PYTHONPATH=/tmp/kvprof/tlsite:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # name, then peers.py arguments
  local name=$1; shift
  rm -f /tmp/kvtl/*
  KVF_TL=1 timeout 240 python3 bench/peers.py --device cuda --no-nixl "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/$name.md" | grep GB/s | grep -v receiver
  python3 bench/.prof/tl.py /tmp/kvtl 2 > "$OUT/$name.txt"
  grep -c . "$OUT/$name.txt"
}
run tl_256 --backend ucxx --sizes 1G --repeats 3 --links 25 --codecs splitzip --link-min-bytes 1G
KVFERRY_CHUNK_BYTES=$((64<<20)) run tl_64 --backend ucxx --sizes 1G --repeats 3 --links 25 --codecs splitzip --link-min-bytes 1G
