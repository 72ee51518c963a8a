#!/usr/bin/env bash
# Session 16, call 1: GPU tests of the launched (awaited, not blocking) GPU coding; old (c1d5b96,
# bench/.prof/old_pkg) vs new (working tree) streamed SplitZip, unpaced and on links, twice.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/codec/test_pending.py tests/engine/test_pipeline.py \
   tests/transport/test_checksum.py tests/transport/test_gpu_buffers.py tests/transport/test_transfers.py \
   tests/engine/test_gpu_transfers.py tests/transport/test_waiting.py 2>&1 | tail -12 | tee $OUT/tests_new.log
for round in 1 2; do
for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg; else export PYTHONPATH=$base; fi
  echo "== peers $v $round"
  timeout 150 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 8 --links 12.5,25,50 \
     --link-min-bytes 1G --codecs splitzip --no-nixl --json $OUT/peers_${v}_$round.json > $OUT/peers_${v}_$round.log 2>&1; grep "|" $OUT/peers_${v}_$round.log | tail -8 || tail -20 $OUT/peers_${v}_$round.log
done
done
