#!/usr/bin/env bash
# Session 16, call 12: a tapered chunk plan on slow links (tree) vs without (HEAD 796832c), 1 GiB
# SplitZip unpaced and on links, twice; GPU tests of the engine's transfers.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
mkdir -p /tmp/res
for round in 1 2; do
for v in head taper; do
  echo "== $v $round"
  if [ $v = head ]; then P=/tmp/site:$PWD/bench/.prof/head_pkg; else P=$base; fi
  PYTHONPATH=$P timeout 130 python3 bench/peers.py --device cuda --backend ucxx --sizes 256M,1G --repeats 8 \
     --links 12.5,25,50 --link-min-bytes 256M --codecs splitzip --no-nixl --json /tmp/res/ab_${v}_$round.json \
     > /tmp/res/ab_${v}_$round.log 2>&1
  grep "|" /tmp/res/ab_${v}_$round.log | grep -v receiver | tail -8
done
done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_transfers.py tests/engine/test_pipeline.py 2>&1 | tail -3
tar -czf $OUT/res.tgz -C /tmp res
