#!/usr/bin/env bash
# Session 16, call 4: timelines of 1 GiB SplitZip at 50 GB/s and unpaced, old and new.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
pp() { case $1 in new) echo $base;; *) echo /tmp/site:$PWD/bench/.prof/${1}_pkg;; esac; }
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite /tmp/res && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
for v in old new; do
for link in 50 0; do
  rm -f /tmp/kvtl/*
  if [ $link = 0 ]; then L=""; else L="--links $link --link-min-bytes 1G"; fi
  PYTHONPATH=/tmp/kvprof/tlsite:$(pp $v) KVF_TL=1 timeout 120 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G \
     --repeats 5 $L --codecs splitzip --no-nixl > /tmp/res/tl_${v}_$link.md 2>&1
  python3 bench/.prof/tl.py /tmp/kvtl 2 > /tmp/res/tl_${v}_$link.txt
  echo "$v $link"; grep "|" /tmp/res/tl_${v}_$link.md | grep -v receiver | tail -2
done
done
tar -czf $OUT/res.tgz -C /tmp res
