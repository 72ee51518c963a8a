#!/usr/bin/env bash
# Session 15, call 2: timelines of one kvferry transport message (ucxx, GPU), by step.
. bench/device_setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD/bench/.prof
nvidia-smi --query-gpu=name --format=csv,noheader
for case in "ucxx 2M" "ucxx 64M" "ucxx 2M --spin" "ucxx 2M --eager" "tcp 2M" ; do
  set -- $case; b=$1; s=$2; shift 2
  name=$(echo "$b-$s$*" | tr -d ' -')
  mkdir -p $OUT/$name
  OUT=$OUT/$name KVF_MTL=1 timeout 90 python3 bench/.prof/msg_cost.py --backend $b --sizes $s --count 60 "$@" 2>&1 | grep -v Warn | tail -2
  python3 bench/.prof/mtl_sum.py $OUT/$name/mtl_send.json $OUT/$name/mtl_recv.json > $OUT/$name/summary.txt
  cat $OUT/$name/summary.txt
done
