#!/usr/bin/env bash
# Session 16, call 6: GPU tests at the tree; old (c1d5b96) vs new (tree), streamed SplitZip
# 2 MiB / 256 MiB / 1 GiB unpaced and 1 GiB on links, twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
mkdir -p /tmp/res
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python3 -m pytest -q -p no:cacheprovider -rf tests/codec/test_pending.py tests/engine/test_pipeline.py \
   tests/transport tests/engine/test_gpu_transfers.py tests/engine/test_faults.py tests/codec/test_gpu.py \
   tests/codec/test_blocks.py 2>&1 | tail -12 | tee /tmp/res/tests.log
pp() { case $1 in new) echo $base;; *) echo /tmp/site:$PWD/bench/.prof/${1}_pkg;; esac; }
for round in 1 2; do
for v in old new; do
  echo "== $v $round"
  PYTHONPATH=$(pp $v) timeout 130 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 8 \
     --links 12.5,25,50 --link-min-bytes 1G --codecs splitzip --no-nixl --json /tmp/res/ab_${v}_$round.json \
     > /tmp/res/ab_${v}_$round.log 2>&1
  grep "|" /tmp/res/ab_${v}_$round.log | grep -v receiver | tail -6
done
done
tar -czf $OUT/res.tgz -C /tmp res
