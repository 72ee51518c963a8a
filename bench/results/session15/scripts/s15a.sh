#!/usr/bin/env bash
# Session 15, call 1: what one message costs at the library level (pure ucxx, NIXL) vs kvferry's transport.
. bench/device_setup.sh
cd bench/.prof
nvidia-smi --query-gpu=name --format=csv,noheader
P=python3
{
for s in 2M 64M; do
  timeout 60 $P pure.py ucxx --size $s --n 200
  timeout 60 $P pure.py ucxx --size $s --n 200 --spin
  timeout 60 $P pure.py ucxx --size $s --n 200 --spin --header --sync
  timeout 60 $P pure.py ucxx --size $s --n 200 --mode polling
  timeout 60 $P pure.py nixl --size $s --n 200
done
timeout 60 $P pure.py ucxx --size 4K --n 400 --spin
timeout 60 $P pure.py nixl --size 4K --n 400
timeout 90 $P msg_cost.py --backend ucxx --sizes 2M,64M --count 60
timeout 90 $P msg_cost.py --backend ucxx --sizes 2M,64M --count 60 --spin
timeout 90 $P msg_cost.py --backend tcp --sizes 2M,64M --count 60 --spin
} 2>&1 | grep -v Warning | tee $OUT/s15a.txt
