#!/usr/bin/env bash
# Session 15, call 4: A/B of one transport message, old (HEAD) vs new (working tree), twice.
. bench/device_setup.sh
base=$PYTHONPATH
for round in 1 2; do
 for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=/tmp/site:$PWD/bench/.prof/old_pkg; else export PYTHONPATH=$base; fi
  for e in "" "--eager"; do
   echo "== $v $e"; timeout 90 python3 bench/.prof/msg_cost.py --backend ucxx --sizes 2M,64M,192M --count 50 $e 2>&1 | grep -v Warn | tail -3
  done
 done
done
export PYTHONPATH=$base
python3 -m pytest -q tests/transport 2>&1 | tail -3
