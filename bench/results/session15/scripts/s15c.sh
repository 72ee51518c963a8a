#!/usr/bin/env bash
. bench/device_setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD/bench/.prof
for case in "ucxx 2M --eager" "ucxx 64M --eager"; do
  set -- $case; b=$1; s=$2; shift 2
  name=$(echo "$b-$s$*" | tr -d ' -')
  mkdir -p $OUT/$name
  OUT=$OUT/$name MTL_SYNC=1 KVF_MTL=1 timeout 90 python3 bench/.prof/msg_cost.py --backend $b --sizes $s --count 60 "$@" 2>&1 | grep -v Warn | tail -1
  python3 bench/.prof/mtl_sum.py $OUT/$name/mtl_send.json $OUT/$name/mtl_recv.json > $OUT/$name/summary.txt
  grep -E "crc|send_rest|complete|conn.send" $OUT/$name/summary.txt
done
timeout 120 python3 bench/.prof/crc_bench.py 2>&1 | tail -8
timeout 60 python3 bench/.prof/pure.py nixl --size 2M --n 200 2>&1 | grep case
timeout 60 python3 bench/.prof/pure.py ucxx --size 2M --n 200 --header --sync 2>&1 | grep case
