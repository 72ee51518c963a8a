#!/usr/bin/env bash
# Session 15, call 5: GPU tests at the new code; one message and streamed transfers, old (HEAD
# 7d2e7a1, bench/.prof/old_pkg) vs new (working tree), same machine.
. bench/device_setup.sh
export UCX_TLS=${UCX_TLS:-tcp,cuda_copy,cuda_ipc}
base=$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/transport tests/engine/test_gpu_transfers.py \
   tests/engine/test_pipeline.py tests/engine/test_faults.py 2>&1 | tail -12 | tee $OUT/tests_new.log
PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg timeout 120 python3 -m pytest -q -p no:cacheprovider -rf \
   tests/transport/test_peer_loss.py 2>&1 | tail -6 | tee $OUT/tests_old_peer_loss.log
for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg; else export PYTHONPATH=$base; fi
  echo "== $v"; timeout 90 python3 bench/.prof/msg_cost.py --backend ucxx --sizes 2M,192M --count 50 --eager 2>&1 | grep -v Warn | tail -2
done
for v in old new old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg; else export PYTHONPATH=$base; fi
  echo "== peers $v"
  timeout 200 python3 bench/peers.py --device cuda --backend ucxx --sizes 2M,256M,1G --repeats 8 --links 12.5,25,50 \
     --codecs splitzip --no-nixl --json $OUT/peers_$v.json 2>&1 | grep -v "NIXL INFO" | tail -14
done
