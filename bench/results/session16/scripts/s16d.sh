#!/usr/bin/env bash
# Session 16, call 5: host time of SplitZip's launches; new vs new+yield (a send task runs before
# the next encode launches), 1 GiB unpaced and at 50/25 GB/s, twice; a timeline of new+yield at 50.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
mkdir -p /tmp/res
timeout 120 python3 bench/.prof/hostprof.py > /tmp/res/hostprof.txt 2>&1; grep -E "launch median|us$" /tmp/res/hostprof.txt
pp() { case $1 in new) echo $base;; *) echo /tmp/site:$PWD/bench/.prof/${1}_pkg;; esac; }
for round in 1 2; do
for v in new yield; do
  echo "== $v $round"
  PYTHONPATH=$(pp $v) timeout 120 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 8 --links 25,50 \
     --link-min-bytes 1G --codecs splitzip --no-nixl > /tmp/res/ab_${v}_$round.log 2>&1
  grep "|" /tmp/res/ab_${v}_$round.log | grep -v receiver | tail -3
done
done
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
rm -f /tmp/kvtl/*
PYTHONPATH=/tmp/kvprof/tlsite:$(pp yield) KVF_TL=1 timeout 120 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G \
   --repeats 5 --links 50 --link-min-bytes 1G --codecs splitzip --no-nixl > /tmp/res/tl_yield_50.md 2>&1
python3 bench/.prof/tl.py /tmp/kvtl 2 > /tmp/res/tl_yield_50.txt
tar -czf $OUT/res.tgz -C /tmp res
