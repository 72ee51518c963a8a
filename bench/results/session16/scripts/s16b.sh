#!/usr/bin/env bash
# Session 16, call 3: GPU tests; old / new / new with encodes waited for / new with decodes waited
# for, 1 GiB SplitZip unpaced and at 50 GB/s, twice; then timelines of old and new, unpaced.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/codec/test_pending.py tests/engine/test_pipeline.py \
   tests/transport/test_checksum.py tests/engine/test_faults.py 2>&1 | tail -5 | tee $OUT/tests_new.log
pp() { case $1 in new) echo $base;; *) echo /tmp/site:$PWD/bench/.prof/${1}_pkg;; esac; }
for round in 1 2; do
for v in old new encsync decsync; do
  echo "== $v $round"
  PYTHONPATH=$(pp $v) timeout 120 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G --repeats 8 --links 50 \
     --link-min-bytes 1G --codecs splitzip --no-nixl --json $OUT/ab_${v}_$round.json > $OUT/ab_${v}_$round.log 2>&1
  grep "|" $OUT/ab_${v}_$round.log | grep -v receiver | tail -2
done
done
mkdir -p /tmp/kvtl /tmp/kvprof/tlsite && cp bench/.prof/tl_site.py /tmp/kvprof/tlsite/sitecustomize.py
for v in old new; do
  rm -f /tmp/kvtl/*
  PYTHONPATH=/tmp/kvprof/tlsite:$(pp $v) KVF_TL=1 timeout 120 python3 bench/peers.py --device cuda --backend ucxx --sizes 1G \
     --repeats 5 --codecs splitzip --no-nixl > $OUT/tl_$v.md 2>&1
  python3 bench/.prof/tl.py /tmp/kvtl 2 > $OUT/tl_$v.txt
  grep "|" $OUT/tl_$v.md | grep -v receiver | tail -1
done
